"""``checkpoint.mode=replay`` in a fit: window captures at each step, and on resume the replay of the newest window.

Every iteration's batch, RNG and the units' state it changes are captured into a window of W iterations
(:class:`~moc_lightning.replay.driver.WindowCapture`); a completed window is handed over to shared memory and storage
(:class:`~moc_lightning.replay.window_store.WindowStore`). ``replay.window=auto`` times the first iterations
(:class:`~moc_lightning.replay.window_choice.WindowProbe`) and captures windows of the W chosen from them. A resume
restores the newest window every rank has and replays it (:func:`~moc_lightning.replay.driver.replay_window`) inside
Lightning's restore, so every unit is at its fault-free state of the resume step before anything observes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast, overload

import lightning as L

from moc_lightning.config import AUTO, CheckpointConfig
from moc_lightning.engine.layout import Layout
from moc_lightning.engine.manifest import Manifest
from moc_lightning.lightning.reporting import log_now
from moc_lightning.lightning.shared_memory import check_window_memory, slot_root
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.replay.driver import (
    ReplayReport,
    WindowCapture,
    check_strategy,
    check_trainer,
    replay_window,
)
from moc_lightning.replay.memory import WindowMemory, window_memory
from moc_lightning.replay.window_choice import WindowChoice, WindowProbe
from moc_lightning.replay.window_store import Restored, WindowStore
from moc_lightning.runtime.agreement import from_coordinator
from moc_lightning.runtime.background import spare_core
from moc_lightning.storage import CheckpointStorage


T = TypeVar("T")


class _HasReplay(Protocol):
    replay: ReplayWiring


class ReplayAttribute(Generic[T]):
    """A read-only attribute of the callback that reads :class:`ReplayWiring`'s attribute ``name``.

    The callback shows replay mode's state under the names it had before that state moved here (``moc.capture``,
    ``moc.replay_report``, ...); one descriptor serves them all."""

    def __init__(self, name: str, doc: str) -> None:
        self._name = name
        self.__doc__ = doc

    @overload
    def __get__(self, instance: None, owner: type) -> ReplayAttribute[T]: ...

    @overload
    def __get__(self, instance: _HasReplay, owner: type) -> T: ...

    def __get__(self, instance: _HasReplay | None, owner: type) -> ReplayAttribute[T] | T:
        if instance is None:
            return self
        return cast(T, getattr(instance.replay, self._name))


class ReplayWiring:
    """Replay mode's part of each hook; with ``checkpoint.mode=pec`` every call is a no-op."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.capture: WindowCapture | None = None
        """This fit's window captures (from the first iteration, or once ``window=auto`` chose W)."""
        self.window_choice: WindowChoice | None = None
        """``replay.window=auto``: W and what it was chosen from (``None`` until chosen)."""
        self.windows: WindowStore | None = None
        """Where completed windows go (shared memory, then storage) and are found on resume."""
        self.report: ReplayReport | None = None
        """What the resume replayed (``None`` when it replayed nothing)."""
        self.memory: WindowMemory | None = None
        """The host memory of the windows, reported and checked before training."""
        self._probe: WindowProbe | None = None
        self._to_replay: Restored | None = None

    @property
    def on(self) -> bool:
        """Whether the fit runs in replay mode."""
        return self.config.mode == "replay"

    # ---------------------------------------------------------------- set-up
    def check_setup(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Refuse a strategy replay mode cannot replay under (at ``setup``, before anything is restored)."""
        if self.on:
            check_strategy(trainer, module)

    def start_fit(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A fit starts: no capture yet; refuse a Trainer replay mode cannot replay, and time the first iterations
        where W is to be chosen."""
        self.capture = self._probe = None
        if self.on:
            check_trainer(trainer, module)
            if self.config.replay.window == AUTO:
                self._probe = WindowProbe()

    def check_node(self, layout: Layout, rank: int, node_root: Path) -> None:
        """With a W given, report the windows' host memory and refuse a node that cannot hold them (with
        ``window=auto``, once W is chosen)."""
        if self.on and isinstance(window := self.config.replay.window, int):
            self._check_memory(layout, window, rank, node_root)

    def open_windows(self, storage: CheckpointStorage, slots: Path, rank: int) -> None:
        """Keep windows in this rank's folder ``slots`` of shared memory and in ``storage``."""
        if self.on:
            self.windows = WindowStore(storage, slots, rank, self.config.replay.persist_every_n_windows)

    def begin_capture(self, rank: int) -> None:
        """With a W given, capture windows of it from the fit's first iteration."""
        if self.on and isinstance(window := self.config.replay.window, int):
            self.capture = self._window_capture(window, rank)

    # -------------------------------------------------------------- training
    def batch_start(self, step: int, batch: Any, batch_idx: int) -> None:
        if self.capture is not None:
            self.capture.begin(step, batch, batch_idx)
        elif self._probe is not None:
            self._probe.begin()

    def batch_end(self, trainer: L.Trainer, engine: TwoLevelCheckpointer, own_key: str) -> None:
        """Hand a window the step completed over to shared memory and storage; with ``window=auto``, choose W once
        the probe has timed enough iterations."""
        if self.capture is not None and (window := self.capture.end(trainer, engine.pec.layout, own_key)):
            self._store().hand_over(window, engine.lineage, self.capture.pending)
        if self._probe is not None and self._probe.end():
            self._choose_window(trainer, engine)

    def join(self) -> None:
        """Wait for the last capture's copy (the next optimizer step changes what it copies)."""
        if self.capture is not None:
            self.capture.join()

    def finish(self) -> None:
        """Fit ends: every capture copied and every window's writes done."""
        self.join()
        if self.windows is not None:
            self.windows.flush()

    # ------------------------------------------------------------- resuming
    def resume_point(self, engine: TwoLevelCheckpointer, manifest: Manifest) -> dict[str, Any] | None:
        """Resume at the end of the newest window every rank has in shared memory or in storage
        (:meth:`WindowStore.restore`, which re-stores it where only memory held it): its trainer state, or ``None``
        where there is none (a fresh start within the lineage, as a PEC recovery that finds nothing). That state
        goes to Lightning now; the model and optimizer reach that step by :meth:`replay`, which Lightning's restore
        calls once the strategy and optimizers are set up. Until then the engine refuses every snapshot and persist
        (:class:`~moc_lightning.engine.completeness.RestoreGuard`)."""
        lineage = manifest.lineage
        assert lineage is not None, "a replay-mode resume is of a lineage"
        found = self._store().restore(lineage)
        log = found.log if found is not None else None
        if log is not None and log.trainer_state is None:
            raise RuntimeError(f"the replay window from step {log.start_step} holds no trainer state of its end")
        engine.store.clear()  # PEC's slots play no part in replay mode
        resumed = lineage.resumed_at(log.end_step if log is not None else 0)
        engine.pec.persister.commit_lineage(manifest.with_lineage(resumed))
        engine.lineage = resumed
        engine.pec.selector.base_on(manifest)
        if log is None:
            return None
        self._to_replay = found
        engine.completeness.begin(f"the replay of the window from step {log.start_step} to step {log.end_step}")
        return log.trainer_state

    @property
    def pending(self) -> bool:
        """Whether :meth:`resume_point` restored a window that is not replayed yet."""
        return self._to_replay is not None

    def replay(self, trainer: L.Trainer, engine: TwoLevelCheckpointer) -> ReplayReport:
        """Replay the window :meth:`resume_point` restored (:attr:`pending`); the live state is then complete."""
        found, self._to_replay = self._to_replay, None
        if found is None:
            raise RuntimeError("no restored window is pending a replay")
        report = self.report = replay_window(
            trainer, trainer.lightning_module, engine.pec.layout, found.log, found.source, found.nbytes,
            found.read_seconds,
        )
        engine.completeness.complete()
        return report

    # --------------------------------------------------------------- private
    def _store(self) -> WindowStore:
        if self.windows is None:
            raise RuntimeError("replay mode's window store is opened with the engine, before any window is kept")
        return self.windows

    def _choose_window(self, trainer: L.Trainer, engine: TwoLevelCheckpointer) -> None:
        """``replay.window=auto``: choose W from the timed iterations (the coordinator's choice, for every rank), log
        it with its inputs once, and capture windows of it from the next window boundary on."""
        probe, self._probe = self._probe, None
        assert probe is not None
        layout = engine.pec.layout
        choice = self.window_choice = from_coordinator(lambda: probe.choose(layout), engine.pec.process_group)
        rank = engine.rank
        self._check_memory(layout, choice.window, rank, slot_root(self.config, rank).parent)
        self.capture = self._window_capture(choice.window, rank)
        log_now(trainer, choice.metrics())
        if rank == 0:
            print(f"[moc_lightning] {choice.describe()}")

    def _window_capture(self, window: int, rank: int) -> WindowCapture:
        """Captures of windows of ``window`` iterations into this rank's slots, allocated now rather than at the first
        captures (:meth:`WindowSlot.reserve`)."""
        windows, memory = self._store(), self.memory
        assert memory is not None, "the windows' memory is checked before any capture"
        windows.reserve(memory.window_bytes)
        behind = spare_core()
        if rank == 0:
            print("[moc_lightning] replay captures copy weights and optimizer state "
                  + ("behind the next forward and backward, on a copy thread" if behind else
                     "on the training thread (no core is left free for a copy thread: background.spare_core)"))
        return WindowCapture(window, windows.open_slot, behind)

    def _check_memory(self, layout: Layout, window: int, rank: int, node_root: Path) -> None:
        """Report the windows' host memory and refuse a shared-memory root that cannot hold them, before the first
        capture (before training, or once ``replay.window=auto`` has chosen W)."""
        self.memory = window_memory(layout, window)
        if rank == 0:
            print(f"[moc_lightning] {self.memory.describe()}")
        check_window_memory(self.config, self.memory, node_root)
