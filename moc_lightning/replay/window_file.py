"""A replay window as one file, and the shared-memory slots a rank's captures copy into in place.

Format: the window's tensor bytes, each at an offset aligned to :data:`~moc_lightning.memory.snapshot.ALIGN`; then a small
*tail* (``torch.save`` of everything else: schedule, batches, RNG states, trainer state, and where each tensor lies);
then a fixed :data:`FOOTER` naming the tail's offset and length. A reader maps the file and views each tensor where
it lies, so a restore reads every byte once, copying it into the live tensors.

Why the captures copy straight into the file: a window copies more than a full checkpoint (every unit's full state
once, plus the logged weights of the frozen units), and on a host with few cores every byte a background thread moves
is taken from training. Serialising a window captured into process memory moved each of its bytes twice more (the
pickler into the file, a checksum beside it). Captured into a :class:`WindowSlot`, a window is complete in shared
memory once its tail is written: the training thread's copy is the only pass over its bytes until storage reads it.

A rank has :data:`WINDOW_SLOTS` slots, used alternately by window index: the newest complete window stays intact in
one while the next is captured into the other. A slot's regions are laid out at its first window and reused (a
tensor whose shape or dtype changed, such as optimizer state appearing, gets a new region at the end), so after the
first window a capture touches no new page.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from moc_lightning.memory.snapshot import ALIGN, SlotEntry, allocate, map_file, view_of
from moc_lightning.storage.unpickling import load_torch_saved

WINDOW_SLOTS = 2
"""Slots per rank: the newest complete window, and the one being captured."""

FOOTER = struct.Struct("<QQ8s")
"""The last bytes of a window file: the tail's offset and length, and :data:`MAGIC`."""

MAGIC = b"MOCWIN01"

OVERRUN = 0.01
"""A slot's margin over its reservation (:meth:`WindowSlot.reserve`), and how much its file grows past its mapping at
least (:meth:`WindowSlot._map`), as a share of them."""

BufferKey = tuple[int, str]
"""A capture buffer: ``(t, key)``, with ``t`` the offset of logged weights, or :data:`FULL` for a unit's full state
(taken once a window) (:class:`~moc_lightning.replay.core.WindowRecord`)."""

FULL = -1


class WindowSlot:
    """One of a rank's window files in node-local shared memory, which a window's captures copy into (the
    ``buffers`` of its :class:`~moc_lightning.replay.core.WindowRecord`) and :meth:`seal` completes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.regions: dict[BufferKey, SlotEntry] = {}
        """Where each capture buffer lies in the file."""
        self._end = 0
        """Bytes the regions span."""
        self._mapping: mmap.mmap | None = None
        self._views: dict[BufferKey, torch.Tensor] = {}

    def reserve(self, nbytes: int) -> None:
        """Allocate and map ``nbytes`` of the file now, and :data:`OVERRUN` more, before training needs them: a first
        touch of shared memory costs several times a copy, and a full tmpfs fails here (ENOSPC) rather than with
        SIGBUS in a copy. The margin takes what a window's regions add to the estimate (each region's alignment, state
        the estimate misses: 0.25% for ``small_16e`` at W=4), so the first window does not map the file again."""
        self._map(nbytes + int(nbytes * OVERRUN))

    def buffer(self, key: BufferKey, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The region of ``key``, shaped as ``like`` and of ``dtype`` (``like``'s by default): the one of the previous
        windows when its shape and dtype still fit, else a new one at the end."""
        dtype_name = str(like.dtype if dtype is None else dtype)
        entry = self.regions.get(key)
        if entry is None or entry.shape != tuple(like.shape) or entry.dtype != dtype_name:
            entry = self.regions[key] = SlotEntry(self._end, dtype_name, tuple(like.shape))
            self._end += -(-entry.nbytes // ALIGN) * ALIGN
            self._views.pop(key, None)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = view_of(self._map(self._end), entry)
        return view

    def begin(self) -> None:
        """Before a window's first capture: give the file back the pages :meth:`seal` cut off, and only those (the
        pages before them are the regions, still allocated)."""
        if self._mapping is not None:
            allocate(self.path, len(self._mapping), start=self.path.stat().st_size)

    def seal(self, tail: Mapping[str, Any]) -> int:
        """Complete the file: ``tail`` after the regions (where it names a capture buffer by its :data:`BufferKey`,
        the region's place is written), then the footer; the file ends there. Returns its length."""
        data = io.BytesIO()
        torch.save(_placed(tail, self.regions), data)
        payload = data.getbuffer()
        with self.path.open("r+b") as f:
            f.seek(self._end)
            f.write(payload)
            f.write(FOOTER.pack(self._end, len(payload), MAGIC))
            length = f.tell()
            f.truncate(length)
        return length

    def _map(self, nbytes: int) -> mmap.mmap:
        """The file mapped, at least ``nbytes`` long (:func:`~moc_lightning.memory.snapshot.map_file`; a larger mapping
        replaces the old one; views of the old one stay valid: both map the same pages).

        Past a mapping, it grows by :data:`OVERRUN` of it at least: a window's regions overrun their reservation by a
        little (each region's alignment, state the estimate misses), region by region, and each remap allocates and
        populates the whole file again."""
        if self._mapping is None or len(self._mapping) < nbytes:
            grown = 0 if self._mapping is None else len(self._mapping) + int(len(self._mapping) * OVERRUN)
            self._mapping = map_file(self.path, max(nbytes, grown))
        return self._mapping


def _placed(value: Any, regions: Mapping[BufferKey, SlotEntry]) -> Any:
    """``value`` with every :class:`Region` marker replaced by the place of its buffer."""

    def place(region: Region) -> Region:
        entry = regions[region.key]
        return Region(region.key, (entry.offset, entry.dtype, entry.shape))

    return _map_regions(value, place)


def _map_regions(value: Any, fn: Callable[[Region], Any]) -> Any:
    """``value`` (a tail: dicts and lists around the values) with every :class:`Region` in it replaced by ``fn`` of
    it; everything else is kept as it is."""
    if isinstance(value, Region):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_regions(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_regions(v, fn) for v in value]
    return value


class Region:
    """In a tail: a tensor that lies in the file's regions (``place``: offset, dtype, shape, filled in by
    :meth:`WindowSlot.seal`)."""

    def __init__(self, key: BufferKey, place: tuple[int, str, tuple[int, ...]] | None = None) -> None:
        self.key = key
        self.place = place

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return Region, (self.key, self.place)


def read_file(path: Path) -> dict[str, Any]:
    """The tail of the window file at ``path``, with its tensors as views of the file mapped read-only (nothing is
    read until they are; a file replaced later keeps its old pages mapped, one overwritten in place does not)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < FOOTER.size:
            raise ValueError(f"{path} holds {size} bytes, less than a window file's footer")
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return read_buffer(mapping)


def read_buffer(data: bytes | mmap.mmap) -> dict[str, Any]:
    """The tail of a window file held in ``data``, with its tensors as read-only views of ``data``."""
    view = memoryview(data)
    if len(view) < FOOTER.size:
        raise ValueError(f"{len(view)} bytes are less than a window file's footer")
    offset, length, magic = FOOTER.unpack(view[-FOOTER.size :])
    if magic != MAGIC or offset + length + FOOTER.size != len(view):
        raise ValueError(f"not a replay window file (footer {magic!r}, tail at {offset}+{length} of {len(view)} bytes)")
    # untrusted input (shared memory or storage): torch's weights-only unpickler, allowing the one class of MoC's a
    # tail holds besides tensors, containers and NumPy's RNG state
    tail = load_torch_saved(io.BytesIO(view[offset : offset + length]), "the replay window's tail", allowed=[Region])
    with warnings.catch_warnings():  # a read-only mapping: the views are only ever copied from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _viewed(tail, data, offset)


def _viewed(value: Any, data: bytes | mmap.mmap, end: int) -> Any:
    """``value`` with every :class:`Region` replaced by a view of its bytes in ``data``, checked to lie before
    ``end`` (the tail's offset)."""

    def view(region: Region) -> torch.Tensor:
        if region.place is None:
            raise ValueError(f"the window's tail names buffer {region.key} without its place")
        offset, dtype, shape = region.place
        entry = SlotEntry(offset, dtype, tuple(shape))
        if offset + entry.nbytes > end:
            raise ValueError(f"buffer {region.key} lies at {offset}+{entry.nbytes}, past the regions' {end} bytes")
        return view_of(data, entry)

    return _map_regions(value, view)
