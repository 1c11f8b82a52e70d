"""A CPU snapshot's copy overlaps the next forward and backward (issue 12's stall bound under FSDP2): the training
thread copies only the buffers a forward may change and hands the rest to the copy thread, which the next optimizer
step joins. A copy made artificially slow shows both halves of the contract: the training thread does not wait for
it at the snapshot, and the slot still holds the state of its step bitwise although the next iteration's forward
and backward ran during the copy (and its optimizer step was held until the copy was done)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from buffered_model import BufferedMoE, N, assert_same_state, full_state, optimizer_of, train
from dist_utils import run_ranks
from lightning_run import MODEL, Recorder, fit, moc_config
from test_training_state import _engine
from trainee import Trainee, every_step_config

from moc_lightning.memory import two_level
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology


@pytest.fixture(autouse=True)
def spare_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core free for the copy thread, as on a GPU node (on this 2-core machine the copy stays on the training
    thread: :func:`moc_lightning.runtime.background.spare_core`)."""
    monkeypatch.setattr(two_level, "spare_core", lambda: True)


SLOW = 0.6
"""Seconds the slowed copy of a snapshot takes (half per ``_foreach_copy_``)."""


@contextlib.contextmanager
def slow_slot_copy(buffers: Iterable[torch.Tensor] = (), fail: bool = False) -> Iterator[list[str]]:
    """Every ``_foreach_copy_`` into a snapshot slot that copies more than ``buffers`` sleeps first, or with ``fail``
    raises; other copies (the optimizer's, FSDP2's all-gather) are left alone. A slot view is told by its storage:
    a shared-memory mapping, which (unlike any storage torch allocates) cannot be resized. Yields the names of the
    threads the slowed copies ran on, as they run (where a copy ran is what overlap means; how long the training thread
    took depends on the machine's load)."""
    real = torch._foreach_copy_
    buffer_storages = {b.untyped_storage().data_ptr() for b in buffers}
    slowed: list[str] = []

    def copy(targets: list[torch.Tensor], sources: list[torch.Tensor], **kw: Any) -> None:
        into_slot = any(not t.untyped_storage().resizable() for t in targets)
        if into_slot and any(s.untyped_storage().data_ptr() not in buffer_storages for s in sources):
            slowed.append(threading.current_thread().name)
            if fail:
                raise RuntimeError("slot copy failed")
            time.sleep(SLOW / 2)
        real(targets, sources, **kw)

    with mock.patch.object(torch, "_foreach_copy_", copy):
        yield slowed


def _off_the_training_thread(slowed: list[str]) -> None:
    """Every slowed slot copy ran, and none on the calling (training) thread."""
    assert slowed, "no copy into a slot was slowed"
    here = threading.current_thread().name
    assert here not in slowed, f"the training thread ({here}) did a slot copy: {slowed}"


def _next_forward_backward(model: BufferedMoE, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()


def test_the_copy_overlaps_the_next_iteration_and_the_slot_holds_its_step_bitwise(tmp_path: Path) -> None:
    model = BufferedMoE(seed=0)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(1, 4))
    engine = _engine(model, optimizer, tmp_path, "shm", persist_every_n_snapshots=1)
    engine.reserve_slots()
    expected = {k: v.detach().clone() for k, v in engine.pec.layout.pieces(engine.pec.layout.units).items()}
    state = full_state(model, optimizer)
    with slow_slot_copy(model.buffers()) as slowed:
        engine.snapshot(3, {"marker": "step 3"})
        assert 3 not in [m.step for m in engine.store.committed()], "no meta.json before every byte is in place"
        _next_forward_backward(model, optimizer, 4)
        assert not torch.equal(model.norm.running_mean, expected["dense/norm/buffer/running_mean"])
        assert not torch.equal(model.moe1.expert_bias, expected["dense/moe1.router/buffer/expert_bias"]), (
            "the forward updated the buffers in place"
        )
        engine.wait_snapshot()  # as before the optimizer step
        optimizer.step()
    engine.finish()
    _off_the_training_thread(slowed)
    assert engine.stats.wait_seconds[-1] > 0.5 * SLOW / 2, "the wait before the next step joined the copy"
    assert engine.stats.copy_seconds[-1] >= SLOW
    slot = engine.store.committed()[-1]
    assert slot.step == 3
    got = engine.store.read(slot)
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), f"{key} in the slot is not its value at step 3"
    # the persist of step 3 wrote from that slot: a fresh model recovers step 3 exactly from storage
    fresh = BufferedMoE(seed=1)
    fresh_optimizer = optimizer_of(fresh)
    report = _engine(fresh, fresh_optimizer, tmp_path, "empty_shm").recover()
    assert report.resume_step == 3 and {s["level"] for s in report.sources.values()} == {"storage"}
    assert_same_state(full_state(fresh, fresh_optimizer), state)


def test_an_error_of_the_background_copy_is_raised_at_the_next_call(tmp_path: Path) -> None:
    """Lightning's rule for asynchronous checkpointing: training learns of it at the next call on its thread."""
    model = BufferedMoE(seed=0)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(1, 3))
    engine = _engine(model, optimizer, tmp_path, "shm")
    engine.reserve_slots()
    with slow_slot_copy(model.buffers(), fail=True):
        engine.snapshot(2, {})
        with pytest.raises(RuntimeError, match="slot copy failed"):
            engine.wait_snapshot()
    assert engine.store.committed() == [], "a failed copy leaves a torn slot, never a committed one"


def _held_until_joined(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """A snapshot of step 1 whose copy is slow, while step 2 runs; the optimizer's pre-step hook joins the copy (as
    ``on_before_optimizer_step`` does): the slot holds step 1's local pieces. ``mode``: ``zero2`` (the owner's
    step broadcasts the new weights) or ``fsdp2`` (forward all-gathers the shards)."""
    trainee = Trainee(ExpertParallelTopology.from_process_group(1), zero=mode == "zero2", fsdp2=mode == "fsdp2")
    pec = trainee.engine(every_step_config(N, 1), Path(root, "ckpt").as_uri())
    engine = TwoLevelCheckpointer(pec, SnapshotStore(Path(root, "shm", f"rank{rank}")), behind=True)
    trainee.step(1)
    pec.record_tokens(trainee.model.moe_layers())
    engine.reserve_slots()
    expected = trainee.snapshot()
    trainee.optimizer.register_step_pre_hook(lambda *args: engine.wait_snapshot())
    with slow_slot_copy():
        # not persisted: its persist would run collectives on the default group from another thread, beside step 2's
        engine.snapshot(1, {}, may_persist=False)
        trainee.step(2)
    engine.finish()
    slot = engine.store.committed()[-1]
    got = {k: v.clone() for k, v in engine.store.read(slot).items()}
    after = trainee.snapshot()
    return {"step": slot.step, "got": got, "expected": expected, "changed": [k for k in got if not torch.equal(
        after[k], expected[k])], "wait": engine.stats.wait_seconds[-1]}


@pytest.mark.parametrize("mode", ["zero2", "fsdp2"])
def test_sharded_modes_leave_the_snapshotted_tensors_alone_until_the_step(tmp_path: Path, mode: str) -> None:
    for rank in run_ranks(_held_until_joined, 2, tmp_path, str(tmp_path), mode):
        assert rank["step"] == 1 and rank["got"], "each rank's slot holds its share of step 1"
        assert rank["changed"], "step 2 changed the snapshotted tensors (after the copy)"
        assert rank["wait"] > 0, "the optimizer step waited for the copy"
        for key, tensor in rank["got"].items():
            assert torch.equal(tensor, rank["expected"][key]), f"{mode}: {key} in the slot is not its step-1 value"


def test_gradient_accumulation_keeps_every_snapshot_exact(tmp_path: Path) -> None:
    """With two micro-batches per step, two forwards and backwards run during a snapshot's copy before the step."""
    recorder = Recorder(at=(2, 4))
    config = moc_config(tmp_path, every_n_train_steps=2, k_snapshot=MODEL.num_experts, k_persist=1,
                        remove_snapshots_on_fit_end=False, persist_on_fit_end=False)
    with slow_slot_copy() as slowed:
        moc = fit(tmp_path, config, 4, [recorder], accumulate_grad_batches=2)
    stats = moc.engine.stats
    assert stats.snapshots == 2
    _off_the_training_thread(slowed)
    assert all(wait > 0 for wait in stats.wait_seconds), "each optimizer step after a snapshot joined its copy"
    slots = {meta.step: moc.engine.store.read(meta) for meta in moc.engine.store.committed()}
    for step in (2, 4):
        assert slots[step], f"the slot of step {step} holds tensors"
        for key, tensor in slots[step].items():
            assert torch.equal(tensor, recorder.states[step][key]), f"step {step}: {key} is not its value then"


def _collectives_of_a_snapshot(rank: int, world_size: int, root: str) -> dict[str, int]:
    trainee = Trainee(ExpertParallelTopology.from_process_group(1))
    pec = trainee.engine(every_step_config(2, 1), Path(root, "ckpt").as_uri())
    engine = TwoLevelCheckpointer(pec, SnapshotStore(Path(root, "shm", f"rank{rank}")), behind=True)
    trainee.step(1)
    pec.record_tokens(trainee.model.moe_layers())
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        engine.snapshot(1, {})
    engine.finish()
    return {"all_reduces": all_reduce.call_count, "persists": engine.stats.persists}


def test_a_first_snapshot_sends_one_collective_and_persists(tmp_path: Path) -> None:
    """Before any persist has started none can be running, so the first snapshot needs no persist vote: its one
    collective is the router counts' sum, which it does not wait for (``tests/test_snapshot_agreement.py`` has the
    snapshots after it)."""
    for rank in run_ranks(_collectives_of_a_snapshot, 2, tmp_path, str(tmp_path)):
        assert rank == {"all_reduces": 1, "persists": 1}
