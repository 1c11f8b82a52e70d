"""``checkpoint.mode=replay`` keeps its windows at two levels, off the training thread: a storage write slower than
a step does not stall the training thread, one slower than a window makes the next hand-over wait (at most one
window in flight); a storage error is raised at the next hand-over or at fit end; the newest complete window lives
in node-local shared memory, so a crash before its storage write landed resumes from memory (and stores it before
training), and node loss from the previous window in storage; both bitwise on the uninterrupted run."""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import Recorder, fit, fit_or_crash, moc_config, window_slots
from storage_faults import os_error

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.replay.driver import WINDOW_PREFIX, WindowLog
from moc_lightning.replay.window_store import STORAGE_COPIES, window_object
from moc_lightning.storage import make_storage

pytestmark = pytest.mark.xdist_group("replay_background")  # one worker runs the uninterrupted fit once

MAX_STEPS = 12
WINDOW = 3
CLIP = 0.05


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))


class WindowPuts:
    """What the window puts of every storage the callback opens did: each first calls ``before(n)`` (``n``: 1 for
    the first window put)."""

    def __init__(self, before: Callable[[int], None]) -> None:
        self.before = before
        self.puts = 0
        self.seconds: list[float] = []
        """How long each window put took, in order of completion."""
        self._lock = threading.Lock()

    def put(self, inner: Any, name: str, source: Path) -> int:
        with self._lock:
            self.puts += 1
            n = self.puts
        start = time.perf_counter()
        self.before(n)
        crc = inner.put_file(name, source)
        self.seconds.append(time.perf_counter() - start)
        return crc


class SlowableStorage:
    """A storage whose puts of a replay window (copies of its file in shared memory) go through :class:`WindowPuts`;
    everything else goes to ``inner``."""

    def __init__(self, inner: Any, puts: WindowPuts) -> None:
        self.inner, self.url, self.puts = inner, inner.url, puts

    def put_file(self, name: str, source: Path) -> int:
        if not name.startswith(WINDOW_PREFIX):
            return self.inner.put_file(name, source)
        return self.puts.put(self.inner, name, source)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)


def _wrap_storage(monkeypatch: pytest.MonkeyPatch, before: Callable[[int], None]) -> WindowPuts:
    """Every storage the callback opens during the patch puts its windows through the returned :class:`WindowPuts`."""
    puts = WindowPuts(before)
    monkeypatch.setattr(
        "moc_lightning.lightning.engines.make_storage",
        lambda backend, url, endpoint, retries: SlowableStorage(make_storage(backend, url, endpoint, retries), puts),
    )
    return puts


class StepEnds(L.Callback):
    """Which steps ended, when; Lightning runs checkpoint callbacks last: this one's ``on_train_batch_end`` sees a
    step before MoC's hook (and its hand-over) does."""

    def __init__(self) -> None:
        self.ended: list[int] = []
        self.at: list[float] = []
        self.changed = threading.Condition()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        with self.changed:
            self.ended.append(trainer.global_step)
            self.at.append(time.perf_counter())
            self.changed.notify_all()

    def wait_for(self, step: int, timeout: float = 30) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: step in self.ended, timeout=timeout), f"step {step} never ended"


def _stored_ends(root: Path, rank: int = 0) -> list[int]:
    """End steps of the windows in ``rank``'s storage objects, oldest first."""
    storage = make_storage("filesystem", (root / "ckpt").as_uri())
    ends = []
    for index in range(STORAGE_COPIES):
        data = storage.get(window_object(rank, index))
        if data is not None:
            ends.append(WindowLog.from_bytes(data)[0].end_step)
    return sorted(ends)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """The full state after every step of a fit without faults (the oracle)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    recorder = Recorder(at=tuple(range(1, MAX_STEPS + 1)))
    fit(root, _config(root), MAX_STEPS, [recorder], gradient_clip_val=CLIP)
    return recorder.states


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


def test_a_storage_write_slower_than_a_step_does_not_stall_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each window's put lasts until two more steps have ended (slower than a step, faster than a window of 3; the
    last window's, flushed at fit end, is not slowed): the hand-overs do not wait for them, and every window
    reaches storage."""
    last = MAX_STEPS // WINDOW
    steps = StepEnds()
    puts = _wrap_storage(monkeypatch, lambda n: steps.wait_for(n * WINDOW + 2) if n < last else None)
    moc = fit(tmp_path, _config(tmp_path), MAX_STEPS, [steps], gradient_clip_val=CLIP)
    intervals = [b - a for a, b in zip(steps.at, steps.at[1:])]
    slow = puts.seconds[:-1]
    stalls = moc.windows.stall_seconds
    print(f"window puts ms {[round(s * 1e3) for s in puts.seconds]}, step intervals ms "
          f"{[round(x * 1e3) for x in intervals]}, hand-overs ms {[round(s * 1e3, 1) for s in stalls]}")
    assert puts.puts == last, "every window was written to storage"
    assert min(slow) > min(intervals), "each slowed put outlasted a step"
    assert max(stalls) < min(slow) / 2, "a hand-over waited for the storage write"
    assert _stored_ends(tmp_path)[-1] == MAX_STEPS


def test_a_storage_write_slower_than_a_window_makes_the_next_hand_over_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first window's put lasts until the second window has ended and 0.5 s more: the second hand-over waits
    for it (one window in flight at most), rather than skip a window."""
    extra = 0.5
    steps = StepEnds()

    def slow_first(n: int) -> None:
        if n == 1:
            steps.wait_for(2 * WINDOW)
            time.sleep(extra)

    puts = _wrap_storage(monkeypatch, slow_first)
    moc = fit(tmp_path, _config(tmp_path), MAX_STEPS, [steps], gradient_clip_val=CLIP)
    stalls = moc.windows.stall_seconds
    print(f"first window put {puts.seconds[0]:.2f} s; hand-overs ms {[round(s * 1e3, 1) for s in stalls]}")
    assert stalls[1] >= extra * 0.8, "the second hand-over waited for the first window's storage write"
    assert puts.puts == MAX_STEPS // WINDOW, "no window was skipped"
    assert _stored_ends(tmp_path) == [2 * WINDOW, 3 * WINDOW, 4 * WINDOW]


@pytest.mark.parametrize("failing", [1, "last"])
def test_a_storage_error_is_raised_at_the_next_hand_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int | str
) -> None:
    """The put of a window fails in the background; training goes on, and the error comes out at the next window's
    hand-over (the first window's) or at the flush at fit end (the last window's)."""
    last = MAX_STEPS // WINDOW

    def fail(n: int) -> None:
        if n == (last if failing == "last" else failing):
            raise os_error(errno.EIO, "replay window")

    _wrap_storage(monkeypatch, fail)
    steps = StepEnds()
    with pytest.raises(OSError, match="Input/output error") as err:
        fit(tmp_path, _config(tmp_path), MAX_STEPS, [steps], gradient_clip_val=CLIP)
    print(f"window put {failing} failed; {err.value!r} came out after steps {steps.ended}")
    if failing == "last":
        assert steps.ended[-1] == MAX_STEPS, "raised by the flush at fit end, after every step"
    else:
        assert steps.ended[-1] == 2 * WINDOW, "training went on after the failed write, to the next window's end"


class CrashBeforeStored(L.Callback):
    """Lets the windows before window ``k`` reach storage; window ``k``'s storage write never lands: the process is
    killed once the write has begun, i.e. after the window is in shared memory. A gated put ends with an error once
    released, as a dead process writes nothing."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.entered = threading.Event()
        self.release = threading.Event()

    def before_put(self, n: int) -> None:
        if n <= self.k:
            return
        self.entered.set()
        self.release.wait(timeout=5)
        raise os_error(errno.EIO, "replay window (process killed)")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        """Checkpoint callbacks run last: MoC handed window k over at the end of the step before this one."""
        if trainer.global_step == (self.k + 1) * WINDOW:
            self.moc_run_id = trainer.checkpoint_callback.engine.lineage.run_id
            assert self.entered.wait(timeout=30), "window k's storage write never began"
            raise CrashedBeforeStored(f"killed after step {trainer.global_step}")


class CrashedBeforeStored(Exception):
    """The stand-in for a killed process."""


class StateAfterReplay(Recorder):
    """:class:`Recorder`, with the start state taken as the first new step begins (after the replay, which runs inside
    Lightning's restore), and the windows in storage then."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if not hasattr(self, "start"):
            self.start = self._tensors(trainer, module)
            self.stored = _stored_ends(Path(trainer.default_root_dir).parent)


def _crash_before_stored(root: Path, monkeypatch: pytest.MonkeyPatch, k: int) -> CrashBeforeStored:
    crash = CrashBeforeStored(k)
    _wrap_storage(monkeypatch, crash.before_put)
    try:
        with pytest.raises(CrashedBeforeStored):
            fit(root, _config(root), MAX_STEPS, [crash], gradient_clip_val=CLIP)
    finally:
        crash.release.set()
        monkeypatch.undo()
    return crash


@pytest.mark.parametrize("lost", ["process", "node"])
def test_a_crash_before_the_storage_write_resumes_from_the_newest_surviving_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[int, dict[str, torch.Tensor]], lost: str
) -> None:
    """Window k is complete and in shared memory, its storage write has not landed: a crashed process resumes from
    memory (window k) and stores it before training, a lost node (shared memory gone) from storage (window k-1);
    each replay lands bitwise on the uninterrupted state of its window's end, and the run ends bitwise on the
    uninterrupted one."""
    k = random.Random(int(os.environ.get("MOC_REPLAY_SEED", "14"))).randrange(1, MAX_STEPS // WINDOW - 1)
    _crash_before_stored(tmp_path, monkeypatch, k)
    assert _stored_ends(tmp_path)[-1] == k * WINDOW, "storage holds up to window k-1"
    if lost == "node":
        shutil.rmtree(tmp_path / "shm")
    resumed = StateAfterReplay(at=(MAX_STEPS,))
    moc = fit(tmp_path, _config(tmp_path), MAX_STEPS, [resumed], gradient_clip_val=CLIP)
    report = moc.replay_report
    want = k if lost == "process" else k - 1
    print(f"crash after window {k} (step {(k + 1) * WINDOW}), {lost} lost: replayed the window from step "
          f"{report.window_start} ({report.source}), resumed at step {report.resume_step}; in storage at the first "
          f"new step: windows ending at {resumed.stored}")
    assert (report.window_start, report.source) == (want * WINDOW, "memory" if lost == "process" else "storage")
    assert resumed.start_step == report.resume_step == (want + 1) * WINDOW
    assert report.resume_step in resumed.stored, "the resumed window is in storage before training"
    assert _differing(resumed.start, uninterrupted[report.resume_step]) == []
    assert _differing(resumed.states[MAX_STEPS], uninterrupted[MAX_STEPS]) == []


def test_an_unreadable_copy_in_memory_is_skipped_with_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn copy in shared memory (not a window) is skipped with one printed line, and the resume takes the
    newest window left: window 0, in the other slot in memory (storage holds it too)."""
    _crash_before_stored(tmp_path, monkeypatch, k=1)
    newest, _ = window_slots(tmp_path / "shm")
    newest.write_bytes(b"not a window")
    moc = fit(tmp_path, _config(tmp_path), 2 * WINDOW, [], gradient_clip_val=CLIP)
    out = capsys.readouterr().out
    assert "skipping the replay window in memory" in out and "unreadable" in out
    assert (moc.replay_report.window_start, moc.replay_report.source) == (0, "memory")


def test_a_window_of_another_run_in_memory_or_storage_is_never_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that reuses the storage URL with resume=never starts a lineage of its own: when it crashes before its
    first window, the previous run's windows (in memory and in storage) are not its own, and it starts over."""
    first = _crash_before_stored(tmp_path, monkeypatch, k=1)
    assert window_slots(tmp_path / "shm"), "the first run left its windows in memory"
    config = _config(tmp_path)
    config.resume = "never"
    second = fit_or_crash(tmp_path, config, MAX_STEPS, Recorder(crash_after=WINDOW - 1), gradient_clip_val=CLIP)
    resumed = Recorder()
    moc = fit(tmp_path, _config(tmp_path), WINDOW, [resumed], gradient_clip_val=CLIP)
    assert moc.engine.lineage.run_id == second.engine.lineage.run_id != first.moc_run_id
    assert moc.replay_report is None and resumed.start_step == 0


def test_the_summary_reports_the_hand_overs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moc: MoCCheckpoint = fit(tmp_path, _config(tmp_path), 2 * WINDOW, [], gradient_clip_val=CLIP)
    assert len(moc.windows.stall_seconds) == 2
    assert "2 replay windows handed over to shared memory and storage" in capsys.readouterr().out
