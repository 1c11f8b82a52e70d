"""MoC over FSDP2 (``trainer.data_parallel=fsdp2``): parameters and optimizer state are DTensors, and each rank
snapshots and writes only its local pieces (issue 12, items 2 and 5). Nothing is gathered, except by these tests'
oracles (:meth:`Trainee.full_snapshot`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import run_ranks
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from trainee import TINY, Trainee

from moc_lightning.layout import build_layout
from moc_lightning.models import ExpertParallelTopology, GPTMoE
from moc_lightning.models.sharded import data_parallel_meshes, shard_gpt_moe
from moc_lightning.pieces import check_supported

pytestmark = pytest.mark.xdist_group("fsdp2_checkpoint")  # one worker writes the module's checkpoints once


def _layouts(rank: int, world_size: int) -> dict:
    """Unit keys and bytes of the same model under DDP and under FSDP2 (ep=1: experts sharded over both ranks;
    ep=2: each expert whole on its one holder); what MoC answers to HSDP."""
    out = {}
    for mode, ep in (("ddp", 1), ("fsdp2", 1), ("ddp", 2), ("fsdp2", 2)):
        trainee = Trainee(ExpertParallelTopology.from_process_group(ep), fsdp2=mode == "fsdp2")
        trainee.step(1)  # the optimizer state exists
        layout = build_layout(trainee.model, trainee.optimizer, num_experts=TINY.num_experts)
        out[(mode, ep)] = {
            "units": [u.key for u in layout.units],
            "bytes": {u.key: layout.unit_bytes(u) for u in layout.units},
            "local_bytes": {u.key: layout.unit_bytes(u, local=True).total for u in layout.units},
            "scalar_bytes": {
                u.key: sum(t.numel() * t.element_size() for t in layout.tensors([u]).values() if t.dim() == 0)
                for u in layout.units
            },
            "dtensors": all(isinstance(t, DTensor) for k, t in layout.tensors().items() if t.dim() > 0),
        }
    hsdp = GPTMoE(TINY, ExpertParallelTopology.from_process_group(1), seed=0)
    dense, experts = data_parallel_meshes(world_size, 1, 1, "cpu")
    shard_gpt_moe(hsdp, dense, experts, MixedPrecisionPolicy())
    try:
        check_supported(dict(hsdp.named_parameters()), "GPTMoE")
        out["hsdp"] = "no refusal"
    except ValueError as refusal:
        out["hsdp"] = str(refusal)
    return out


@pytest.mark.slow
def test_layout_of_fsdp2_dtensors_has_ddps_units_and_bytes(tmp_path: Path) -> None:
    """Experts are found in DTensor parameters as in DDP's plain ones, under the same unit keys (checkpoints are
    interchangeable between the modes), and a unit's bytes are the whole unit's (eq. 5/6), while its local bytes
    are this rank's pieces: half of a unit sharded over 2 ranks. HSDP is refused by name."""
    ranks = run_ranks(_layouts, 2, tmp_path)
    for rank in ranks:
        for ep in (1, 2):
            ddp, fsdp2 = rank[("ddp", ep)], rank[("fsdp2", ep)]
            assert fsdp2["dtensors"] and not ddp["dtensors"]
            assert fsdp2["units"] == ddp["units"]
            assert fsdp2["bytes"] == ddp["bytes"]
        sharded = rank[("fsdp2", 1)]
        for key, total in sharded["bytes"].items():
            assert sharded["local_bytes"][key] < total.total, f"{key} is sharded over both ranks"
        assert "trainer.data_parallel=hsdp" in rank["hsdp"] and "not supported yet" in rank["hsdp"]
    sharded = [rank[("fsdp2", 1)] for rank in ranks]
    for key, total in sharded[0]["bytes"].items():
        pieces = sharded[0]["local_bytes"][key] + sharded[1]["local_bytes"][key]
        # the pieces cover the unit once; Adam's scalar steps are held whole by both ranks
        assert pieces == total.total + sharded[0]["scalar_bytes"][key], key
