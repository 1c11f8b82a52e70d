"""Level 1: in-memory snapshots in node-local shared memory, in a triple buffer of reused slots.

Each rank owns three slots under ``<shm_root>/<run>/<node>/rank<r>/slot<i>/``: a ``data`` file mapped
into memory (allocated once, grown only when a larger selection needs it, then reused) and a ``meta.json``
written last, atomically, once every byte is in place. A slot without ``meta.json``, or whose ``meta.json``
fails its CRC32C (it is sealed JSON), is torn or being written and is never read. Living in ``/dev/shm`` the slots outlive the process: a restarted worker on a
healthy node finds them; losing the node (its shared-memory root) loses only that node's slots.

The three slots rotate as in MoC-System's Figure 9: one holds the newest persisted snapshot (the recovery
buffer), one may be in persist, the other takes the next snapshot.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moc_lightning.storage.sealed import seal, unseal

NUM_SLOTS = 3
ALIGN = 64
"""Byte alignment of every tensor in a slot, so a byte range can be viewed as any dtype."""

_DTYPES = {str(dt): dt for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                  torch.int32, torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class SlotEntry:
    """Where one tensor lies in a slot's data file."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class SlotMeta:
    """The committed description of a complete slot."""

    slot: int
    step: int
    units: tuple[str, ...]
    entries: Mapping[str, SlotEntry]
    extra: Mapping[str, Any]
    """Small JSON state of the engine at this step (ledger, selection, K)."""
    parts: tuple[str, ...] = ()
    """Part keys of the units held as one part only (``checkpoint.pec_scope``, :mod:`moc_lightning.engine.parts`)."""

    def to_json(self) -> bytes:
        """Sealed JSON (:mod:`moc_lightning.storage.sealed`): a damaged ``meta.json`` is a torn slot, never misread."""
        entries = {k: [e.offset, e.dtype, list(e.shape)] for k, e in self.entries.items()}
        return seal(
            {"slot": self.slot, "step": self.step, "units": list(self.units), "entries": entries, "extra": self.extra,
             "parts": list(self.parts)}
        )

    @classmethod
    def from_json(cls, data: bytes) -> SlotMeta:
        """Verify and parse; damage raises ``ValueError`` (:class:`SealError`), a malformed object ``KeyError``
        or ``TypeError``."""
        raw = unseal(data)
        return cls(
            slot=int(raw["slot"]),
            step=int(raw["step"]),
            units=tuple(raw["units"]),
            entries={k: SlotEntry(int(o), str(d), tuple(s)) for k, (o, d, s) in raw["entries"].items()},
            extra=raw["extra"],
            parts=tuple(raw.get("parts", ())),
        )


def layout_entries(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, SlotEntry], int]:
    """Aligned offsets for ``tensors`` packed one after another, and the bytes they need."""
    entries, offset = {}, 0
    for key, tensor in tensors.items():
        entries[key] = SlotEntry(offset, str(tensor.dtype), tuple(tensor.shape))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return entries, offset


@dataclass
class Fill:
    """A slot being filled (:meth:`SnapshotStore.fill`): its layout, and the part of its copy not done yet."""

    entries: dict[str, SlotEntry]
    """Where each tensor lies in the slot."""
    stream: torch.cuda.Stream | None = None
    """The side stream the GPU tensors' copy was enqueued on."""
    rest: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """Host copy left to do: (slot views, live tensors)."""
    midway: Callable[[], None] | None = None
    """Runs between the halves of :attr:`rest`'s copy."""

    def complete(self) -> None:
        """Do the host copy left (on the calling thread: a copy thread) and wait for the GPU copy."""
        if self.rest is not None:
            _copy_in_halves(*self.rest, self.midway)
            self.rest = None
        if self.stream is not None:
            self.stream.synchronize()


def _copy_in_halves(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    midway: Callable[[], None] | None = None,
    non_blocking: bool = False,
) -> None:
    """One ``_foreach_copy_`` per half of ``sources`` (it runs without the GIL), ``midway()`` between them."""
    half = len(sources) // 2
    with torch.no_grad():
        for part in (slice(0, half), slice(half, None)):
            if part.start == half and midway is not None:
                midway()
            if targets[part]:
                torch._foreach_copy_(targets[part], sources[part], non_blocking=non_blocking)


class SnapshotStore:
    """This rank's triple buffer of snapshot slots in node-local shared memory."""

    def __init__(self, root: str | os.PathLike[str], pin_device: torch.device | None = None) -> None:
        """``pin_device``: the CUDA device training runs on; its slots are page-locked for that device's
        copies. ``None`` (CPU training): nothing is pinned."""
        self.root = Path(root)
        self.pin_device = pin_device if pin_device is not None and pin_device.type == "cuda" else None
        self.root.mkdir(parents=True, exist_ok=True)
        self._mappings: dict[int, mmap.mmap] = {}
        if self.pin_device is not None:
            # A store dropped without remove() would unmap its slots with the driver still holding them registered:
            # a later allocation at those addresses (a pageable tensor) is then taken for pinned memory by the
            # driver. Unregister first. Not at exit: the process's memory goes with it.
            weakref.finalize(self, _unpin_all, self.pin_device, self._mappings).atexit = False
        self._steps: dict[int, int] | None = None
        """Step of each complete slot as this process last wrote or read it (saves a disk scan per snapshot)."""
        self._targets: dict[tuple[int, tuple], tuple[list[SlotEntry], list[torch.Tensor]]] = {}
        """Per slot and sequence of tensor dtypes and shapes, the place of each tensor in the slot and a view to copy
        into: a snapshot laid out as one before in that slot is one ``_foreach_copy_``, with no layout or views to
        build first. Keyed without the tensors' names, so that the sequential selection's next experts (the same
        shapes in the same order as the last ones) reuse them."""

    def slot_dir(self, slot: int) -> Path:
        return self.root / f"slot{slot}"

    def committed(self) -> list[SlotMeta]:
        """Complete slots, oldest step first; torn or unreadable ones are skipped."""
        metas = []
        for slot in range(NUM_SLOTS):
            path = self.slot_dir(slot) / "meta.json"
            try:
                meta = SlotMeta.from_json(path.read_bytes())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if meta.slot == slot and (self.slot_dir(slot) / "data").exists():
                metas.append(meta)
        return sorted(metas, key=lambda m: m.step)

    def choose_slot(self, busy: set[int]) -> int:
        """The slot for the next snapshot: a free one, else the oldest complete one not in ``busy``.

        ``busy`` holds the slot being persisted and the newest persisted one (the recovery buffer).
        """
        complete = self._known_steps()
        free = [s for s in range(NUM_SLOTS) if s not in complete and s not in busy]
        if free:
            return free[0]
        candidates = sorted((step, s) for s, step in complete.items() if s not in busy)
        if not candidates:
            raise RuntimeError(f"no snapshot slot free: busy={sorted(busy)} of {NUM_SLOTS}")
        return candidates[0][1]

    def steps(self) -> list[int]:
        """Steps of the complete slots, as this process last wrote or read them (no disk scan)."""
        return sorted(self._known_steps().values())

    def _known_steps(self) -> dict[int, int]:
        if self._steps is None:
            self._steps = {m.slot: m.step for m in self.committed()}
        return self._steps

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` incomplete: its ``meta.json`` goes first, so no reader can see it half-rewritten."""
        (self.slot_dir(slot) / "meta.json").unlink(missing_ok=True)
        self._known_steps().pop(slot, None)

    def reserve(self, nbytes: int) -> None:
        """Allocate every slot for ``nbytes`` now, before training needs them.

        A slot's first use otherwise pays for the first touch of every page of shared memory (on this
        machine class, 15-20 ms for 40 MB against 2 ms for the copy itself).
        """
        for slot in range(NUM_SLOTS):
            self._map(slot, nbytes)

    def _map(self, slot: int, nbytes: int) -> mmap.mmap:
        """The slot's ``data`` file mapped into memory, at least ``nbytes`` long; its content is kept
        (:func:`map_file`)."""
        previous = self._mappings.get(slot)
        if previous is not None and len(previous) >= nbytes:
            return previous
        mapping = map_file(self.slot_dir(slot) / "data", nbytes)
        if previous is not None:
            self._unpin(previous)
            self._targets = {k: v for k, v in self._targets.items() if k[0] != slot}
        if self.pin_device is not None:
            _cuda_call("cudaHostRegister", self.pin_device, _address(mapping), len(mapping), _HOST_REGISTER_PORTABLE)
        self._mappings[slot] = mapping
        return mapping

    def commit(self, meta: SlotMeta) -> None:
        """Publish a complete slot: ``meta.json`` appears atomically after all bytes are in place."""
        directory = self.slot_dir(meta.slot)
        tmp = directory / "meta.json.tmp"
        tmp.write_bytes(meta.to_json())
        os.replace(tmp, directory / "meta.json")
        self._known_steps()[meta.slot] = meta.step

    def write(
        self,
        slot: int,
        step: int,
        units: tuple[str, ...],
        tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, Any],
        midway: Callable[[], None] | None = None,
    ) -> SlotMeta:
        """Copy ``tensors`` into ``slot`` and commit it: :meth:`fill` then :meth:`finish`."""
        return self.finish(slot, step, units, self.fill(slot, tensors, midway), extra)

    def fill(
        self,
        slot: int,
        tensors: Mapping[str, torch.Tensor],
        midway: Callable[[], None] | None = None,
        defer: Collection[str] = (),
    ) -> Fill:
        """Invalidate ``slot`` and start copying ``tensors`` into it; :meth:`Fill.complete` (which :meth:`finish`
        calls) completes the copy.

        Host tensors are copied now, on the calling thread, except those named in ``defer``: their copy is left to
        :meth:`Fill.complete`, which a caller runs on a copy thread while training goes on, as long as nothing
        writes to them. GPU tensors are enqueued on a side CUDA stream that first waits for the training stream's
        work so far (the values are final there), so the device-to-host copy overlaps the next forward and
        backward; :meth:`Fill.complete` waits for that stream. The copy goes in two halves, ``midway()`` between
        them (fault drills tear a snapshot there): halves of the deferred tensors when there are any.
        """
        entries, targets = self._prepare(slot, tensors)
        sources = list(tensors.values())
        if any(t.is_cuda for t in sources):
            stream = _side_stream()
            with torch.cuda.stream(stream):
                _copy_in_halves(targets, sources, midway, non_blocking=True)
            return Fill(entries, stream=stream)
        later = [key in defer for key in tensors]
        now = [(t, s) for t, s, deferred in zip(targets, sources, later) if not deferred]
        rest = [(t, s) for t, s, deferred in zip(targets, sources, later) if deferred]
        if not rest:
            _copy_in_halves(targets, sources, midway)
            return Fill(entries)
        _copy_in_halves([t for t, _ in now], [s for _, s in now])
        return Fill(entries, rest=([t for t, _ in rest], [s for _, s in rest]), midway=midway)

    def finish(
        self,
        slot: int,
        step: int,
        units: tuple[str, ...],
        fill: Fill,
        extra: Mapping[str, Any],
        parts: tuple[str, ...] = (),
    ) -> SlotMeta:
        """Complete ``fill``'s copy, then commit the slot: no ``meta.json`` before every byte is in place."""
        fill.complete()
        meta = SlotMeta(slot=slot, step=step, units=units, entries=dict(fill.entries), extra=dict(extra), parts=parts)
        self.commit(meta)
        return meta

    def _prepare(
        self, slot: int, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, SlotEntry], list[torch.Tensor]]:
        """Invalidate ``slot`` and return its layout for ``tensors`` and a view of the slot for each."""
        self.invalidate(slot)
        signature = _signature(tensors)
        cached = self._targets.get((slot, signature))
        if cached is None:
            entries, nbytes = layout_entries(tensors)
            cached = self._lay_out(slot, signature, entries, self._map(slot, nbytes))
        placed, views = cached
        return dict(zip(tensors, placed)), views

    def prepare(self, slots: Collection[int], tensors: Mapping[str, torch.Tensor]) -> None:
        """Lay out tensors shaped like ``tensors`` in each of ``slots`` now, with a view of the slot for each, so that a
        later snapshot shaped the same (the sequential selection's next experts) finds them built: a copy thread does
        it after a commit, while no snapshot is taken. A slot not mapped large enough yet is left alone (a mapping
        grows only on the snapshot's thread)."""
        signature = _signature(tensors)
        entries, nbytes = layout_entries(tensors)
        for slot in slots:
            mapping = self._mappings.get(slot)
            if (slot, signature) not in self._targets and mapping is not None and len(mapping) >= nbytes:
                self._lay_out(slot, signature, entries, mapping)

    def _lay_out(
        self, slot: int, signature: tuple, entries: dict[str, SlotEntry], mapping: mmap.mmap
    ) -> tuple[list[SlotEntry], list[torch.Tensor]]:
        """The places and views of ``entries`` in ``slot``'s ``mapping``, kept for snapshots of ``signature``."""
        laid_out = list(entries.values()), [view_of(mapping, entry) for entry in entries.values()]
        self._targets[(slot, signature)] = laid_out
        return laid_out

    def _unpin(self, mapping: mmap.mmap) -> None:
        """Undo the page-locking of a mapping that is being replaced."""
        if self.pin_device is not None:
            _cuda_call("cudaHostUnregister", self.pin_device, _address(mapping))

    def read(self, meta: SlotMeta, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of a committed slot, zero-copy (valid until the slot is reused)."""
        mapping = self._map(meta.slot, 0)
        wanted = list(meta.entries) if keys is None else keys
        return {key: view_of(mapping, meta.entries[key]) for key in wanted}

    def clear(self) -> None:
        """Remove every slot of this rank (a fresh start)."""
        self.remove()
        self.root.mkdir(parents=True, exist_ok=True)

    def remove(self) -> None:
        """Remove every slot of this rank and its folder (the run is over)."""
        if self.pin_device is not None:
            _unpin_all(self.pin_device, self._mappings)
        self._mappings.clear()
        self._targets.clear()
        self._steps = {}
        shutil.rmtree(self.root, ignore_errors=True)


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """The copy stream of the current device, ordered after the training stream's work so far."""
    device = torch.cuda.current_device()
    stream = _STREAMS.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the pages count as pinned for every CUDA context, not only the caller's."""


def _cuda_call(name: str, device: torch.device, *args: int) -> None:
    """Call a CUDA runtime function on ``device`` (slots are mapped on the copy thread, whose current device
    is not the rank's) and raise if it fails: an unpinned slot would silently turn the side-stream copy
    into a synchronous one."""
    with torch.cuda.device(device):
        result = getattr(torch.cuda.cudart(), name)(*args)
    code = int(getattr(result, "value", result))
    if code != 0:
        _take_last_cuda_error()
        raise RuntimeError(
            f"{name} failed on {device} with CUDA error {code} ({result}) for a snapshot slot; "
            "checkpoint.shm_root must be on a tmpfs such as /dev/shm (the driver refuses to page-lock a file on disk: "
            "seen on an H200 node's ext4 /tmp), within the locked-memory limit (ulimit -l)"
        )


def _unpin_all(device: torch.device, mappings: dict[int, mmap.mmap]) -> None:
    """Undo the page-locking of every mapping in ``mappings`` (a store's slots), and forget them."""
    for mapping in mappings.values():
        _cuda_call("cudaHostUnregister", device, _address(mapping))
    mappings.clear()


def _take_last_cuda_error() -> None:
    """Clear the error a failed runtime call leaves for this thread's next ``cudaGetLastError``: PyTorch reads that
    after every kernel launch, so the next unrelated launch would raise it as its own (``invalid argument`` from a
    ``.to(device)``). torch binds no ``cudaGetLastError``; the runtime it loaded is found by its soname. Where none is
    found by that name nothing is cleared, and the error this module raises still names the failed call."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        ctypes.CDLL(f"libcudart.so.{major}").cudaGetLastError()
    except (OSError, AttributeError):
        return


def _address(mapping: mmap.mmap) -> int:
    return torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()


def allocate(path: Path, nbytes: int, start: int = 0) -> None:
    """Allocate bytes ``[start, nbytes)`` of file ``path`` (created, with its folders, if missing; never shortened): a
    full tmpfs fails here with ENOSPC rather than killing the process with SIGBUS in the middle of a copy. ``start``:
    where the caller knows every byte before is allocated (a fallocate walks every page of its range, allocated or
    not: 17-37 ms for 338 MB of tmpfs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if nbytes > start:
            os.posix_fallocate(fd, start, nbytes - start)
    finally:
        os.close(fd)


def map_file(path: Path, nbytes: int) -> mmap.mmap:
    """File ``path`` mapped shared and whole, at least ``nbytes`` (and :data:`ALIGN`) long; its content is kept.

    Its pages are allocated (:func:`allocate`) and mapped in (``MAP_POPULATE``) before anyone copies into it: a first
    touch of shared memory costs several times a copy."""
    allocate(path, max(nbytes, ALIGN))
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _signature(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """What a slot's layout of ``tensors`` depends on: their dtypes and shapes in order, not their names."""
    return tuple((t.dtype, t.shape) for t in tensors.values())


def view_of(mapping: bytes | mmap.mmap, entry: SlotEntry) -> torch.Tensor:
    """The tensor ``entry`` describes, on a storage that is exactly its bytes of the slot's ``mapping``.

    Exactly: DCP clones a tensor whose storage is larger before writing it (``torch.save`` would write the
    whole storage), which would cost a persist from the slot a fresh allocation and a copy of every tensor.
    """
    dtype = _DTYPES[entry.dtype]
    numel = entry.nbytes // dtype.itemsize
    if numel == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=entry.offset).view(entry.shape)
