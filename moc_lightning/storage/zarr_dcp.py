"""DCP ``StorageWriter``/``StorageReader`` that keep every tensor chunk as a zarr v3 array in a TensorStore kvstore.

Layout of one checkpoint (keys under its kvstore prefix)::

    <fqn>/@<o0>.<o1>...     zarr v3 array: the chunk of tensor <fqn> whose offsets are (o0, o1, ...)
    .bytes/<plan index>     non-tensor values of one rank's plan, concatenated (torch.save bytes)
    .metadata               pickled DCP Metadata + its CRC32C, written last by the coordinator

**One array per (fqn, chunk offset), not one full-shape array per fqn.** Every chunk is written by exactly
one rank (DCP plans never write one ``MetadataIndex`` twice), so with one array per chunk no two
processes ever touch the same object: no shared ``zarr.json`` to create first, no read-modify-write of a
shared zarr chunk or shard, nothing to coordinate. A full-shape array would need a regular chunk grid
aligned with every writer's row boundaries; the MoC planner's uneven row ranges (adaptive sharding)
leave only their gcd, down to one row per zarr chunk. It would also show never-written rows (the
experts a partial checkpoint skipped) as fill values indistinguishable from data. Here what exists is
what was written, and DCP's metadata says how chunks tile each tensor, which resharded loads use.

A checkpoint exists only once ``.metadata`` does: the coordinator writes it in ``finish``, after every
rank's ``write_data`` has committed (TensorStore acknowledges a write once it is durable; the file
driver fsyncs the file and its directory), and removes a stale one before any rank writes.

Integrity: every zarr chunk ends with its CRC32C (zarr's ``crc32c`` codec, checked by TensorStore on every
read), a missing zarr chunk is an error rather than fill values, each non-tensor value's CRC32C is in
``.metadata``, and ``.metadata`` carries its own. Damage of any kind raises :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import tensorstore as ts
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from moc_lightning.storage.inflight import in_flight, settle
from moc_lightning.storage.integrity import (
    METADATA_NAME,
    CorruptCheckpointError,
    checksum,
    commit_piece,
    load_metadata,
    metadata_bytes,
    verified,
)
from moc_lightning.storage.location import kvstore_spec, kvstore_url, open_kvstore, s3_errors_named
from moc_lightning.storage.zarr_arrays import from_numpy, open_array, open_new_array, region, to_numpy

BLOBS_PREFIX = ".bytes/"
IN_FLIGHT_BYTES = 512 << 20
"""Tensor bytes a writer or reader keeps in flight: enough to overlap I/O across arrays, bounded so a
save does not hold a second copy of a rank's whole share (TensorStore copies what it is asked to write)."""

CORRUPTION_STATUSES = frozenset({"DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE"})
"""TensorStore status codes of reads that stored bytes failed: a checksum mismatch, a missing chunk or array,
a truncated chunk, an array smaller than the metadata says. Others (``UNAVAILABLE``, ...) are not damage."""

OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")
"""How TensorStore tags an error the operating system reported (``No space left on device``: code 28)."""

T = TypeVar("T")


@dataclass(frozen=True)
class ArrayRef:
    """Where a tensor chunk is stored: the key of its zarr array."""

    key: str


@dataclass(frozen=True)
class BlobRef:
    """Where a non-tensor value is stored: a byte range of a blob object, and the CRC32C of that range."""

    key: str
    offset: int
    length: int
    crc32c: int


def array_key(index: MetadataIndex) -> str:
    """The array key of a chunk; the FQN is percent-quoted so any ``/`` in it cannot nest keys."""
    offsets = ".".join(str(o) for o in index.offset or ())
    return f"{quote(index.fqn, safe='')}/@{offsets}"


@contextlib.contextmanager
def os_errors_raised() -> Iterator[None]:
    """Re-raise a TensorStore error the operating system caused (ENOSPC, EIO, EACCES) as ``OSError`` with its errno.

    The filesystem backend raises those as ``OSError`` already; callers then tell a full disk from a bug
    the same way under both backends.
    """
    try:
        yield
    except ValueError as err:
        found = OS_ERROR_CODE.search(str(err))
        if found is None:
            raise
        raise OSError(int(found[1]), str(err)) from err


def _completed(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def _tensor_data(item: WriteItem) -> TensorWriteData:
    """The chunk a tensor item writes: DCP leaves ``tensor_data`` unset only on a ``BYTE_IO`` item."""
    if item.tensor_data is None:
        raise ValueError(f"{item.index}: a {item.type.name} write item without tensor_data (its chunk and dtype)")
    return item.tensor_data


class CheckpointLocation:
    """The kvstore prefix of one checkpoint, which DCP may move by passing a ``checkpoint_id``; ``endpoint``
    (``checkpoint.storage.endpoint``) goes with it, so that an ``s3://`` id reaches the same S3-compatible store."""

    def __init__(self, kvstore: ts.KvStore, context: ts.Context, endpoint: str = "") -> None:
        self.kvstore = kvstore
        self.context = context
        self.endpoint = endpoint

    @property
    def url(self) -> str:
        """Where the checkpoint is, as a URL (:func:`~moc_lightning.storage.location.kvstore_url`)."""
        return kvstore_url(self.kvstore)

    def errors_named(self, what: str) -> contextlib.AbstractContextManager[None]:
        """An error of the store the operator must act on (refused credentials, retries exhausted) as one error
        naming the options, this checkpoint and ``what`` (:func:`~moc_lightning.storage.location.s3_errors_named`)."""
        return s3_errors_named(f"checkpoint {self.url}", self.endpoint, what)

    def move_to(self, checkpoint_id: str | os.PathLike | None) -> None:
        """Follow a ``checkpoint_id`` (a path or kvstore URL) given to ``dcp.save``/``dcp.load``, if any."""
        if checkpoint_id:
            self.kvstore = open_kvstore(str(checkpoint_id), self.context, self.endpoint)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether TensorStore understands ``checkpoint_id`` as a location (DCP's automatic backend choice)."""
        try:
            ts.KvStore.Spec(kvstore_spec(str(checkpoint_id)))
        except ValueError:
            return False
        return True


class TensorStoreWriter(CheckpointLocation, StorageWriter):
    """Writes one DCP checkpoint into ``kvstore`` (the checkpoint's own prefix)."""

    def __init__(self, kvstore: ts.KvStore, context: ts.Context, endpoint: str = "") -> None:
        super().__init__(kvstore, context, endpoint)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save."""
        self.move_to(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the coordinator's extra work happens in the global plan and ``finish``."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Retire a stale ``.metadata`` before any rank writes, and name each plan's blob by its index.

        A failed earlier attempt at this location may have left ``.metadata`` behind; arrays rewritten
        under it would make it describe a mix of old and new bytes.
        """
        with self.errors_named(f"the deletion of a stale {METADATA_NAME}"):
            self.kvstore.delete_range(ts.KvStore.KeyRange(METADATA_NAME, METADATA_NAME + "\x00")).result()
        return [dataclasses.replace(plan, storage_data=f"{BLOBS_PREFIX}{i}") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every chunk of ``plan`` as its own array and its non-tensor values as one blob; return when durable."""
        with os_errors_raised(), self.errors_named("a write of this rank's arrays or values"):
            return _completed(self._write_arrays(plan, planner) + self._write_values(plan, planner))

    def _write_arrays(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Array creations (metadata only) all start at once; data writes are windowed by ``in_flight``."""
        tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        creations = [self._create_array(item) for item in tensor_items]
        started = (self._write_operation(item, store, planner) for item, store in zip(tensor_items, creations))
        results = []
        try:
            with contextlib.closing(in_flight(started, IN_FLIGHT_BYTES)) as writes:
                for result, write in writes:
                    write.result()
                    results.append(result)
        except BaseException:
            settle(creations)
            raise
        return results

    def _create_array(self, item: WriteItem) -> ts.Future:
        tensor = _tensor_data(item)
        return open_new_array(self.kvstore, array_key(item.index), tuple(tensor.chunk.sizes), tensor.properties.dtype)

    def _write_operation(
        self, item: WriteItem, store: ts.Future, planner: SavePlanner
    ) -> tuple[int, Callable[[], tuple[WriteResult, ts.WriteFutures]]]:
        """The bytes of ``item`` and how to start writing it (``resolve_data`` waits until then: it may copy)."""
        tensor = _tensor_data(item)
        nbytes = math.prod(tensor.chunk.sizes) * tensor.properties.dtype.itemsize
        return nbytes, functools.partial(self._start_write, item, store, planner)

    def _start_write(
        self, item: WriteItem, store: ts.Future, planner: SavePlanner
    ) -> tuple[WriteResult, ts.WriteFutures]:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"{item.index}: the planner resolved a tensor item to {type(data).__name__}, not a tensor")
        array = to_numpy(data)
        sizes = tuple(_tensor_data(item).chunk.sizes)
        if array.shape != sizes:
            raise ValueError(
                f"{item.index}: the planner resolved data of shape {array.shape} for a chunk of sizes {sizes}"
            )
        result = WriteResult(item.index, array.nbytes, ArrayRef(array_key(item.index)))
        return result, store.result().write(array)

    def _write_values(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """The non-tensor values of ``plan`` concatenated into one blob: one object per rank, however many values."""
        blob = io.BytesIO()
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = planner.resolve_data(item)
                if not isinstance(value, io.BytesIO):
                    raise ValueError(f"{item.index}: the planner resolved a value to {type(value).__name__}, not bytes")
                data = value.getvalue()
                ref = BlobRef(plan.storage_data, blob.tell(), len(data), checksum(data))
                results.append(WriteResult(item.index, len(data), ref))
                blob.write(data)
        if results:
            self.kvstore.write(plan.storage_data, blob.getvalue()).result()
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish the checkpoint: ``.metadata`` (with where every item went, sealed) is the last object written."""
        with os_errors_raised(), self.errors_named(f"the write of {METADATA_NAME}"):
            self.kvstore.write(METADATA_NAME, metadata_bytes(metadata, results, self.storage_meta())).result()


class TensorStoreReader(CheckpointLocation, StorageReader):
    """Reads a checkpoint written by ``TensorStoreWriter``, under any world size (resharding)."""

    def __init__(self, kvstore: ts.KvStore, context: ts.Context, endpoint: str = "") -> None:
        super().__init__(kvstore, context, endpoint)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, ArrayRef | BlobRef] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load."""
        self.move_to(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's DCP metadata; a checkpoint without it was never finished and is refused."""
        with self.errors_named(f"the read of {METADATA_NAME}"):
            data = self._read_object(METADATA_NAME)
        return load_metadata(self.url, data, self.load_id)

    def _read_object(self, key: str) -> bytes | None:
        """The bytes of object ``key``; ``None`` if it does not exist."""
        found = self.kvstore.read(key).result()
        return found.value if found.state == "value" else None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read exactly each requested box (``storage_offsets`` + ``lengths`` within a stored chunk) into place.

        Arrays open all at once (metadata only); data reads are windowed by ``in_flight``.
        """
        tensor_reads = [item for item in plan.items if item.type == LoadItemType.TENSOR]
        keys = {self.storage_data[item.storage_index].key for item in tensor_reads}
        with self._damage_reported(), self.errors_named("a read of its arrays"):
            stores = {key: open_array(self.kvstore, key) for key in keys}
            started = (self._read_operation(item, stores) for item in tensor_reads)
            for item, read in in_flight(started, IN_FLIGHT_BYTES):  # reads change nothing: no need to settle
                what = f"array {self.storage_data[item.storage_index].key}"
                commit_piece(planner, item, from_numpy(read.result()), self.url, what)
        with self.errors_named("a read of its values"):
            self._read_values([item for item in plan.items if item.type == LoadItemType.BYTE_IO], planner)
        return _completed(None)

    @contextlib.contextmanager
    def _damage_reported(self) -> Iterator[None]:
        """Turn TensorStore's errors about damaged stored bytes into :class:`CorruptCheckpointError`."""
        try:
            yield
        except ValueError as err:
            message = str(err).split(" [tensorstore_spec=", 1)[0]  # drop the spec TensorStore appends
            if message.split(":", 1)[0] not in CORRUPTION_STATUSES:
                raise
            raise CorruptCheckpointError(self.url, message) from err

    def _read_operation(
        self, item: ReadItem, stores: dict[str, ts.Future]
    ) -> tuple[int, Callable[[], tuple[ReadItem, ts.Future]]]:
        """The bytes of the box ``item`` asks for and how to start reading it."""
        box = stores[self.storage_data[item.storage_index].key].result()[region(item.storage_offsets, item.lengths)]
        return math.prod(item.lengths) * box.dtype.numpy_dtype.itemsize, lambda: (item, box.read())

    def _read_values(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Hand each non-tensor value its verified bytes, reading each blob once."""
        blobs: dict[str, bytes] = {}
        for item in items:
            ref = self.storage_data[item.storage_index]
            assert isinstance(ref, BlobRef)  # a value's storage data, as _write_values recorded it
            if ref.key not in blobs:
                blobs[ref.key] = self._read_blob(ref.key)
            what = f"value {item.storage_index.fqn!r} (bytes {ref.offset}..{ref.offset + ref.length} of {ref.key})"
            data = blobs[ref.key][ref.offset : ref.offset + ref.length]
            planner.load_bytes(item, io.BytesIO(verified(self.url, what, data, ref.length, ref.crc32c)))

    def _read_blob(self, key: str) -> bytes:
        data = self._read_object(key)
        if data is None:
            raise CorruptCheckpointError(self.url, f"blob {key} is missing")
        return data

