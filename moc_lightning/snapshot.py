"""Level 1: in-memory snapshots in node-local shared memory, in a triple buffer of reused slots.

Each rank owns three slots under ``<shm_root>/<run>/<node>/rank<r>/slot<i>/``: a ``data`` file mapped
into memory (allocated once, grown only when a larger selection needs it, then reused) and a ``meta.json``
written last, atomically, once every byte is in place. A slot without ``meta.json`` is torn or being
written and is never read. Living in ``/dev/shm`` the slots outlive the process: a restarted worker on a
healthy node finds them; losing the node (its shared-memory root) loses only that node's slots.

The three slots rotate as in MoC-System's Figure 9: one holds the newest persisted snapshot (the recovery
buffer), one may be in persist, the other takes the next snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


@dataclass(frozen=True)
class SlotMeta:
    """The committed description of a complete slot."""

    slot: int
    step: int
    units: tuple[str, ...]
    entries: Mapping[str, SlotEntry]
    extra: Mapping[str, Any]
    """Small JSON state of the engine at this step (ledger, selection, K)."""

    def to_json(self) -> bytes:
        entries = {k: [e.offset, e.dtype, list(e.shape)] for k, e in self.entries.items()}
        return json.dumps(
            {"slot": self.slot, "step": self.step, "units": list(self.units), "entries": entries, "extra": self.extra}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SlotMeta:
        raw = json.loads(data)
        return cls(
            slot=int(raw["slot"]),
            step=int(raw["step"]),
            units=tuple(raw["units"]),
            entries={k: SlotEntry(int(o), str(d), tuple(s)) for k, (o, d, s) in raw["entries"].items()},
            extra=raw["extra"],
        )


def layout_entries(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, SlotEntry], int]:
    """Aligned offsets for ``tensors`` packed one after another, and the bytes they need."""
    entries, offset = {}, 0
    for key, tensor in tensors.items():
        entries[key] = SlotEntry(offset, str(tensor.dtype), tuple(tensor.shape))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return entries, offset


class SnapshotStore:
    """This rank's triple buffer of snapshot slots in node-local shared memory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._buffers: dict[int, torch.Tensor] = {}
        self._steps: dict[int, int] | None = None
        """Step of each complete slot as this process last wrote or read it (saves a disk scan per snapshot)."""

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

    def _known_steps(self) -> dict[int, int]:
        if self._steps is None:
            self._steps = {m.slot: m.step for m in self.committed()}
        return self._steps

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` incomplete: its ``meta.json`` goes first, so no reader can see it half-rewritten."""
        (self.slot_dir(slot) / "meta.json").unlink(missing_ok=True)
        self._known_steps().pop(slot, None)

    def begin(self, slot: int, nbytes: int) -> torch.Tensor:
        """Invalidate ``slot`` and return its byte buffer (at least ``nbytes``), reusing the mapping."""
        directory = self.slot_dir(slot)
        directory.mkdir(parents=True, exist_ok=True)
        self.invalidate(slot)
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, ALIGN)
            path = directory / "data"
            with open(path, "wb") as f:  # size the file; from_file maps it shared
                f.truncate(size)
            buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            _pin(buffer)
            self._buffers[slot] = buffer
        return buffer

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
        between_tensors: Callable[[int], None] | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> SlotMeta:
        """Copy ``tensors`` into ``slot`` and commit it. ``between_tensors(i)`` is a hook for fault drills.

        GPU tensors are copied on a side CUDA stream (after ``ready``, an event recorded on the training
        stream once the values are final) into the pinned slot, so the copy overlaps the next forward and
        backward; the slot is committed only after the stream has finished.
        """
        entries, nbytes = layout_entries(tensors)
        buffer = self.begin(slot, nbytes)
        stream = _side_stream(ready) if any(t.is_cuda for t in tensors.values()) else None
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, (key, tensor) in enumerate(tensors.items()):
                if between_tensors is not None:
                    between_tensors(i)
                view_of(buffer, entries[key]).copy_(tensor, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()
        meta = SlotMeta(slot=slot, step=step, units=units, entries=entries, extra=dict(extra))
        self.commit(meta)
        return meta

    def read(self, meta: SlotMeta, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Views of the tensors of a committed slot (zero-copy; valid until the slot is reused)."""
        buffer = self._buffers.get(meta.slot)
        if buffer is None:
            path = self.slot_dir(meta.slot) / "data"
            buffer = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
            self._buffers[meta.slot] = buffer
        wanted = meta.entries.keys() if keys is None else keys
        return {key: view_of(buffer, meta.entries[key]) for key in wanted}

    def clear(self) -> None:
        """Remove every slot of this rank (a fresh start)."""
        self._buffers.clear()
        self._steps = {}
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(ready: torch.cuda.Event | None) -> torch.cuda.Stream:
    """A copy stream per device, ordered after the training stream's ``ready`` event."""
    device = torch.cuda.current_device()
    stream = _STREAMS.setdefault(device, torch.cuda.Stream(device))
    if ready is not None:
        stream.wait_event(ready)
    return stream


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock a shared-memory slot so device-to-host copies run asynchronously at full bandwidth."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)


def view_of(buffer: torch.Tensor, entry: SlotEntry) -> torch.Tensor:
    """The tensor ``entry`` describes, as a view into the slot's byte buffer."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(_DTYPES[entry.dtype]).view(entry.shape)
