"""The ``filesystem`` backend: DCP's own file writer and reader under a local (or mounted) directory.

Layout: ``<root>/<checkpoint name>/`` holds DCP's files (one per rank and ``.metadata``); control
objects are files under ``<root>`` written by ``LocalObjects``.

Integrity: the writer records the CRC32C of every item's bytes in its file beside DCP's own storage info
(offset, length), so it lands in ``.metadata``; the reader checks each item before DCP parses it.
"""

from __future__ import annotations

import dataclasses
import io
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moc_lightning.storage.integrity import (
    METADATA_NAME,
    CorruptCheckpointError,
    checksum_range,
    load_metadata,
    verified,
)
from moc_lightning.storage.location import open_local_dir
from moc_lightning.storage.objects import LocalObjects, fsync_dir, make_dirs_durable


@dataclass
class ChecksummedStorageInfo(_StorageInfo):
    """DCP's location of an item (file, offset, length) plus the CRC32C of those bytes.

    A subclass, so DCP's stock ``FileSystemReader`` still reads these checkpoints (without checking).
    """

    crc32c: int = dataclasses.field(kw_only=True)


class DurableFileSystemWriter(FileSystemWriter):
    """DCP's writer, made safe to crash in and checksummed (DESIGN.md, hard part 5).

    - A stale ``.metadata`` (left by a failed earlier save to this location) is removed, durably, before
      any rank writes: otherwise it would describe data files that this save is rewriting.
    - Every item's CRC32C is computed from its file once DCP has written and fsynced it (the bytes are
      still in the page cache): DCP serialises items itself, so the file is the only place their final
      bytes exist whole.
    - DCP fsyncs every data file and ``.metadata`` but not the directory that names them, so after a
      crash the files could be lost although their bytes were synced. The coordinator's ``finish`` runs
      after every rank's ``write_data`` has returned, so one directory fsync there makes the whole
      checkpoint durable before the manifest can point at it.
    """

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        Path(self.path, METADATA_NAME).unlink(missing_ok=True)
        fsync_dir(Path(self.path))
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        checksummed: Future[list[WriteResult]] = Future()
        checksummed.set_result(self._checksummed(results))
        return checksummed

    def _checksummed(self, results: list[WriteResult]) -> list[WriteResult]:
        """``results`` with each storage info carrying the CRC32C of its bytes; each file is opened once."""
        by_file: dict[str, list[WriteResult]] = defaultdict(list)
        for result in results:
            by_file[result.storage_data.relative_path].append(result)
        checksummed = []
        for relative_path, written in by_file.items():
            with open(Path(self.path, relative_path), "rb") as file:
                checksummed += [_with_checksum(result, file) for result in written]
        return checksummed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        fsync_dir(Path(self.path))


def _with_checksum(result: WriteResult, file: IO[bytes]) -> WriteResult:
    info: _StorageInfo = result.storage_data
    crc = checksum_range(file, info.offset, info.length)
    return dataclasses.replace(result, storage_data=ChecksummedStorageInfo(**vars(info), crc32c=crc))


class VerifyingFileSystemReader(FileSystemReader):
    """DCP's reader, except that damage to ``.metadata`` or to any item raises :class:`CorruptCheckpointError`.

    Each item's bytes are read whole and checked against their CRC32C before DCP deserialises them, so a
    damaged item never reaches the planner (DCP's own reader streams them straight into ``torch.load``).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        return load_metadata(str(self.path), data, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except FileNotFoundError as err:
            raise CorruptCheckpointError(str(self.path), f"data file {Path(err.filename).name} is missing") from err

    def _slice_file(self, file: IO[bytes], sinfo: _StorageInfo) -> IO[bytes]:
        """The verified bytes of one item (DCP's hook for reading an item out of its data file)."""
        what = f"item at bytes {sinfo.offset}..{sinfo.offset + sinfo.length} of {sinfo.relative_path}"
        if not isinstance(sinfo, ChecksummedStorageInfo):
            raise CorruptCheckpointError(str(self.path), f"{what} has no checksum (written without one)")
        file.seek(sinfo.offset)
        return io.BytesIO(verified(str(self.path), what, file.read(sinfo.length), sinfo.length, sinfo.crc32c))


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
