"""The dtype a forward reads each parameter in, from FSDP2's own per-module state: replay mode logs a frozen unit's
weights in it (bf16 under a bf16 ``MixedPrecisionPolicy``, half the bytes of the fp32 shards) and sizes its windows
so; a parameter under no such policy keeps its own dtype."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from dist_utils import run_ranks
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from trainee import TINY

from moc_lightning.engine.compute_dtype import compute_dtypes, param_groups
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.units import ExpertUnit
from moc_lightning.models import ExpertParallelTopology, GPTMoE
from moc_lightning.models.sharded import data_parallel_meshes
from moc_lightning.replay.core import WindowRecord, offset_bytes, window_schedule

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
WINDOW = 4


def _experts_in_bf16(rank: int, world_size: int) -> dict[str, Any]:
    """The tiny model with its experts ``fully_shard``-ed under a bf16 policy and the rest under an fp32 one."""
    model = GPTMoE(TINY, ExpertParallelTopology.from_process_group(1), seed=0)
    dense, experts = data_parallel_meshes(world_size, world_size, 1, "cpu")
    for layer in model.moe_layers():
        fully_shard(list(layer.experts.values()), mesh=experts, mp_policy=BF16)
    for block in model.blocks:
        fully_shard(block, mesh=dense, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mesh=dense, mp_policy=MixedPrecisionPolicy())
    layout = build_layout(model, torch.optim.AdamW(model.parameters()))
    schedule = window_schedule(layout.units, WINDOW)
    record = WindowRecord(schedule, WINDOW)
    copied = [record.capture(layout, t) for t in range(WINDOW)]
    sizes = {unit: layout.unit_bytes(unit, local=True) for unit in layout.units}
    return {
        "dtypes": compute_dtypes(model),
        "experts": sorted(name for unit in layout.expert_units for name in layout.param_names(unit)),
        "logged": {key: tensor.dtype for logged in record.logged for key, tensor in logged.items()},
        "copied": copied,
        "planned": offset_bytes(sizes, schedule, WINDOW),
        "sizes": [(size.weights, size.compute_weights, isinstance(unit, ExpertUnit)) for unit, size in sizes.items()],
        "plain": compute_dtypes(GPTMoE(TINY, ExpertParallelTopology(), seed=0)),
    }


def test_weights_under_a_bf16_fsdp2_policy_are_logged_and_counted_in_bf16_others_in_their_own(tmp_path: Path) -> None:
    """Failed on fea7f32: every frozen weight was logged in fp32, its shard's dtype."""
    (run,) = run_ranks(_experts_in_bf16, 1, tmp_path)
    assert run["dtypes"] == {name: torch.bfloat16 for name in run["experts"]}, "the experts' policy, not the others'"
    assert run["plain"] == {}, "a model without fully_shard computes in its parameters' dtypes"
    weights = {key: dtype for key, dtype in run["logged"].items() if "/param/" in key}
    assert {dtype for key, dtype in weights.items() if key.startswith("expert")} == {torch.bfloat16}
    assert {dtype for key, dtype in weights.items() if not key.startswith("expert")} == {torch.float32}
    for weights_bytes, compute, is_expert in run["sizes"]:
        assert compute == (weights_bytes // 2 if is_expert else weights_bytes)
    assert run["copied"] == run["planned"], "the plan counts what the captures copy"


def test_the_parameter_groups_are_read_from_fsdp2_states_of_torch_2_13_and_of_torch_2_11() -> None:
    """torch 2.13 keeps a list of groups, torch 2.11 (GPU images ship it) one group or ``None``. Failed on 6d39a63
    under torch 2.11 (the quick bench, fsdp2, on the GPU node's CPUs): ``'FSDPState' object has no attribute
    '_fsdp_param_groups'``."""
    a, b = object(), object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
