"""Where persisted checkpoints live, behind one small protocol.

A checkpoint is a named directory-like location under the storage root (``step_00000120``) holding a DCP
checkpoint. Tensor bytes go through DCP's ``StorageWriter``/``StorageReader`` of the backend; small
control files (the manifest, each checkpoint's ``moc.json``) go through ``put``/``get``, which are atomic:
a reader sees the old bytes or the new ones, never a torn file.

Backends: ``filesystem`` (DCP's own file writer) and ``tensorstore`` (zarr v3 arrays via TensorStore).
Both checksum every stored item and raise :class:`CorruptCheckpointError` when a read finds damage; DCP
re-raises it wrapped, on every rank, and :func:`corrupt_from` finds it again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from torch.distributed.checkpoint import StorageReader, StorageWriter

from moc_lightning.storage.filesystem import FilesystemStorage
from moc_lightning.storage.integrity import CorruptCheckpointError, corrupt_from, find_cause
from moc_lightning.storage.location import S3RetryConfig
from moc_lightning.storage.tensorstore import TensorStoreStorage


class CheckpointStorage(Protocol):
    """The control-object operations MoC needs from a storage backend, plus the DCP writer/reader pair."""

    url: str
    """Root location, e.g. ``file:///scratch/run/ckpt``."""

    def writer(self, name: str) -> StorageWriter:
        """A DCP writer for checkpoint ``name`` (a fresh, not yet visible location).

        The checkpoint is complete, durable and readable once DCP's save returns on the coordinator; a
        location reused after a failed attempt is overwritten, so it must not be referenced by a manifest.
        """
        ...

    def reader(self, name: str) -> StorageReader:
        """A DCP reader for checkpoint ``name``; it refuses a checkpoint whose save never finished.

        Any damage it finds (an item failing its checksum, a truncated or missing object, unreadable
        ``.metadata``) raises :class:`CorruptCheckpointError` before damaged bytes reach the planner.
        """
        ...

    def put(self, name: str, data: bytes) -> None:
        """Atomically write a small control object (``manifest.json``, ``step_X/moc.json``), durable on return."""
        ...

    def put_file(self, name: str, source: Path) -> int:
        """:meth:`put` of the bytes of local file ``source`` (a replay window), copied a chunk at a time where the
        root is a local directory rather than read whole; returns the CRC32C of the bytes stored, computed as they
        were copied."""
        ...

    def get(self, name: str) -> bytes | None:
        """Read a control object; ``None`` if it does not exist."""
        ...

    def local_file(self, name: str) -> Path | None:
        """The local file that holds control object ``name`` (which may not exist), for a reader that maps it rather
        than reading it whole (a replay window); ``None`` where objects are not local files (a remote kvstore)."""
        ...

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name`` and everything under it; a missing one is not an error."""
        ...


__all__ = ["BACKENDS", "CheckpointStorage", "CorruptCheckpointError", "corrupt_from", "find_cause", "make_storage"]


def make_storage(
    backend: str, url: str, endpoint: str = "", retries: S3RetryConfig | None = None
) -> CheckpointStorage:
    """The storage named by ``checkpoint.storage.backend`` at ``checkpoint.storage.url``; ``endpoint``:
    ``checkpoint.storage.endpoint``, an S3-compatible store's (``tensorstore`` with an ``s3://`` URL only);
    ``retries``: ``checkpoint.storage.retries``, how S3 requests are retried (``tensorstore`` only; default bounds
    when ``None``).

    The root is opened (and created, when local) here, so a bad option fails before training starts.
    """
    if backend not in BACKENDS:
        raise ValueError(f"checkpoint.storage.backend={backend!r} is not allowed; choose one of: {', '.join(BACKENDS)}")
    if backend == "tensorstore":
        return TensorStoreStorage(url, endpoint, retries)
    if not endpoint:
        return BACKENDS[backend](url)
    raise ValueError(
        f"checkpoint.storage.endpoint={endpoint!r} needs checkpoint.storage.backend=tensorstore (the backend that "
        f"writes to s3:// URLs), not {backend!r}"
    )


BACKENDS: dict[str, Callable[[str], CheckpointStorage]] = {
    "filesystem": FilesystemStorage,
    "tensorstore": TensorStoreStorage,
}
