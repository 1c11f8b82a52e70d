"""Routing state comes back with the router, at the resume step (issue 28 item 3, DESIGN.md hard part 10).

A per-expert buffer held by the MoE layer or its router (torchtitan's ``expert_bias``, DeepSeek-V3's
``e_score_correction_bias``, token counters) steers the router, whose weights come back at the resume step; so it is
a dense buffer, restored at the resume step too, whatever step the experts come from. A buffer inside an expert's own
module, or inside a stacked ``experts`` module, stays with its expert; ``expert_buffers`` names a layer's buffer that
is expert state all the same.

The multi-process oracle is this file's own: each routing buffer by torch's name after every step of a fault-free run
of the same seed (the run that then crashes), never MoC's layout. The resume is storage-only: the snapshots in shared
memory are lost (a lost node), so the experts come from older steps than the dense units."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from buffered_model import BufferedMoE, StackedMoE
from buffered_model import N as BUFFERED_N
from dist_utils import run_ranks
from lightning_run import cpu_trainer, moc_config
from titan_moe import TitanMoE
from torch import nn

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout, build_layout
from moc_lightning.engine.units import Unit, dense, expert
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.sharding.zero import ZeroAdamW, partition_by_units

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install moc_lightning[hf])"
)
from test_hf_families import CRASH_AFTER, FAMILIES, Crash, N, Wrapped  # noqa: E402

ROUTING = re.compile(r".*\.(expert_bias|e_score_correction_bias)$")
"""The routing buffers of the torchtitan-style model and of DeepSeek-V3, by torch's names."""


def _owner(layout: Layout, buffer: str) -> list[Unit]:
    """The units holding ``buffer`` (one dense unit, or the experts that own its entries)."""
    return sorted(u for u, slots in layout.slots.items() if any(s.buffer and s.param == buffer for s in slots))


def test_routing_buffers_are_dense_and_an_experts_own_buffers_stay_with_it() -> None:
    titan = build_layout(TitanMoE(num_experts=N), None)
    assert _owner(titan, "layers.0.moe.expert_bias") == [dense("layers.0.moe.router")], "with its router"
    assert _owner(titan, "layers.1.moe.expert_bias") == [dense("layers.1.moe.router")]
    keys = [k for k in titan.tensors() if k.endswith("expert_bias")]
    assert keys == ["dense/layers.0.moe.router/buffer/expert_bias", "dense/layers.1.moe.router/buffer/expert_bias"]

    deepseek = build_layout(FAMILIES["deepseek_v3"].build(), None)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert _owner(deepseek, bias) == [dense("model.layers.1.mlp.gate")], "with its router's weight"

    model = BufferedMoE()
    model.moe1.experts.register_buffer("hits", torch.arange(float(BUFFERED_N)))  # a stacked experts module's own
    model.moe1.router.register_buffer("seen", torch.zeros(BUFFERED_N))  # a router's per-expert counter
    layout = build_layout(model, None)
    assert _owner(layout, "moe1.expert_bias") == [dense("moe1.router")]
    assert _owner(layout, "moe1.router.seen") == [dense("moe1.router")]
    assert _owner(layout, "moe0.experts.1.calls") == [expert(0, 1)], "a per-module expert's buffer"
    assert _owner(layout, "moe1.experts.hits") == [expert(1, e) for e in range(BUFFERED_N)], "sliced, entry e to e"
    assert layout.tensors([expert(1, 2)])["expert/L1/E2/buffer/hits"].item() == 2.0
    assert layout.partly_held_buffers == {}, "one process owns every entry of every per-expert buffer"


def test_under_ep_a_layer_buffer_of_the_local_experts_stays_with_them() -> None:
    """A layer's ``[E_local]`` buffer (values that differ per rank: no dense unit, which every rank holds alike, can
    hold it) is its local experts', in order, while its ``[N]`` buffer is dense."""
    model = nn.ModuleDict({"moe": StackedMoE()})
    local = BUFFERED_N // 2
    model["moe"].experts.w = nn.Parameter(model["moe"].experts.w[local:].clone())  # rank 1 of 2
    model["moe"].register_buffer("local_load", torch.arange(float(local)))
    layout = build_layout(model, None, expert_offset=local, num_experts=BUFFERED_N, expert_parallel=2)
    assert _owner(layout, "moe.local_load") == [expert(0, local + i) for i in range(local)]
    assert layout.tensors([expert(0, local + 1)])["expert/L0/E3/buffer/local_load"].item() == 1.0
    assert _owner(layout, "moe.expert_bias") == [dense("moe.router")]


def test_expert_buffers_names_a_layer_buffer_that_is_expert_state() -> None:
    layout = build_layout(TitanMoE(num_experts=N), None, expert_buffers=[r"layers\.1\.moe\.expert_bias$"])
    assert _owner(layout, "layers.1.moe.expert_bias") == [expert(1, e) for e in range(N)]
    assert _owner(layout, "layers.0.moe.expert_bias") == [dense("layers.0.moe.router")], "only what it names"
    deepseek = build_layout(FAMILIES["deepseek_v3"].build(), None, expert_buffers=["e_score_correction_bias"])
    assert _owner(deepseek, "model.layers.1.mlp.gate.e_score_correction_bias") == [expert(0, e) for e in range(N)]

    with pytest.raises(ValueError, match=r"expert_buffers pattern 'no_such_buffer' matches no buffer"):
        build_layout(TitanMoE(num_experts=N), None, expert_buffers=["no_such_buffer"])
    with pytest.raises(ValueError, match=r"expert_buffers.*'norm.running_mean'.*not held by a MoE layer"):
        build_layout(BufferedMoE(), None, expert_buffers=["running_mean"])
    model = TitanMoE(num_experts=N)
    model.layers[0]["moe"].register_buffer("scale", torch.ones(3))
    with pytest.raises(ValueError, match=r"'layers.0.moe.scale' of shape \(3,\).*8 experts"):
        build_layout(model, None, expert_buffers=["scale"])


@pytest.mark.parametrize("patterns", [["("], [3], "expert_bias"])
def test_checkpoint_expert_buffers_must_be_a_list_of_regular_expressions(patterns: Any) -> None:
    with pytest.raises(ValueError, match="checkpoint.expert_buffers"):
        CheckpointConfig(expert_buffers=patterns)


class Zero2(Wrapped):
    """The minimal module with ZeRO-2: each unit's optimizer state on one rank (:mod:`moc_lightning.sharding.zero`)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        partition = partition_by_units(build_layout(self, None), ExpertParallelTopology.replicated())
        return ZeroAdamW(self.parameters(), partition, lr=1e-2)


class CorrectionBiasUpdate(L.Callback):
    """DeepSeek-V3's auxiliary-loss-free balancing (its paper, section 2.1.2), which ``transformers`` leaves out: after
    each step, ``e_score_correction_bias`` moves by 1e-3 toward the experts that received fewer tokens than the mean,
    counted over all ranks, so the bias differs from step to step (and alike on every rank) as in a real run."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.gates = [m for m in module.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros(N) for _ in self.gates]
        for gate, counts in zip(self.gates, self.counts):
            gate.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor) -> Any:
        def hook(gate: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if gate.training:
                counts.add_(torch.bincount(FAMILIES["deepseek_v3"].route(gate, args, output).reshape(-1), minlength=N))

        return hook

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        for gate, counts in zip(self.gates, self.counts):
            dist.all_reduce(counts)
            with torch.no_grad():
                gate.e_score_correction_bias.add_(1e-3 * torch.sign(counts.mean() - counts))
            counts.zero_()


class RoutingOracle(L.Callback):
    """Each routing buffer by torch's name as training starts and after every step, and a crash after ``crash_after``
    (once MoC's background persist has landed)."""

    def __init__(self, crash_after: int | None) -> None:
        self.crash_after = crash_after
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def _record(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.states[trainer.global_step] = {
            name: buffer.detach().clone() for name, buffer in module.state_dict().items() if ROUTING.match(name)
        }

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._record(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()
        self._record(trainer, module)
        if trainer.global_step == self.crash_after:
            raise Crash(f"killed after step {trainer.global_step}")


def _fit(root: Path, family: str, data_parallel: str, max_steps: int, oracle: RoutingOracle) -> MoCCheckpoint:
    """A 2-rank DDP fit over gloo (the ``Trainer``'s own launch), resuming where MoC says."""
    config = moc_config(root, k_snapshot=4, k_persist=4, every_n_train_steps=2, persist_every_n_snapshots=1)
    moc = MoCCheckpoint(config)
    callbacks: list[L.Callback] = [moc, oracle]
    if family == "deepseek_v3":
        callbacks.insert(1, CorrectionBiasUpdate())
    module = (Zero2 if data_parallel == "zero2" else Wrapped)(FAMILIES[family])
    try:
        cpu_trainer(root / "run", max_steps, callbacks, devices=2).fit(module, ckpt_path=moc.resume_target())
    except Crash:
        pass
    return moc


def _storage_only_resume(rank: int, world_size: int, root: str, family: str, data_parallel: str) -> dict[str, Any]:
    first = RoutingOracle(crash_after=CRASH_AFTER)
    _fit(Path(root), family, data_parallel, 20, first)
    dist.barrier()
    if rank == 0:  # the node is lost: every snapshot in shared memory with it
        shutil.rmtree(Path(root, "shm"))
    dist.barrier()
    second = RoutingOracle(crash_after=None)
    report = _fit(Path(root), family, data_parallel, CRASH_AFTER + 1, second).recovery
    return {"first": first.states, "restored": second.states[report.resume_step], "resume": report.resume_step,
            "sources": {key: (s["level"], s["step"]) for key, s in report.sources.items()}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "data_parallel"), [("torchtitan", "ddp"), ("deepseek_v3", "ddp"), ("torchtitan", "zero2")]
)
def test_routing_state_is_restored_at_the_resume_step_after_a_storage_only_pec_resume(
    tmp_path: Path, family: str, data_parallel: str
) -> None:
    ranks = run_ranks(_storage_only_resume, 2, tmp_path, str(tmp_path), family, data_parallel, init_process_group=False)
    resume = ranks[0]["resume"]
    sources = ranks[0]["sources"]
    assert resume == 6 and {level for level, _ in sources.values()} == {"storage"}
    older = [key for key, (_, step) in sources.items() if key.startswith("expert/") and step < resume]
    assert older, "PEC: some experts come from an older step than the resume step"
    for rank, got in enumerate(ranks):
        before = got["first"]
        assert got["restored"].keys() == before[resume].keys() and before[resume], (rank, "no routing buffer")
        for name, restored in got["restored"].items():
            oldest = min(step for _, step in sources.values())
            assert not torch.equal(before[oldest][name], before[resume][name]), (name, "the buffer must move")
            assert torch.equal(restored, before[resume][name]), (
                f"rank {rank}: {name} is not its value at the resume step {resume}: "
                f"restored {restored.tolist()}, at the resume step {before[resume][name].tolist()}"
            )
            assert torch.equal(restored, ranks[0]["restored"][name]), (rank, name, "the ranks route alike")

