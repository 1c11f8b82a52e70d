"""Replay windows at two levels (``checkpoint.mode=replay``, issue 14): each rank's newest complete windows in
node-local shared memory, and every ``persist_every``-th in storage, written off the training thread, as PEC's
snapshots and persists are.

A window is captured straight into one of the rank's :class:`~moc_lightning.replay.window_file.WindowSlot` files in shared
memory (:func:`memory_file`, beside its snapshot slots; window ``k`` into slot ``k`` mod 2): the captures' copies are
the only pass over its bytes on the training thread. When it completes, the training thread hands it over
(:meth:`WindowStore.hand_over`) and a background thread seals it (writes the small tail that makes the file a whole
:mod:`~moc_lightning.replay.window_file`) and, for a window to persist, copies that file to storage (:func:`window_object`)
with its CRC32C, computed as its bytes are copied. A crashed process on a healthy node resumes
from memory even when no storage write had landed; a lost node (its shared memory gone) resumes from storage.

Beside each copy lies its *head* (:class:`WindowHead`, a sealed JSON object): the lineage stamp, the window's
steps, and the length of the copy's bytes, with their CRC32C for a copy in storage. A slot's head is removed before
the first capture into it (:meth:`WindowStore.open_slot`) and written once it is sealed; a storage copy is written
as: remove the old head, replace the object, write the new head. So a head names the bytes beside it, or is absent
and the copy is not a candidate. The resume lists candidates from heads alone: a window is opened only once the
ranks have agreed on it. A copy that is a local file (one in shared memory; a storage object under a local root) is
mapped, not read into a buffer (:meth:`~moc_lightning.replay.driver.WindowLog.from_file`): the restore copies each
byte once, from the page cache into the live tensors. A storage object is first read through in large reads with its
CRC32C checked against the head (a device or a network held it); a copy in shared memory, written by this node, is
checked by length, as PEC's snapshot slots are trusted by their commit.

What waits for what, and why:

- At most one window is in flight: the next hand-over waits for the previous window's seal *and* its storage write
  (that wait is :attr:`WindowStore.stall_seconds`), as torchtitan's asynchronous checkpoint waits for the previous
  save; and a slot is captured into again only once the storage write reading it has landed. No window due for
  storage is skipped, unlike PEC's persists: under DDP a skip decided by each rank's own storage speed would leave
  the ranks' stored windows misaligned, and the resume needs a window every rank has. Which windows go to storage is
  a function of the window's index (``index % persist_every == 0``), the same on every rank.
- Storage holds :data:`STORAGE_COPIES` (3) objects per rank, alternating by stored window. The ranks are within a
  step of each other (a step's collectives), so when the newest hand-over anywhere is stored window k, a rank that
  handed k over has surely landed k-1 and k-2 (k's object may still hold k-3), and a rank one window behind has surely
  landed k-2 and k-3: k-2 is in every rank's storage. With two objects a rank with fast storage can overwrite k-2
  with k while a slow one has not landed k-1: no window in common, a fresh start.
- On resume (:meth:`WindowStore.restore`, collective) each rank lists its candidates of the lineage from their
  heads (its slots in memory and its storage objects; a head that cannot be read is skipped with one line, never
  raised on one rank alone: the others would wait in the gather), the ranks take the newest end step they all have
  (:func:`agree`), from memory on a tie, and each rank loads its copy of that window, checked against its head. A
  copy that fails to load (damaged after its head was written, or gone) is skipped with one line, and the ranks
  agree again without it, until every rank has loaded the same window or they have none in common.
- A rank whose storage lacks the agreed window (it came from memory) writes it there before training, so the
  invariant above holds after a resume too; otherwise its next windows would overwrite the two before it, and a node
  loss then could find none in common. The outcome is collective: when the write fails on any rank, every rank raises
  :class:`~moc_lightning.pec.checkpointer.AgreedFailure` naming the rank, the object and the cause (a rank raising alone
  would leave the others waiting in training's first collective).
- An error of the background work (a full tmpfs, a failed storage write) is raised on the training thread at the
  next hand-over or at :meth:`WindowStore.flush` (fit end): a run whose windows do not reach storage could not
  recover from node loss.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from moc_lightning.engine.lineage import Lineage
from moc_lightning.pec.outcomes import AgreedFailure
from moc_lightning.replay.driver import WINDOW_PREFIX, WindowLog
from moc_lightning.replay.window_file import WINDOW_SLOTS, WindowSlot
from moc_lightning.runtime.agreement import gather
from moc_lightning.runtime.background import background_executor
from moc_lightning.runtime.faults import fault_point
from moc_lightning.storage import CheckpointStorage
from moc_lightning.storage.objects import LocalObjects
from moc_lightning.storage.read_speed import read_through
from moc_lightning.storage.sealed import checksum, seal, unseal

STORAGE_COPIES = 3
"""Storage objects per rank, alternating by stored window (module docstring: why 3, not 2)."""

WINDOW_SUFFIX = ".win"
"""The end of every window file's name: a rank's slots in shared memory (:func:`memory_file`) and its storage objects
(:func:`window_object`)."""

HEAD_PREFIX = "replay_head."
"""Names of the heads in storage begin so (not with :data:`WINDOW_PREFIX`: a head is no window)."""

SOURCES = ("memory", "storage")
"""Where a window is found on resume, preferred in this order on a tie."""


def window_object(rank: int, number: int) -> str:
    """The storage object of ``rank``'s stored window number ``number`` (its index over ``persist_every``)."""
    return f"{WINDOW_PREFIX}rank{rank}.{number % STORAGE_COPIES}{WINDOW_SUFFIX}"


def head_object(rank: int, number: int) -> str:
    """The head of :func:`window_object` ``(rank, number)``."""
    return f"{HEAD_PREFIX}rank{rank}.{number % STORAGE_COPIES}.json"


def memory_file(slot_root: Path, slot: int) -> Path:
    """The rank's window slot number ``slot`` in shared memory, beside its snapshot slots (a lost node loses both)."""
    return slot_root.with_name(f"{slot_root.name}.replay_window{slot}{WINDOW_SUFFIX}")


def memory_head(memory: Path) -> Path:
    """The head of a window slot in shared memory."""
    return memory.with_suffix(".head.json")


class Objects(Protocol):
    """Where heads and copies of a window live: storage, or the rank's folder in shared memory."""

    def put(self, name: str, data: bytes) -> None: ...

    def put_file(self, name: str, source: Path) -> int: ...

    def get(self, name: str) -> bytes | None: ...

    def delete(self, name: str) -> None: ...


class MemoryFiles(LocalObjects):
    """The heads of the rank's window slots, as files in its folder of node-local shared memory: replaced atomically
    (a reader sees the old bytes or the new), never fsynced: shared memory does not outlive the node, so there is
    nothing to make durable."""

    durable = False


@dataclass(frozen=True)
class WindowHead:
    """What identifies a copy of a window, read on resume without opening the window."""

    lineage: dict[str, Any] | None
    """The lineage stamp the window was written under."""
    start_step: int
    """The global step before the window's first iteration."""
    window: int
    """W, iterations of the window."""
    length: int
    """Bytes of the window file."""
    crc: int | None
    """CRC32C of the window file: computed for a copy in storage, which a device or a network held; ``None`` for a
    slot in shared memory (checked by length, as snapshot slots are)."""

    @property
    def end_step(self) -> int:
        return self.start_step + self.window

    @property
    def index(self) -> int:
        """The window's number (its first step over W), which chooses its slot and whether it is stored."""
        return self.start_step // self.window

    @classmethod
    def of(cls, log: WindowLog, lineage: Lineage | None, length: int) -> WindowHead:
        """The head of ``log`` sealed into a window file of ``length`` bytes."""
        stamp = lineage.stamp() if lineage is not None else None
        return cls(stamp, log.start_step, log.record.span, length, None)

    def to_bytes(self) -> bytes:
        return seal(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> WindowHead:
        """Parse and validate; raises ``ValueError`` naming the problem."""
        raw = unseal(data)
        fields = ("start_step", "window", "length")
        if any(type(raw.get(name)) is not int or raw[name] < 0 for name in fields) or raw["window"] < 1 or not (
            raw.get("crc") is None or type(raw["crc"]) is int and raw["crc"] >= 0
        ):
            raise ValueError(f"a window head needs integers {', '.join(fields)} >= 0 (window >= 1) and a CRC32C or "
                             f"null, got {raw!r:.120}")
        return cls(raw.get("lineage"), raw["start_step"], raw["window"], raw["length"], raw["crc"])


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

    def invalidate(self) -> None:
        """Remove the head, before anything overwrites the copy's bytes."""
        self.objects.delete(self.head)

    def commit(self, head: WindowHead) -> None:
        """Write the head of the bytes now in place."""
        self.objects.put(self.head, head.to_bytes())

    def copy(self, source: Path, head: WindowHead) -> None:
        """Replace the copy by the bytes of file ``source``, whose head is ``head``, and write that head with their
        CRC32C, computed as they are copied: the old head goes first, so a crash before the new head lands leaves no
        head that names other bytes."""
        self.invalidate()
        crc = self.objects.put_file(self.name, source)
        fault_point("store", head.end_step)
        self.commit(dataclasses.replace(head, crc=crc))

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
                if head.crc is not None:
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
        if nbytes != head.length or crc != head.crc:
            got = f"{nbytes} bytes" + ("" if crc is None else f" (CRC32C {crc:08x})")
            want = f"{head.length} bytes" + ("" if head.crc is None else f" (CRC32C {head.crc:08x})")
            raise ValueError(f"{got} do not match the head's {want}")


@dataclass(frozen=True)
class Candidate:
    """A window of the lineage that a rank could resume from: a copy, known by its head."""

    place: Place
    head: WindowHead

    @property
    def end_step(self) -> int:
        """The window's end (the step training resumes at)."""
        return self.head.end_step

    @property
    def source(self) -> str:
        return self.place.source


@dataclass(frozen=True)
class Restored:
    """The window a resume replays."""

    log: WindowLog
    source: str
    """Where this rank's copy came from: ``memory`` or ``storage``."""
    nbytes: int
    """Size of the copy (the window file)."""
    read_seconds: float
    """Time loading it took (reading a storage object through and checking it, mapping it, reading its tail): the
    first part of a restore from it."""

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
    """Rank ``rank``'s window slots in shared memory (beside ``slot_root``, its snapshot slots' folder) and its
    windows in ``storage``, every ``persist_every``-th window."""

    def __init__(self, storage: CheckpointStorage, slot_root: Path, rank: int, persist_every: int = 1) -> None:
        if persist_every < 1:
            raise ValueError(f"checkpoint.replay.persist_every_n_windows must be >= 1, got {persist_every}")
        self.storage = storage
        self.rank = rank
        self.persist_every = persist_every
        self.slots = [WindowSlot(memory_file(slot_root, slot)) for slot in range(WINDOW_SLOTS)]
        self.stall_seconds: list[float] = []
        """Per hand-over, how long the training thread spent in it (waiting for the previous window, mostly)."""
        self._worker = background_executor("moc-window")
        self._job: Future[None] | None = None
        self._job_slot: int | None = None
        """The slot the job in flight reads."""

    def reserve(self, nbytes: int) -> None:
        """Allocate every slot for a window of ``nbytes`` now, before training (:meth:`WindowSlot.reserve`)."""
        for slot in self.slots:
            slot.reserve(nbytes)

    def open_slot(self, index: int) -> WindowSlot:
        """The slot window number ``index`` is captured into, its previous window given up: its head goes first,
        once the storage write reading it (if one is in flight) has landed."""
        slot = index % WINDOW_SLOTS
        if self._job_slot == slot:
            self._wait()
        self._place("memory", slot).invalidate()
        self.slots[slot].begin()
        return self.slots[slot]

    def hand_over(self, log: WindowLog, lineage: Lineage | None, copied: Future[Any] | None = None) -> None:
        """Give a completed window (captured into :meth:`open_slot`'s slot of its index) to the background thread,
        once the previous one is sealed and stored; it seals the window once ``copied`` (its last capture's copy, if
        still in flight) is done. Raises what the previous window's background work raised."""
        start = time.perf_counter()
        self._wait()
        fault_point("handover", log.end_step)
        index = log.start_step // log.record.span
        self._job = self._worker.submit(self._seal_and_store, log, lineage, index, copied)
        self._job_slot = index % WINDOW_SLOTS
        self.stall_seconds.append(time.perf_counter() - start)

    def flush(self) -> None:
        """Wait for the newest window to be sealed and stored (fit end); raises what its work raised. Every window
        due for storage was written there, and a window resumed from memory was re-stored before training, so
        nothing else is missing from storage."""
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
                    log = chosen.place.load(chosen.head)
                    loaded = (chosen, log, time.perf_counter() - start)
                    fault_point("restore", end_step)
                except Exception as err:  # the ranks agree again without it, below
                    self._skip(chosen.place, err)
            if all(gather(loaded is not None)):
                break
            if loaded is None:
                candidates.remove(chosen)
        assert loaded is not None  # the loop ends only once every rank, this one included, has loaded its copy
        _, log, seconds = loaded
        self._agree_on_restore(chosen if restore else None)
        return Restored(log, chosen.source, chosen.head.length, seconds)

    def candidates(self, lineage: Lineage) -> list[Candidate]:
        """This rank's windows of ``lineage``'s current timeline, in memory and in storage, from their heads."""
        places = [self._place("memory", slot) for slot in range(WINDOW_SLOTS)]
        places += [self._place("storage", number) for number in range(STORAGE_COPIES)]
        found = []
        for place in places:
            try:
                head = place.read_head()
            except Exception as err:  # one rank raising alone would leave the others waiting in the gather
                self._skip(place, err)
                continue
            if head is not None and lineage.admits(head.lineage, head.end_step):
                found.append(Candidate(place, head))
        return found

    def _place(self, source: str, number: int) -> Place:
        """The copy in memory slot ``number``, or in storage object ``number`` (a stored window's index over
        ``persist_every``)."""
        if source == "memory":
            path = self.slots[number].path
            return Place(source, MemoryFiles(path.parent), path.name, memory_head(path).name, str(path), path)
        name = window_object(self.rank, number)
        return Place(source, self.storage, name, head_object(self.rank, number), name, self.storage.local_file(name))

    def _skip(self, place: Place, err: Exception) -> None:
        print(f"[moc_lightning] rank {self.rank}: skipping the replay window in {place.source} ({place.where}), "
              f"unreadable: {type(err).__name__}: {err}")

    def _agree_on_restore(self, only_in_memory: Candidate | None) -> None:
        """Given ``only_in_memory``, write the resumed window (only memory held it) to storage as it lies in memory
        (nothing writes it while the ranks resume); if that fails on any rank, every rank raises
        :class:`AgreedFailure` (collective, run on every rank whatever happened)."""
        failure = None
        if only_in_memory is not None:
            head = only_in_memory.head
            place = self._place("storage", head.index // self.persist_every)
            try:
                self._store(self.slots[head.index % WINDOW_SLOTS].path, head, place)
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
            job, self._job, self._job_slot = self._job, None, None
            job.result()

    def _seal_and_store(self, log: WindowLog, lineage: Lineage | None, index: int, copied: Future[Any] | None) -> None:
        """Seal window number ``index`` in its slot once ``copied`` is done, then, if it is due, copy the slot's file
        to storage; each with its head."""
        if copied is not None:
            copied.result()
        slot = index % WINDOW_SLOTS
        memory = self._place("memory", slot)
        head = WindowHead.of(log, lineage, self.slots[slot].seal(log.tail(lineage)))
        fault_point("seal", log.end_step)
        memory.commit(head)
        if index % self.persist_every == 0:
            self._store(self.slots[slot].path, head, self._place("storage", index // self.persist_every))

    @staticmethod
    def _store(source: Path, head: WindowHead, storage: Place) -> None:
        """Copy the window file ``source`` (a slot) to ``storage``, its head with the file's CRC32C (one pass over
        its bytes: :meth:`Place.copy`)."""
        nbytes = source.stat().st_size
        if nbytes != head.length:
            raise ValueError(f"{source} holds {nbytes} bytes, its head says {head.length}")
        storage.copy(source, head)
