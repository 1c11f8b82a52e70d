"""Replay mode's memory bound (issue 14, item 3): before training, the host memory of a window is reported
(bytes per iteration, W, the two window slots in shared memory) and checked against the shared-memory root."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning_run import Recorder, fit, moc_config
from trainee import TINY

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import ExpertParallelTopology, GPTMoE
from moc_lightning.replay.core import offset_bytes
from moc_lightning.replay.memory import window_memory, window_plan, window_sizes
from moc_lightning.replay.window_file import FOOTER
from moc_lightning.sharding.zero import ZeroAdamW, partition_by_units

WINDOW = 3


class ReportAtStart(L.Callback):
    """What the MoC callback had reported when training started."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        moc = next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint))
        self.memory: Any = moc.window_memory


def _config(root: Path, **kw: Any) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW), **kw)


def test_replay_reports_the_window_memory_before_training_as_the_captures_copy_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Failed on b4ba765: replay mode reported nothing and sized PEC's snapshot slots instead."""
    seen = ReportAtStart()
    moc = fit(tmp_path, _config(tmp_path, remove_snapshots_on_fit_end=False), 2 * WINDOW, [seen])
    memory = seen.memory
    assert memory is not None, "reported before the first step"
    assert (memory.window, memory.slots) == (WINDOW, 2)
    copied = moc.capture.copied_bytes
    assert len(copied) == 2 * WINDOW
    assert copied[:WINDOW] == copied[WINDOW:], "every window copies the same"
    # before the first step Adam's state is estimated as two moments; the captures also copy its 4-byte steps
    assert list(memory.per_iteration) == pytest.approx(copied[:WINDOW], rel=1e-3)
    assert memory.in_shared_memory == pytest.approx(2 * sum(copied[:WINDOW]), rel=1e-3), "2 window slots"
    slots = sorted((tmp_path / "shm").rglob("*.win"))
    assert len(slots) == 2, "the windows were captured into two files in shared memory"
    for slot in slots:  # the tensor regions end where the tail begins (the footer's first field)
        regions = FOOTER.unpack(slot.read_bytes()[-FOOTER.size :])[0]
        assert regions == pytest.approx(sum(copied[:WINDOW]), rel=1e-2), "a window's captures, aligned"
    out = capsys.readouterr().out
    assert f"replay window W={WINDOW}" in out and f"{memory.in_shared_memory / 1e6:.1f} MB" in out
    assert not list((tmp_path / "shm").rglob("data")), "replay mode reserves no PEC snapshot slots"


def test_replay_refuses_a_shared_memory_root_too_small_for_its_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed on b4ba765: the check sized PEC's k_snapshot slots, not the windows."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    recorder = Recorder()
    with pytest.raises(ValueError) as err:
        fit(tmp_path, _config(tmp_path), 2 * WINDOW, [recorder])
    message = str(err.value)
    assert "checkpoint.shm_root=" in message and "has 1.0 MB free" in message
    assert "replay windows need about" in message and "2 window slots x 1 ranks x" in message
    assert f"checkpoint.replay.window={WINDOW}" in message
    assert recorder.start_step is None, "refused before training started"


def test_under_zero2_a_rank_counts_the_optimizer_state_of_the_units_it_owns_only() -> None:
    """Under ZeRO-2 a unit's optimizer state is on its owner only, so only the owner's captures copy it: the memory
    report and ``window=auto`` (both from ``window_sizes(local=True)``) weigh this rank's bytes, while the schedule,
    planned from whole units, stays the same on every holder. Rank 1 of 2, simulated in one process (the partition
    needs no process group). Failed on fea7f32: every holder counted the owner's state, before the first step and
    after it."""
    topology = ExpertParallelTopology(world_size=2, rank=1)
    model = GPTMoE(TINY, topology, seed=0)
    partition = partition_by_units(build_layout(model, None), topology)
    layout = build_layout(model, ZeroAdamW(model.parameters(), partition, lr=1e-2))
    owners = layout.state_owners
    assert set(owners.values()) == {0, 1}, "each rank owns some units"
    whole, local = window_sizes(layout), window_sizes(layout, local=True)
    for unit, owner in owners.items():
        assert whole[unit].optimizer > 0, f"{unit.key}: the schedule weighs its owner's state on every holder"
        assert local[unit].optimizer == (whole[unit].optimizer if owner == 1 else 0), unit.key
    schedule, _ = window_plan(layout, WINDOW)
    memory = window_memory(layout, WINDOW)
    assert list(memory.per_iteration) == offset_bytes(local, schedule, WINDOW)
    assert memory.window_bytes < sum(offset_bytes(whole, schedule, WINDOW)), "less than every unit's state"
