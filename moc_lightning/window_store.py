"""Replay windows at two levels (``checkpoint.mode=replay``, issue 14): each rank's newest complete window in
node-local shared memory and in storage, both written off the training thread, as PEC's snapshots and persists are.

When a window completes, the training thread only hands it over (:meth:`WindowStore.hand_over`): its tensors were
copied into the window's own buffers as it was captured. A background thread serialises it once, straight into its
file in shared memory (:func:`memory_path`, beside the rank's snapshot slots, replaced atomically), checksumming the
bytes as they are written, and then copies that file to storage (:func:`window_object`; the kernel copies it where
storage is a local directory). A crashed process on a healthy node resumes from the copy in memory even when
its storage write had not landed; a lost node (its shared memory gone) resumes from storage. Either copy is whole
or absent: a crash mid-write leaves at most a temporary file that nothing reads.

Beside each copy lies its *head* (:class:`WindowHead`, a sealed JSON object): the lineage stamp, the window's
steps, and the length and CRC32C of the copy's bytes. A copy is written as: remove the old head, replace the
window, write the new head; so a head names the bytes beside it, or (a crash between the last two) is absent and
the copy is not a candidate. The resume lists candidates from heads alone: a window is deserialized only once
the ranks have agreed on it, so a resume holds one deserialized window, not one per candidate (up to four).
A copy that is a local file (the one in shared memory; a storage object under a local root) is mapped, not read
into a buffer (:meth:`~moc_lightning.replay_driver.WindowLog.from_file`): the restore copies each byte once, from
the page cache into the live tensors. A storage object is first read through in large reads with its CRC32C
checked against the head (a device or a network held it); the copy in shared memory, written by this node and
replaced atomically, is checked by length, as PEC's snapshot slots are trusted by their commit.

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
- On resume (:meth:`WindowStore.restore`, collective) each rank lists its candidates of the lineage from their
  heads (its copy in memory and its storage objects; a head that cannot be read is skipped with one line, never
  raised on one rank alone: the others would wait in the gather), the ranks take the newest end step they all have
  (:func:`agree`), from memory on a tie, and each rank loads its copy of that window, checked against its head. A
  copy that fails to load (damaged after its head was written, or gone) is skipped with one line, and the ranks
  agree again without it, until every rank has loaded the same window or they have none in common.
- A rank whose storage lacks the agreed window (it came from memory: its write had not landed) writes it there
  before training, so the invariant above holds after a resume too; otherwise its next windows would overwrite the
  two before it, and a node loss then could find none in common. The outcome is collective: when the write fails
  on any rank, every rank raises :class:`~moc_lightning.checkpointer.AgreedFailure` naming the rank, the object
  and the cause (a rank raising alone would leave the others waiting in training's first collective).
- An error of the background work (a full tmpfs, a failed storage write) is raised on the training thread at the
  next hand-over or at :meth:`WindowStore.flush` (fit end): a run whose windows do not reach storage could not
  recover from node loss.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import google_crc32c

from moc_lightning.agreement import gather
from moc_lightning.background import background_executor
from moc_lightning.checkpointer import AgreedFailure
from moc_lightning.lineage import Lineage
from moc_lightning.read_speed import read_through
from moc_lightning.replay_driver import WINDOW_PREFIX, WindowLog
from moc_lightning.sealed import checksum, seal, unseal
from moc_lightning.storage import CheckpointStorage
from moc_lightning.storage.objects import LocalObjects

STORAGE_COPIES = 3
"""Storage objects per rank, alternating by window index (module docstring: why 3, not 2)."""

MEMORY_SUFFIX = ".replay_window.pt"
"""A rank's window in shared memory is its snapshot slots' folder with this suffix."""

HEAD_PREFIX = "replay_head."
"""Names of the heads in storage begin so (not with :data:`WINDOW_PREFIX`: a head is no window)."""

SOURCES = ("memory", "storage")
"""Where a window is found on resume, preferred in this order on a tie."""


def window_object(rank: int, index: int) -> str:
    """The storage object of ``rank``'s window number ``index`` (its first step over W)."""
    return f"{WINDOW_PREFIX}rank{rank}.{index % STORAGE_COPIES}.pt"


def head_object(rank: int, index: int) -> str:
    """The head of :func:`window_object` ``(rank, index)``."""
    return f"{HEAD_PREFIX}rank{rank}.{index % STORAGE_COPIES}.json"


def memory_path(slot_root: Path) -> Path:
    """The rank's window in shared memory, beside its snapshot slots (a lost node loses both)."""
    return slot_root.with_name(slot_root.name + MEMORY_SUFFIX)


def memory_head(memory: Path) -> Path:
    """The head of the rank's window in shared memory."""
    return memory.with_suffix(".head.json")


class Objects(Protocol):
    """Where copies of a window live: storage, or the rank's folder in shared memory."""

    def put(self, name: str, data: bytes) -> None: ...

    def put_file(self, name: str, source: Path) -> None: ...

    def get(self, name: str) -> bytes | None: ...

    def delete(self, name: str) -> None: ...


class MemoryFiles(LocalObjects):
    """Objects as files in the rank's folder of node-local shared memory: replaced atomically (a reader sees the old
    bytes or the new), never fsynced: shared memory does not outlive the node, so there is nothing to make durable,
    and an fsync where the root is a disk would only slow the background thread before the storage write. One
    temporary name per object: a crash mid-write leaves at most one temporary file (as large as a window), which
    the next write of the object replaces."""

    durable = False

    def _temp(self, path: Path) -> tuple[int, str]:
        tmp = path.with_name(f".{path.name}.tmp")
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), str(tmp)


class Checksummed:
    """A binary file that counts and checksums (CRC32C) what is written through it: a window's head is computed as
    the window is serialised, not by reading its bytes back."""

    SLICE = 4 << 20
    """Bytes checksummed at a time: google_crc32c takes ``bytes`` only, so each slice of a record is copied once,
    small enough to stay in the CPU's cache for the checksum."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.length = 0
        self.crc = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.SLICE):
            self.crc = google_crc32c.extend(self.crc, bytes(view[start : start + self.SLICE]))
        self.length += len(view)
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def serialise(log: WindowLog, lineage: Lineage | None, file: BinaryIO) -> Checksummed:
    """Serialise ``log`` into ``file``; what is returned knows the bytes' length and CRC32C."""
    written = Checksummed(file)
    log.save(written, lineage)
    return written


@dataclass(frozen=True)
class WindowHead:
    """What identifies a copy of a window, read on resume without deserializing the window."""

    lineage: dict[str, Any] | None
    """The lineage stamp the window was written under."""
    start_step: int
    """The global step before the window's first iteration."""
    window: int
    """W, iterations of the window."""
    length: int
    """Bytes of the serialized window."""
    crc: int
    """CRC32C of the serialized window."""

    @property
    def end_step(self) -> int:
        return self.start_step + self.window

    @property
    def index(self) -> int:
        """The window's number (its first step over W), which names its storage objects."""
        return self.start_step // self.window

    @classmethod
    def of(cls, log: WindowLog, lineage: Lineage | None, serialized: Checksummed) -> WindowHead:
        """The head of ``log`` as it was serialized through ``serialized``."""
        stamp = lineage.stamp() if lineage is not None else None
        return cls(stamp, log.start_step, log.record.window, serialized.length, serialized.crc)

    def to_bytes(self) -> bytes:
        return seal(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> WindowHead:
        """Parse and validate; raises ``ValueError`` naming the problem."""
        raw = unseal(data)
        fields = ("start_step", "window", "length", "crc")
        if any(type(raw.get(name)) is not int or raw[name] < 0 for name in fields) or raw["window"] < 1:
            raise ValueError(f"a window head needs integers {', '.join(fields)} >= 0 (window >= 1), got {raw!r:.120}")
        return cls(raw.get("lineage"), *(raw[name] for name in fields))


@dataclass(frozen=True)
class Place:
    """One copy of a window: its bytes are object ``name`` of ``objects``, its head object ``head``."""

    source: str
    """``memory`` or ``storage``."""
    objects: Objects
    name: str
    head: str
    where: str
    """What a message names: the file in shared memory, the object in storage."""
    local: Path | None
    """The local file holding the copy's bytes, mapped by a load; ``None`` where objects are not local files (a
    remote kvstore: the load reads the object whole)."""

    def write(self, put: Callable[[], WindowHead]) -> WindowHead:
        """Replace the copy by what ``put`` writes, then its head (what ``put`` returns): the old head goes first, so
        a crash before the new head lands leaves no head that names other bytes."""
        self.objects.delete(self.head)
        head = put()
        self.objects.put(self.head, head.to_bytes())
        return head

    def copy(self, source: Path, head: WindowHead) -> None:
        """Replace the copy by the bytes of file ``source``, whose head is ``head``."""

        def put() -> WindowHead:
            self.objects.put_file(self.name, source)
            return head

        self.write(put)

    def read_head(self) -> WindowHead | None:
        data = self.objects.get(self.head)
        return None if data is None else WindowHead.from_bytes(data)

    def load(self, head: WindowHead) -> WindowLog:
        """The window whose head is ``head``; raises ``ValueError`` when the copy does not match it (module
        docstring: what is checked where)."""
        if self.local is None:
            data = self.objects.get(self.name)
            if data is None:
                raise ValueError("the window is missing beside its head")
            self._check(len(data), checksum(data), head)
            log, _ = WindowLog.from_bytes(data)
        else:
            try:
                if self.source == "storage":
                    nbytes, crc = read_through(self.local, crc=True)
                else:
                    nbytes, crc = self.local.stat().st_size, None
            except FileNotFoundError:
                raise ValueError("the window is missing beside its head") from None
            self._check(nbytes, crc, head)
            log, _ = WindowLog.from_file(self.local)
        if log.end_step != head.end_step:
            raise ValueError(f"the window ends at step {log.end_step}, its head says {head.end_step}")
        return log

    @staticmethod
    def _check(nbytes: int, crc: int | None, head: WindowHead) -> None:
        if nbytes != head.length or crc not in (None, head.crc):
            got = f"{nbytes} bytes" + ("" if crc is None else f" (CRC32C {crc:08x})")
            raise ValueError(f"{got} do not match the head's {head.length} bytes (CRC32C {head.crc:08x})")


@dataclass(frozen=True)
class Candidate:
    """A window of the lineage that a rank could resume from, known by its head."""

    end_step: int
    """The window's end (the step training resumes at)."""
    source: str
    """``memory`` or ``storage``."""
    where: str
    """The copy's file or object, for messages."""
    head: WindowHead


@dataclass(frozen=True)
class Restored:
    """The window a resume replays."""

    log: WindowLog
    source: str
    """Where this rank's copy came from: ``memory`` or ``storage``."""
    nbytes: int
    """Size of the copy (the serialized window)."""
    read_seconds: float
    """Time loading it took (reading a storage object through and checking it, mapping it, unpickling): the first
    part of a restore from it."""

    @property
    def end_step(self) -> int:
        return self.log.end_step


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

    def restore(self, lineage: Lineage) -> Restored | None:
        """This rank's copy of the newest window every rank has and could load in ``lineage``'s current timeline,
        written to storage first where only memory held it; ``None`` when the ranks have none in common
        (collective: every rank takes the same path, raises included)."""
        candidates = self.candidates(lineage)
        loaded: tuple[Candidate, WindowLog, float] | None = None
        while True:
            end_step = agree(gather(sorted({c.end_step for c in candidates})))
            if end_step is None:
                return None
            chosen, restore = pick(candidates, end_step)
            if loaded is None or loaded[0] != chosen:
                loaded = None  # the previous window's memory goes before the next is read
                try:
                    start = time.perf_counter()
                    log = self._place(chosen.source, chosen.head.index).load(chosen.head)
                    loaded = (chosen, log, time.perf_counter() - start)
                except Exception as err:  # the ranks agree again without it, below
                    self._skip(chosen.source, chosen.where, err)
            if all(gather(loaded is not None)):
                break
            if loaded is None:
                candidates.remove(chosen)
        _, log, seconds = loaded
        self._agree_on_restore(restore, chosen.head)
        return Restored(log, chosen.source, chosen.head.length, seconds)

    def candidates(self, lineage: Lineage) -> list[Candidate]:
        """This rank's windows of ``lineage``'s current timeline, in memory and in storage, from their heads."""
        places = [self._place("memory")] + [self._place("storage", index) for index in range(STORAGE_COPIES)]
        found = []
        for place in places:
            try:
                head = place.read_head()
            except Exception as err:  # one rank raising alone would leave the others waiting in the gather
                self._skip(place.source, place.where, err)
                continue
            if head is not None and lineage.admits(head.lineage, head.end_step):
                found.append(Candidate(head.end_step, place.source, place.where, head))
        return found

    def _place(self, source: str, index: int = 0) -> Place:
        """Where the copy in ``source`` of window number ``index`` lives (memory holds one, whatever its index)."""
        if source == "memory":
            head = memory_head(self.memory)
            return Place(source, MemoryFiles(self.memory.parent), self.memory.name, head.name, str(self.memory),
                         self.memory)
        name = window_object(self.rank, index)
        return Place(source, self.storage, name, head_object(self.rank, index), name, self.storage.local_file(name))

    def _skip(self, source: str, where: str, err: Exception) -> None:
        print(f"[moc_lightning] rank {self.rank}: skipping the replay window in {source} ({where}), "
              f"unreadable: {type(err).__name__}: {err}")

    def _agree_on_restore(self, restore: bool, head: WindowHead) -> None:
        """With ``restore``, write the resumed window (only memory held it) to storage as it lies in memory (nothing
        writes it while the ranks resume); if that fails on any rank, every rank raises :class:`AgreedFailure`
        (collective, run on every rank whatever happened)."""
        failure = None
        if restore:
            place = self._place("storage", head.index)
            try:
                place.copy(self.memory, head)
            except Exception as err:  # shared with every rank below, raised everywhere
                failure = f"{place.name} in {self.storage.url}: {type(err).__name__}: {err}"
        failures = {rank: text for rank, text in enumerate(gather(failure)) if text is not None}
        if failures:
            raise AgreedFailure(
                "re-storing the resumed replay window (only shared memory held it)", failures,
                "training does not start: storage must hold the window before new ones overwrite older ones, "
                "or a node loss could find no window every rank has",
            )

    def _wait(self) -> None:
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def _place_and_store(self, log: WindowLog, lineage: Lineage | None) -> None:
        """Serialise ``log`` straight into its file in shared memory, replacing the previous window, then copy that
        file to storage; each with its head."""

        def place() -> WindowHead:
            written = MemoryFiles(self.memory.parent).write(self.memory.name, partial(serialise, log, lineage))
            return WindowHead.of(log, lineage, written)

        head = self._place("memory").write(place)
        self._place("storage", head.index).copy(self.memory, head)
