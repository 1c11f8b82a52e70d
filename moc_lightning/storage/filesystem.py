"""The ``filesystem`` backend: DCP's own file writer and reader under a local (or mounted) directory.

Layout: ``<root>/<checkpoint name>/`` holds DCP's files (one per rank and ``.metadata``); control
objects are files under ``<root>`` written by ``LocalObjects``.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from moc_lightning.storage.location import open_local_dir
from moc_lightning.storage.objects import LocalObjects, fsync_dir, make_dirs_durable

METADATA_NAME = ".metadata"
"""DCP's name for the file whose presence makes a checkpoint directory a checkpoint."""


class DurableFileSystemWriter(FileSystemWriter):
    """DCP's writer, made safe to crash in (DESIGN.md, hard part 5).

    - A stale ``.metadata`` (left by a failed earlier save to this location) is removed, durably, before
      any rank writes: otherwise it would describe data files that this save is rewriting.
    - DCP fsyncs every data file and ``.metadata`` but not the directory that names them, so after a
      crash the files could be lost although their bytes were synced. The coordinator's ``finish`` runs
      after every rank's ``write_data`` has returned, so one directory fsync there makes the whole
      checkpoint durable before the manifest can point at it.
    """

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        Path(self.path, METADATA_NAME).unlink(missing_ok=True)
        fsync_dir(Path(self.path))
        return super().prepare_global_plan(plans)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        fsync_dir(Path(self.path))


class FilesystemStorage(LocalObjects):
    """Checkpoints as DCP directories under a local root given as a plain path or ``file://`` URL."""

    def __init__(self, url: str) -> None:
        super().__init__(open_local_dir(url))
        self.url = self.root.as_uri()

    def writer(self, name: str) -> DurableFileSystemWriter:
        """A DCP writer for ``<root>/<name>``; the directory is created durably here, data files are fsynced."""
        make_dirs_durable(self.root / name)
        return DurableFileSystemWriter(self.root / name, sync_files=True)

    def reader(self, name: str) -> FileSystemReader:
        """A DCP reader for ``<root>/<name>``."""
        return FileSystemReader(self.root / name)
