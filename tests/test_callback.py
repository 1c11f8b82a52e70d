"""MoCCheckpoint in a Lightning Trainer: overlapped snapshots, and resume through ``ckpt_path``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import MODEL, fit, moc_config
from storage_faults import small_filesystem

from moc_lightning.engine.layout import build_layout


class StepTimer(L.Callback):
    """Wall time of each training step, batch start to batch start."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    @property
    def mean_step(self) -> float:
        gaps = [b - a for a, b in zip(self.starts[1:], self.starts[2:])]  # skip the first (warm-up) step
        return sum(gaps) / len(gaps)


class StateCapture(L.Callback):
    """The full state (weights and optimizer), learning rate and step when training starts and ends."""

    def _capture(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        layout = build_layout(module, trainer.optimizers[0], num_experts=MODEL.num_experts)
        return {
            "tensors": {k: v.clone() for k, v in layout.tensors().items()},
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "step": trainer.global_step,
        }

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = self._capture(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.end = self._capture(trainer, module)



def test_snapshot_every_step_is_taken_timed_and_committed(tmp_path: Path) -> None:
    """Every step's snapshot is committed and accounted; how long they stall is the benchmark's business
    (``recipes/bench.py``), not a unit test's on a shared machine."""
    timer = StepTimer()
    config = moc_config(
        tmp_path, every_n_train_steps=1, persist_every_n_snapshots=10, persist_on_fit_end=False,
        remove_snapshots_on_fit_end=False,
    )
    moc = fit(tmp_path, config, 40, [timer])
    stats = moc.engine.stats
    mean_stall = sum(stats.stall_seconds) / len(stats.stall_seconds)
    print(f"mean stall {mean_stall * 1e3:.3f} ms per snapshot, mean step {timer.mean_step * 1e3:.2f} ms")
    assert stats.snapshots == 40 and stats.persists >= 1 and stats.persists + stats.skipped_persists == 4
    assert not any(p.blocking_vote for p in stats.stall_phases), "each persist vote was started the step before"
    assert len(stats.stall_seconds) == len(stats.copy_seconds) == len(stats.snapshot_seconds) == 40
    for stall, wait, copy, snapshot in zip(stats.stall_seconds, stats.wait_seconds, stats.copy_seconds,
                                           stats.snapshot_seconds):  # fmt: skip
        assert 0 < copy <= snapshot and wait <= stall  # the copy overlaps the next step: not all of it is stall
    assert [m.step for m in moc.engine.store.committed()][-1] == 40


def test_resume_restores_weights_optimizer_scheduler_and_step(tmp_path: Path) -> None:
    config = moc_config(
        tmp_path, k_snapshot=8, k_persist=8, every_n_train_steps=5, persist_every_n_snapshots=2,
        remove_snapshots_on_fit_end=False,  # a planned restart: resume from memory
    )
    first, resumed = StateCapture(), StateCapture()
    fit(tmp_path, config, 10, [first])
    moc = fit(tmp_path, config, 20, [resumed])
    assert moc.recovery.resume_step == 10 and resumed.start["step"] == 10 and resumed.end["step"] == 20
    assert {s["level"] for s in moc.recovery.sources.values()} == {"memory_local"}
    assert resumed.start["lr"] == first.end["lr"], "the LR scheduler continues where it stopped"
    assert first.end["lr"] != first.start["lr"]
    for key, tensor in resumed.start["tensors"].items():
        assert torch.equal(tensor, first.end["tensors"][key]), f"{key} differs after resume"


def test_missing_shm_root_fails_before_training(tmp_path: Path) -> None:
    config = moc_config(tmp_path)
    config.shm_root = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(ValueError, match=r"checkpoint.shm_root=.* cannot be created: .* does not exist"):
        fit(tmp_path, config, 2, [])


def test_too_small_shm_root_says_how_much_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    with pytest.raises(ValueError, match=r"has 1.0 MB free, but the snapshot slots need about .* MB \(3 slots"):
        fit(tmp_path, moc_config(tmp_path), 2, [])


def test_shared_memory_too_small_for_the_optimizer_state_fails_with_the_option(tmp_path: Path) -> None:
    """Before the first optimizer step only the weights exist; the start-up check must still size the slots
    with the optimizer state the optimizer will create, and fail loudly, naming the option, before any
    training (not SIGBUS in the middle of a copy, nor a refusal only once the state exists)."""
    try:
        with small_filesystem(tmp_path / "tmpfs", "6m") as tmpfs:  # weights: 3 x 1.3 MB; with AdamW: 3 x 3.8 MB
            config = moc_config(tmp_path, every_n_train_steps=5)
            config.shm_root = str(tmpfs / "moc")
            with pytest.raises(ValueError, match=r"checkpoint.shm_root=.*\(3 slots x 1 ranks x 3.8 MB"):
                fit(tmp_path, config, 10, [])
    except PermissionError as err:
        pytest.skip(f"no small tmpfs to fill: {err}")


@pytest.mark.parametrize("max_steps", [12, 10])  # the last step between snapshots, and a snapshot step
def test_finished_run_leaves_a_complete_checkpoint_of_its_last_step(tmp_path: Path, max_steps: int) -> None:
    end = StateCapture()
    moc = fit(tmp_path, moc_config(tmp_path, every_n_train_steps=5, persist_every_n_snapshots=1), max_steps, [end])
    newest = moc.engine.pec.read_manifest().latest
    layout = moc.engine.pec.layout
    assert newest.step == max_steps and set(newest.units) == {u.key for u in layout.units}

    fresh = StateCapture()
    resumed = fit(tmp_path / "again", moc_config(tmp_path, every_n_train_steps=5), max_steps + 2, [fresh])
    assert resumed.recovery.resume_step == max_steps and fresh.start["step"] == max_steps
    for key, tensor in fresh.start["tensors"].items():
        assert torch.equal(tensor, end.end["tensors"][key]), f"{key} is not the finished run's"


class PersistsLand(L.Callback):
    """Each step begins once the persist in flight has landed: on a loaded machine step 5's persist may still run at
    step 10, which would then skip its own persist (at most one in flight), and the test would read step 5."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.checkpoint_callback.engine
        if engine.persists.in_flight is not None:
            engine.persists.in_flight.exception()  # waits for it


def test_without_persist_on_fit_end_the_last_checkpoint_stays_partial(tmp_path: Path) -> None:
    config = moc_config(tmp_path, every_n_train_steps=5, persist_every_n_snapshots=1, persist_on_fit_end=False)
    moc = fit(tmp_path, config, 10, [PersistsLand()])
    newest = moc.engine.pec.read_manifest().latest
    assert newest.step == 10 and len([u for u in newest.units if u.startswith("expert/")]) == 2  # k_persist x 2 layers
