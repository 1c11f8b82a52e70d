"""The ``filesystem`` backend: DCP checkpoints under a local (or mounted) directory, items stored raw.

Layout: ``<root>/<checkpoint name>/`` holds one data file per rank (DCP's names, ``__<rank>_0.distcp``) and
DCP's ``.metadata``; control objects are files under ``<root>`` written by ``LocalObjects``.

Items are stored as their raw bytes, one after another, and ``.metadata`` (sealed with its own CRC32C)
records for each its offset, length, CRC32C, dtype and shape. DCP's own ``FileSystemWriter`` ``torch.save``s every item instead (a zip
archive each): measured on a 39 MB persist of 116 items, that framing cost ~30 ms of Python per persist and
took the persist from 0.72 to 0.45-0.50 GB/s while training ran (``docs/bench.md``). The reader checks each
item's length and CRC32C before it becomes a tensor.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moc_lightning.storage.integrity import (
    METADATA_NAME,
    CorruptCheckpointError,
    checksum,
    commit_piece,
    load_metadata,
    metadata_bytes,
    verified,
)
from moc_lightning.storage.location import open_local_dir
from moc_lightning.storage.objects import LocalObjects, fsync_dir, make_dirs_durable


@dataclass
class ChecksummedStorageInfo(_StorageInfo):
    """DCP's location of an item (file, offset, length) plus the CRC32C of those bytes and, for a tensor,
    the dtype and shape that make the raw bytes a tensor again (``dtype`` is empty for a bytes item)."""

    crc32c: int = dataclasses.field(kw_only=True)
    dtype: str = dataclasses.field(kw_only=True, default="")
    shape: tuple[int, ...] = dataclasses.field(kw_only=True, default=())


class DurableFileSystemWriter(FileSystemWriter):
    """DCP's writer, made safe to crash in, checksummed, and writing raw item bytes (DESIGN.md, hard part 5).

    - A stale ``.metadata`` (left by a failed earlier save to this location) is removed, durably, before
      any rank writes: otherwise it would describe data files that this save is rewriting.
    - Each rank writes its items' bytes to one file, records each item's CRC32C, and fsyncs the file.
    - ``.metadata`` is sealed with its own CRC32C (:func:`metadata_bytes`), written to a temporary file,
      fsynced and renamed into place: it appears whole or not at all.
    - DCP fsyncs ``.metadata`` but not the directory that names the files, so after a crash the files could
      be lost although their bytes were synced. The coordinator's ``finish`` runs after every rank's
      ``write_data`` has returned, so one directory fsync there makes the whole checkpoint durable before the
      manifest can point at it.
    """

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        try:
            Path(self.path, METADATA_NAME).unlink()
        except FileNotFoundError:
            pass  # the usual case: a fresh directory
        else:
            fsync_dir(Path(self.path))
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        relative_path = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, offset = [], 0
        with open(Path(self.path, relative_path), "wb") as file:
            for item in plan.items:
                data, dtype, shape = _raw(planner.resolve_data(item))
                file.write(data)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only on 3.12+
                info = ChecksummedStorageInfo(
                    relative_path, offset, len(data), crc32c=checksum(data), dtype=dtype, shape=shape
                )
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=info))
                offset += len(data)
            file.flush()
            os.fsync(file.fileno())
        written: Future[list[WriteResult]] = Future()
        written.set_result(results)
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        directory = Path(self.path)
        tmp = directory / f"{METADATA_NAME}.tmp"
        with open(tmp, "wb") as file:
            file.write(metadata_bytes(metadata, results, self.storage_meta()))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, directory / METADATA_NAME)
        fsync_dir(directory)


def _raw(data: torch.Tensor | io.BytesIO) -> tuple[bytes | np.ndarray, str, tuple[int, ...]]:
    """An item's bytes, and for a tensor its dtype (``torch.float32``) and shape.

    A tensor's bytes are its own memory (a ``uint8`` array over it, which the file and the checksum both take),
    not a copy: a persist from a snapshot slot writes straight from shared memory, one from the live tensors
    straight from them, and neither grows the process by a tensor (issue 12, measured by
    ``recipes/memory_report.py``: a ``bytes`` copy per item grew a GPT-125M-8E persist by 150-310 MB).
    """
    if isinstance(data, io.BytesIO):
        return data.getvalue(), "", ()
    tensor = data.detach().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy(), str(tensor.dtype), tuple(tensor.shape)


class VerifyingFileSystemReader(FileSystemReader):
    """Reads the raw items of :class:`DurableFileSystemWriter`; any damage raises :class:`CorruptCheckpointError`.

    Each item's bytes are read whole and checked against their length and CRC32C before they become a tensor,
    so a damaged item never reaches the planner.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # FileSystemReader's signature
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        return load_metadata(str(self.path), data, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file = defaultdict(list)
        for request in plan.items:
            by_file[self.storage_data[request.storage_index].relative_path].append(request)
        for relative_path, requests in by_file.items():
            try:
                file = open(Path(self.path, relative_path), "rb")
            except FileNotFoundError as err:
                raise CorruptCheckpointError(str(self.path), f"data file {relative_path} is missing") from err
            with file:
                for request in requests:
                    info = self.storage_data[request.storage_index]
                    data = self._item_bytes(file, info)
                    if request.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(request, io.BytesIO(data))
                        continue
                    piece = narrow_tensor_by_index(_tensor(data, info), request.storage_offsets, request.lengths)
                    what = f"item {request.storage_index.fqn} in {relative_path}"
                    commit_piece(planner, request, piece, str(self.path), what)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _item_bytes(self, file: IO[bytes], info: _StorageInfo) -> bytes:
        """The verified bytes of one item."""
        what = f"item at bytes {info.offset}..{info.offset + info.length} of {info.relative_path}"
        if not isinstance(info, ChecksummedStorageInfo):
            raise CorruptCheckpointError(str(self.path), f"{what} has no checksum (written without one)")
        file.seek(info.offset)
        return verified(str(self.path), what, file.read(info.length), info.length, info.crc32c)


def _tensor(data: bytes, info: ChecksummedStorageInfo) -> torch.Tensor:
    """The stored tensor, viewing ``data`` (read-only: only ever copied from)."""
    dtype = getattr(torch, info.dtype.removeprefix("torch."))
    if not data:
        return torch.empty(info.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": nothing writes to it
        return torch.frombuffer(data, dtype=dtype).view(info.shape)


class FilesystemStorage(LocalObjects):
    """Checkpoints as DCP directories under a local root given as a plain path or ``file://`` URL."""

    def __init__(self, url: str) -> None:
        super().__init__(open_local_dir(url))
        self.url = self.root.as_uri()

    def writer(self, name: str) -> DurableFileSystemWriter:
        """A DCP writer for ``<root>/<name>``; the directory is created durably here, data files are fsynced."""
        make_dirs_durable(self.root / name)
        return DurableFileSystemWriter(self.root / name, sync_files=True)

    def reader(self, name: str) -> VerifyingFileSystemReader:
        """A DCP reader for ``<root>/<name>`` that verifies every item it reads."""
        return VerifyingFileSystemReader(self.root / name)
