"""Checksums, and the one error every storage backend raises for a damaged checkpoint (DESIGN.md, hard part 5).

A committed checkpoint can still rot, be truncated or lose files after the manifest named it. Readers
verify every item before handing its bytes to DCP's planner, and report any damage as
:class:`CorruptCheckpointError`, so the engine can tell "this stored version is unusable, fall back to an
older one" from every other failure (a bug, a full disk), which must stay loud.

Checksums are CRC32C (:func:`moc_lightning.storage.sealed.checksum`), on every item and on DCP's ``.metadata``
itself: a flipped byte there can leave a valid pickle that names another key (``expert/L1/E4`` read as
``dxpert/L1/E4``), which DCP would report as a missing key rather than damage. ``.metadata`` is the pickle
followed by ``MOC-CRC32C`` and the pickle's CRC32C (4 bytes, big-endian); ``pickle.load`` stops at the
pickle's end, so DCP's own reader still reads it.
"""

from __future__ import annotations

import io
import pickle
from collections import deque
from typing import TypeVar

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import WriteResult

from moc_lightning.storage.sealed import checksum
from moc_lightning.storage.unpickling import UntrustedPickle, load_dcp_metadata, load_torch_saved

METADATA_NAME = ".metadata"
"""DCP's name for the object whose presence makes a location a finished checkpoint (both backends)."""

METADATA_SEAL = b"MOC-CRC32C"
"""What follows the pickle in ``.metadata``, before the pickle's CRC32C."""

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


def metadata_bytes(metadata: Metadata, results: list[list[WriteResult]], storage_meta: StorageMeta | None) -> bytes:
    """What a writer's ``finish`` publishes as ``.metadata``: DCP's metadata, completed with where every item
    went (``results``), pickled and sealed with its CRC32C."""
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
    metadata.storage_meta = storage_meta
    data = pickle.dumps(metadata)
    return data + METADATA_SEAL + checksum(data).to_bytes(4, "big")


def load_metadata(checkpoint: str, data: bytes | None, load_id: str) -> Metadata:
    """The DCP metadata in ``data`` (``None``: the object is missing), verified, stamped with this load's id."""
    if data is None:
        detail = f"{METADATA_NAME} is missing: its save never finished, or it was removed"
        raise CorruptCheckpointError(checkpoint, detail)
    tail = len(METADATA_SEAL) + 4
    if len(data) < tail or data[-tail:-4] != METADATA_SEAL:
        detail = f"{METADATA_NAME} has no CRC32C seal at its end: damaged, truncated, or written without one"
        raise CorruptCheckpointError(checkpoint, detail)
    body = verified(checkpoint, METADATA_NAME, data[:-tail], len(data) - tail, int.from_bytes(data[-4:], "big"))
    try:
        metadata = load_dcp_metadata(body, METADATA_NAME)
    except UntrustedPickle as err:  # written so on purpose: the checksum matched
        raise CorruptCheckpointError(checkpoint, str(err)) from None
    except Exception as err:  # only if written so: the checksum matched
        raise CorruptCheckpointError(checkpoint, f"{METADATA_NAME} cannot be unpickled: {err!r}") from err
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(checkpoint, f"{METADATA_NAME} holds a {type(metadata).__name__}, not DCP Metadata")
    metadata.storage_meta = metadata.storage_meta or StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


class ListedKeysPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a key the caller asks for and the checkpoint lacks is damage, and that a
    bytes item is unpickled as untrusted input.

    The engine asks a checkpoint only for units its manifest record says it holds, so a missing key means
    the checkpoint is not what was committed: :class:`CorruptCheckpointError` (DCP would raise a plain
    ``RuntimeError``, which recovery cannot tell from a bug). DCP's own ``load_bytes`` is a full ``torch.load``; here
    an item naming a global MoC does not write (:mod:`~moc_lightning.storage.unpickling`) is damage too.
    """

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "DCP sets the planner up with the checkpoint's metadata before planning"
        stored = self.metadata.state_dict_metadata
        missing = sorted(key for key in self.state_dict if key not in stored)
        if missing:
            detail = f"it lacks keys {missing[:3]} ({len(missing)} in all) of units the manifest says it holds"
            raise CorruptCheckpointError(self.checkpoint, detail)
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = load_torch_saved(value, f"item {key!r}")
        except UntrustedPickle as err:
            raise CorruptCheckpointError(self.checkpoint, str(err)) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded


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
