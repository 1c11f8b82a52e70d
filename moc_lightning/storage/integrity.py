"""Checksums, and the one error every storage backend raises for a damaged checkpoint (DESIGN.md, hard part 5).

A committed checkpoint can still rot, be truncated or lose files after the manifest named it. Readers
verify every item before handing its bytes to DCP's planner, and report any damage as
:class:`CorruptCheckpointError`, so the engine can tell "this stored version is unusable, fall back to an
older one" from every other failure (a bug, a full disk), which must stay loud.

Checksums are CRC32C: hardware-accelerated (about 15 GB/s on this machine class, twice ``zlib.crc32``),
and the checksum zarr v3's ``crc32c`` codec stores, so both backends use one algorithm.
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import TypeVar

import google_crc32c
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

METADATA_NAME = ".metadata"
"""DCP's name for the object whose presence makes a location a finished checkpoint (both backends)."""

E = TypeVar("E", bound=BaseException)


class CorruptCheckpointError(BaseException):
    """Checkpoint ``checkpoint`` (its location) cannot be trusted: ``detail`` names the object and the damage.

    A ``BaseException``, as DCP's own ``CheckpointException`` is: ``dcp.load`` catches any ``Exception`` from
    ``read_metadata`` and replaces it with a bare ``AssertionError`` carrying only its text, which would
    lose the type the engine recognises. Nothing should swallow it anyway: a caller either falls back to
    an older version or fails.
    """

    def __init__(self, checkpoint: str, detail: str) -> None:
        super().__init__(checkpoint, detail)  # both in ``args``: DCP pickles failures to gather them across ranks
        self.checkpoint = checkpoint
        self.detail = detail

    def __str__(self) -> str:
        return f"checkpoint {self.checkpoint} is corrupt: {self.detail}"


def checksum(data: bytes) -> int:
    """The CRC32C of ``data``."""
    return google_crc32c.value(data)


def verified(checkpoint: str, what: str, data: bytes, length: int, crc: int) -> bytes:
    """``data`` if it is the ``length`` bytes whose CRC32C is ``crc``; else the damage, naming ``what``."""
    if len(data) != length:
        raise CorruptCheckpointError(checkpoint, f"{what} is truncated: {len(data)} of its {length} bytes remain")
    actual = checksum(data)
    if actual != crc:
        detail = f"{what} fails its CRC32C check (stored {crc:#010x}, read {actual:#010x})"
        raise CorruptCheckpointError(checkpoint, detail)
    return data


def commit_piece(planner: LoadPlanner, item: ReadItem, piece: torch.Tensor, checkpoint: str, what: str) -> None:
    """Copy ``piece``, read for ``item`` from ``what`` of ``checkpoint``, into the planner's target for it.

    A piece that does not fit its target means the checkpoint does not hold what its metadata says.
    """
    target = planner.resolve_tensor(item).detach()
    if target.shape != piece.shape:
        detail = f"{what} gave a piece of shape {tuple(piece.shape)} for a target of shape {tuple(target.shape)}"
        raise CorruptCheckpointError(checkpoint, detail)
    target.copy_(piece)
    planner.commit_tensor(item, target)


def load_metadata(checkpoint: str, data: bytes | None, load_id: str) -> Metadata:
    """The DCP metadata in ``data`` (``None``: the object is missing), stamped with this load's id."""
    if data is None:
        detail = f"{METADATA_NAME} is missing: its save never finished, or it was removed"
        raise CorruptCheckpointError(checkpoint, detail)
    try:
        metadata = pickle.loads(data)
    except Exception as err:  # unpickling damaged bytes can fail with almost any exception type
        raise CorruptCheckpointError(checkpoint, f"{METADATA_NAME} cannot be unpickled: {err!r}") from err
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(checkpoint, f"{METADATA_NAME} holds a {type(metadata).__name__}, not DCP Metadata")
    metadata.storage_meta = metadata.storage_meta or StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def find_cause(exc: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` in ``exc``, its causes and contexts, or the per-rank failures of a ``CheckpointException``.

    DCP catches what a storage reader or writer raises on any rank and re-raises it, on every rank, inside
    a ``CheckpointException`` (a ``BaseException``); this digs the original back out.
    """
    queue: deque[BaseException] = deque([exc])
    seen: set[int] = set()
    while queue:
        current = queue.popleft()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        if isinstance(current, CheckpointException):
            queue.extend(failure for failure, _ in current.failures.values())
        queue.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def corrupt_from(exc: BaseException) -> CorruptCheckpointError | None:
    """The :class:`CorruptCheckpointError` behind ``exc`` (e.g. a ``dcp.load`` failure on any rank), if any."""
    return find_cause(exc, CorruptCheckpointError)
