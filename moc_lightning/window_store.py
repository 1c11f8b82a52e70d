"""Replay windows at two levels (``checkpoint.mode=replay``, issue 14): each rank's newest complete window in
node-local shared memory and in storage, both written off the training thread, as PEC's snapshots and persists are.

When a window completes, the training thread only hands it over (:meth:`WindowStore.hand_over`): its tensors were
copied into the window's own buffers as it was captured. A background thread serialises it once into shared memory
(:func:`memory_path`, a file beside the rank's snapshot slots, replaced atomically) and then writes the same bytes
to storage (:func:`window_object`). A crashed process on a healthy node resumes from the copy in memory even when
its storage write had not landed; a lost node (its shared memory gone) resumes from storage. Either copy is whole
or absent: a crash mid-write leaves at most a temporary file that nothing reads.

What waits for what, and why:

- At most one window is in flight: the next hand-over waits for the previous window's placement *and* its storage
  write (that wait is :attr:`WindowStore.stall_seconds`), as torchtitan's asynchronous checkpoint waits for the
  previous save. No window is skipped, unlike PEC's persists: under DDP a skip decided by each rank's own storage
  speed would leave the ranks' stored windows misaligned, and the resume needs a window every rank has. The wait
  also keeps :class:`~moc_lightning.replay_driver.WindowCapture`'s buffers safe: it captures into a window's buffers
  again two windows later, after the next hand-over has waited for this one.
- Storage holds :data:`STORAGE_COPIES` (3) objects per rank, alternating by window index. The ranks are within a
  step of each other (a step's collectives), so when the newest hand-over anywhere is window k, a rank that handed
  k over has surely landed k-1 and k-2 (k's object may still hold k-3), and a rank one window behind has surely
  landed k-2 and k-3: k-2 is in every rank's storage. With two objects a rank with fast storage can overwrite k-2
  with k while a slow one has not landed k-1: no window in common, a fresh start.
- On resume (:meth:`WindowStore.restore`, collective) each rank lists its readable candidates of the lineage (its
  copy in memory and its storage objects, mapped where they are local files; a copy that cannot be read is skipped
  with one line, never raised on one rank alone: the others would wait in the gather) and the ranks take the newest
  end step they all have (:func:`agree`), from memory on a tie. A rank whose storage lacks the agreed window (it
  came from memory: its write had not landed) writes it there before training, so the invariant above holds after a
  resume too; otherwise its next windows would overwrite the two before it, and a node loss then could find none in
  common.
- An error of the background work (a full tmpfs, a failed storage write) is raised on the training thread at the
  next hand-over or at :meth:`WindowStore.flush` (fit end): a run whose windows do not reach storage could not
  recover from node loss.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moc_lightning.agreement import gather
from moc_lightning.background import background_executor
from moc_lightning.lineage import Lineage
from moc_lightning.read_speed import read_through
from moc_lightning.replay_driver import WINDOW_PREFIX, WindowLog
from moc_lightning.storage import CheckpointStorage

STORAGE_COPIES = 3
"""Storage objects per rank, alternating by window index (module docstring: why 3, not 2)."""

MEMORY_SUFFIX = ".replay_window.pt"
"""A rank's window in shared memory is its snapshot slots' folder with this suffix."""

SOURCES = ("memory", "storage")
"""Where a window is found on resume, preferred in this order on a tie."""


def window_object(rank: int, index: int) -> str:
    """The storage object of ``rank``'s window number ``index`` (its first step over W)."""
    return f"{WINDOW_PREFIX}rank{rank}.{index % STORAGE_COPIES}.pt"


def memory_path(slot_root: Path) -> Path:
    """The rank's window in shared memory, beside its snapshot slots (a lost node loses both)."""
    return slot_root.with_name(slot_root.name + MEMORY_SUFFIX)


@dataclass(frozen=True)
class Candidate:
    """A readable window of the lineage that a rank could resume from."""

    end_step: int
    """The window's end (the step training resumes at)."""
    source: str
    """``memory`` or ``storage``."""
    log: WindowLog
    nbytes: int
    """Size of the serialized window (the copy in memory or the storage object)."""
    read_seconds: float
    """Time opening it took (mapping a local file, or reading a remote object whole, and unpickling it): the first
    part of a restore from it."""


def agree(ends: Sequence[Sequence[int]]) -> int | None:
    """The newest end step in every rank's ``ends`` (rank order), or ``None`` when they have none in common."""
    common = set.intersection(*(set(mine) for mine in ends)) if ends else set()
    return max(common, default=None)


def pick(candidates: Sequence[Candidate], end_step: int) -> tuple[Candidate, bool]:
    """This rank's copy of the agreed window (memory's on a tie) and whether storage lacks it (it must be
    re-stored before training)."""
    found = [c for c in candidates if c.end_step == end_step]
    chosen = min(found, key=lambda c: SOURCES.index(c.source))
    return chosen, all(c.source != "storage" for c in found)


def _map(path: Path) -> tuple[WindowLog, dict[str, Any] | None, int] | None:
    """The window in file ``path``, mapped, its lineage stamp and its size; ``None`` when there is no such file."""
    try:
        nbytes = path.stat().st_size
    except FileNotFoundError:
        return None
    return *WindowLog.from_file(path), nbytes


class WindowStore:
    """Rank ``rank``'s windows in shared memory (``memory``, a file path) and in ``storage``."""

    def __init__(self, storage: CheckpointStorage, memory: Path, rank: int) -> None:
        self.storage = storage
        self.memory = memory
        self.rank = rank
        self.stall_seconds: list[float] = []
        """Per hand-over, how long the training thread spent in it (waiting for the previous window, mostly)."""
        self._worker = background_executor("moc-window")
        self._job: Future[None] | None = None

    def hand_over(self, log: WindowLog, lineage: Lineage | None) -> None:
        """Give a completed window to the background thread, once the previous one is in memory and storage;
        raises what the previous window's background work raised."""
        start = time.perf_counter()
        self._wait()
        self._job = self._worker.submit(self._place_and_store, log, lineage)
        self.stall_seconds.append(time.perf_counter() - start)

    def flush(self) -> None:
        """Wait for the newest window to reach memory and storage (fit end); raises what its work raised. Every
        window handed over is written to storage, and a window resumed from memory was re-stored before
        training, so nothing else is missing from storage."""
        self._wait()

    def restore(self, lineage: Lineage) -> Candidate | None:
        """This rank's copy of the newest window every rank has in ``lineage``'s current timeline, written to
        storage first where only memory held it; ``None`` when the ranks have none in common (collective)."""
        mine = self.candidates(lineage)
        end_step = agree(gather(sorted({c.end_step for c in mine})))
        if end_step is None:
            return None
        chosen, restore = pick(mine, end_step)
        name = window_object(self.rank, chosen.log.start_step // chosen.log.record.window)
        if restore:  # the copy in memory, as it is (nothing writes it while the ranks resume)
            self.storage.put(name, self.memory.read_bytes())
        if chosen.source == "storage" and (path := self.storage.local_file(name)) is not None:
            start = time.perf_counter()
            read_through(path)  # its pages, mapped, are then copied from the page cache
            chosen = dataclasses.replace(chosen, read_seconds=chosen.read_seconds + time.perf_counter() - start)
        return chosen

    def candidates(self, lineage: Lineage) -> list[Candidate]:
        """This rank's readable windows of ``lineage``'s current timeline, in memory and in storage.

        A copy that is a local file (the one in memory; a storage object under a local root) is mapped, not read
        (:meth:`WindowLog.from_file`): its tensors are views of the file's pages until the restore copies them into
        the live ones, so a restore copies its bytes once, with no fresh allocation, and looking at a copy that is not
        chosen costs little (:meth:`restore` reads the chosen storage object through once first, in large reads). An
        object of a remote storage is read whole (:meth:`CheckpointStorage.get`).
        """
        reads = [("memory", str(self.memory), lambda: _map(self.memory))]
        reads += [
            ("storage", name, lambda name=name: self._read_storage(name))
            for name in (window_object(self.rank, index) for index in range(STORAGE_COPIES))
        ]
        found = []
        for source, where, read in reads:
            try:
                start = time.perf_counter()
                read_back = read()
                if read_back is None:
                    continue
                log, stamp, nbytes = read_back
                seconds = time.perf_counter() - start
            except Exception as err:  # one rank raising alone would leave the others waiting in the gather
                print(f"[moc_lightning] rank {self.rank}: skipping the replay window in {source} ({where}), "
                      f"unreadable: {type(err).__name__}: {err}")
                continue
            if lineage.admits(stamp, log.end_step):
                found.append(Candidate(log.end_step, source, log, nbytes, seconds))
        return found

    def _read_storage(self, name: str) -> tuple[WindowLog, dict[str, Any] | None, int] | None:
        path = self.storage.local_file(name)
        if path is not None:
            return _map(path)
        data = self.storage.get(name)
        return None if data is None else (*WindowLog.from_bytes(data), len(data))

    def _wait(self) -> None:
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def _place_and_store(self, log: WindowLog, lineage: Lineage | None) -> None:
        """Serialise ``log`` into shared memory, replacing the previous window atomically, then write the same
        bytes to storage."""
        self.memory.parent.mkdir(parents=True, exist_ok=True)
        data = log.to_bytes(lineage)
        tmp = self.memory.with_name(f".{self.memory.name}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.memory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.storage.put(window_object(self.rank, log.start_step // log.record.window), data)
