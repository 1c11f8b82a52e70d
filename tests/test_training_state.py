"""The whole training state comes back (issue 11, items 4 and 6), at the engine level: buffers belong to their
units and round-trip bitwise through memory and storage; parameters without optimizer state (frozen, or an
expert that never received a token) are restored without state; recovery never steps the optimizer; the
trainer state is kept per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from buffered_model import BufferedMoE, N, StackedMoE, assert_same_state, full_state, optimizer_of, train
from dist_utils import run_ranks
from torch import nn

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.size_model import size_model
from moc_lightning.engine.units import dense, expert
from moc_lightning.export.consolidate import consolidate
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.storage import make_storage


def _engine(
    model: BufferedMoE, optimizer: torch.optim.Optimizer, tmp_path: Path, shm: str, **kw: Any
) -> TwoLevelCheckpointer:
    config = CheckpointConfig(
        k_snapshot=N, k_persist=N, every_n_train_steps=1, storage=StorageConfig(url=(tmp_path / "ckpt").as_uri()),
        shm_root=str(tmp_path / "shm"), **kw,
    )
    layout = build_layout(model, optimizer, num_experts=N)
    topology = ExpertParallelTopology()
    if torch.distributed.is_initialized():  # every rank holds every expert
        topology = ExpertParallelTopology(torch.distributed.get_world_size(), torch.distributed.get_rank(), ep=1)
    pec = PECCheckpointer(config, layout, topology, make_storage("filesystem", config.storage.url))
    return TwoLevelCheckpointer(pec, SnapshotStore(tmp_path / shm))


def test_persistent_buffers_belong_to_their_units() -> None:
    model = BufferedMoE()
    layout = build_layout(model, optimizer_of(model), num_experts=N)
    keys = set(layout.tensors())
    assert {"dense/norm/buffer/running_mean", "dense/norm/buffer/num_batches_tracked"} <= keys
    assert {f"expert/L0/E{e}/buffer/calls" for e in range(N)} <= keys, "a per-module expert's buffer"
    assert "dense/moe1.router/buffer/expert_bias" in keys, "the layer's [E] routing bias: its router's"
    assert not any(k.startswith("expert/L1/") and "/buffer/" in k for k in keys), "routing state follows no expert"
    assert not any("scratch" in k for k in keys), "non-persistent buffers are not state"
    assert layout.tensors([dense("moe1.router")])["dense/moe1.router/buffer/expert_bias"].data_ptr() == (
        model.moe1.expert_bias.data_ptr()
    ), "an in-place view of the live buffer"
    calls = layout.unit_bytes(expert(0, 2))
    assert calls.buffers == 4 and calls.total == calls.weights + calls.optimizer + calls.buffers
    assert layout.unit_bytes(dense("moe1.router")).buffers == N * 4
    assert layout.unit_bytes(dense("norm")).buffers == 2 * 4 * 4 + 8
    # eq. 5 stays exact: it covers every byte of a full checkpoint, buffers included
    train(model, layout.optimizer, range(1, 3))
    assert size_model(layout).c_full() == pytest.approx(sum(layout.unit_bytes(u).total for u in layout.units))


@pytest.fixture
def saved(tmp_path: Path) -> dict[str, Any]:
    """Three steps, a snapshot (and persist) of every unit at step 3, and the state then."""
    model = BufferedMoE(seed=0)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(1, 4))
    engine = _engine(model, optimizer, tmp_path, "shm", persist_every_n_snapshots=1)
    engine.snapshot(3, {"marker": "step 3"})
    engine.finish()
    assert engine.stats.persists == 1
    frozen = dict(model.named_parameters())["frozen.weight"]
    unused = dict(model.named_parameters())[f"moe0.experts.{N - 1}.fc.weight"]
    assert frozen not in optimizer.state and unused not in optimizer.state, "the model has params without state"
    state = full_state(model, optimizer)
    train(model, optimizer, range(4, 5))
    return {"state": state, "after_one_more_step": full_state(model, optimizer)}


@pytest.mark.parametrize("source", ["memory_local", "storage"])
def test_buffers_and_stateless_params_round_trip_bitwise_without_stepping(
    tmp_path: Path, saved: dict[str, Any], source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = BufferedMoE(seed=1)
    optimizer = optimizer_of(fresh)

    def no_step(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("recovery stepped the optimizer")

    monkeypatch.setattr(optimizer, "step", no_step)
    engine = _engine(fresh, optimizer, tmp_path, "shm" if source == "memory_local" else "empty_shm")
    report = engine.recover()
    assert {s["level"] for s in report.sources.values()} == {source}
    assert report.resume_step == 3 and report.trainer_state == {"marker": "step 3"}
    assert_same_state(full_state(fresh, optimizer), saved["state"])

    monkeypatch.undo()  # the restored state trains on exactly like the original
    train(fresh, optimizer, range(4, 5))
    assert_same_state(full_state(fresh, optimizer), saved["after_one_more_step"])


def test_loaded_state_is_not_decayed_by_recovery(tmp_path: Path, saved: dict[str, Any]) -> None:
    """A live optimizer that already has state (a resume inside one process) gets exactly the stored state."""
    model = BufferedMoE(seed=2)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(10, 12))  # state for every routed parameter, of other values
    _engine(model, optimizer, tmp_path, "empty_shm").recover()
    assert_same_state(full_state(model, optimizer), saved["state"])


def test_consolidation_emits_buffers_under_their_module_names(tmp_path: Path, saved: dict[str, Any]) -> None:
    out = tmp_path / "dense.ckpt"
    consolidate((tmp_path / "ckpt").as_uri(), out, "lightning", progress=False)
    state_dict = torch.load(out, weights_only=True)["state_dict"]
    model = BufferedMoE(seed=1)
    model.load_state_dict(state_dict, strict=True)  # every parameter and persistent buffer, nothing else
    expected = {k.removeprefix("model/"): v for k, v in saved["state"].items() if k.startswith("model/")}
    assert_same_state({k: v.detach() for k, v in model.state_dict().items()}, expected)


def _per_rank_states(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Each rank snapshots its own trainer state; recovery from memory and from storage gives each its own.

    Step 3 is snapshotted and persisted, step 4 only snapshotted, with every dense unit in rank 0's slot
    (``sharding=rank0``); rank 1's node is then lost: step 4 is still the resume step, and rank 1's own
    state of it is gone.
    """
    tmp_path = Path(tmp)
    model = BufferedMoE(seed=0)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(1, 4))
    engine = _engine(model, optimizer, tmp_path, f"shm{rank}", persist_every_n_snapshots=1, sharding="rank0")
    engine.snapshot(3, {"rank": rank})
    engine.finish()
    train(model, optimizer, range(4, 5))
    engine.snapshot(4, {"rank": rank}, may_persist=False)
    engine.finish()
    out = {}
    for name, shm in (("memory", f"shm{rank}"), ("storage", f"empty{rank}"), ("node_lost", f"shm{rank}")):
        if name == "node_lost" and rank == 1:
            shm = "empty1"
        fresh = BufferedMoE(seed=1)
        store_steps = [m.step for m in SnapshotStore(tmp_path / shm).committed()]
        report = _engine(fresh, optimizer_of(fresh), tmp_path, shm, sharding="rank0").recover()
        out[name] = (report.resume_step, report.trainer_state, store_steps)
    return out


@pytest.mark.slow
def test_trainer_state_comes_back_per_rank(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    results = run_ranks(_per_rank_states, 2, tmp_path, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["memory"][:2] == (4, {"rank": rank})
        assert result["storage"][:2] == (3, {"rank": rank})
    assert results[0]["node_lost"][:2] == (4, {"rank": 0})
    assert results[1]["node_lost"][:2] == (4, {"rank": 0}), "rank 1 falls back to the lowest rank's state"
    out = capfd.readouterr().out
    assert out.count("rank 1: its own training state of step 4 is lost") == 1, out


def _ep_bias_layer(rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``r`` of 2 holds stacked experts ``[2r, 2r + 2)`` of a layer and the layer's whole ``[N]`` bias, its entries
    set to ``100 * r + e`` (each rank's copy of the others' entries wrong), named expert state by ``expert_buffers``,
    then shares the entries; and the layout without the override, where the bias is a dense buffer."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": StackedMoE()})
    local = N // world_size
    model["moe"].experts.w = nn.Parameter(model["moe"].experts.w[rank * local : (rank + 1) * local].clone())
    ep = {"expert_offset": rank * local, "num_experts": N, "expert_parallel": world_size}
    routing = sorted(k for k in build_layout(model, None, **ep).tensors() if "/buffer/" in k)
    layout = build_layout(model, None, **ep, expert_buffers=[r"^moe\.expert_bias$"])
    with torch.no_grad():
        model["moe"].expert_bias.copy_(100.0 * rank + torch.arange(N))
    keys = sorted(k for k in layout.tensors() if "/buffer/" in k)
    partly = dict(layout.partly_held_buffers)
    layout.share_expert_entries()
    return {"routing": routing, "keys": keys, "partly": partly, "bias": model["moe"].expert_bias.clone()}


def test_under_ep_a_layer_bias_named_expert_state_gives_each_rank_its_experts_entries_and_the_ranks_share_them(
    tmp_path: Path,
) -> None:
    """Keys as in one process (entry ``e`` is expert ``e``'s), whatever rank holds the expert; after the exchange every
    rank's whole buffer holds each entry as its expert's rank has it. Without ``expert_buffers`` the bias is routing
    state: one dense key, the same on every rank."""
    ranks = run_ranks(_ep_bias_layer, 2, tmp_path)
    one_process = build_layout(nn.ModuleDict({"moe": StackedMoE()}), None, expert_buffers=["expert_bias"])
    assert sorted(k for r in ranks for k in r["keys"]) == sorted(k for k in one_process.tensors() if "/buffer/" in k)
    expected = torch.tensor([100.0 * (e // 2) + e for e in range(N)])
    for rank, got in enumerate(ranks):
        assert got["routing"] == ["dense/moe.router/buffer/expert_bias"], rank
        assert got["keys"] == [f"expert/L0/E{e}/buffer/expert_bias" for e in (2 * rank, 2 * rank + 1)]
        assert got["partly"] == {"moe.expert_bias": (2 * rank, 2 * rank + 1)}
        assert torch.equal(got["bias"], expected), rank
    assert one_process.partly_held_buffers == {}, "one process owns every entry: nothing to share"
