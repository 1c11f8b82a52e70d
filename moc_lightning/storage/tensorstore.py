"""The ``tensorstore`` backend: every tensor chunk a zarr v3 array on any TensorStore kvstore.

The root URL is a plain path or ``file://`` URL, or any kvstore URL TensorStore knows (``gs://bucket/path``,
``s3://bucket/path``, the latter tested against a live S3-protocol server; credentials come from the environment, as
TensorStore reads them, and an S3-compatible store's endpoint from ``checkpoint.storage.endpoint`` or the environment:
:mod:`~moc_lightning.storage.location`). Checkpoint ``name`` lives under ``<root>/<name>/`` (layout in ``zarr_dcp``).
Control objects go through the same atomic contract as the filesystem backend: on a local root the very same
``LocalObjects`` (so ``delete`` removes directories too), elsewhere single-key kvstore writes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import tensorstore as ts

from moc_lightning.storage.location import (
    S3RetryConfig,
    apply_stall_timeout,
    local_path,
    open_kvstore,
    open_local_dir,
    s3_errors_named,
)
from moc_lightning.storage.objects import KvObjects, LocalObjects
from moc_lightning.storage.zarr_dcp import TensorStoreReader, TensorStoreWriter


class TensorStoreStorage:
    """Checkpoints as zarr v3 arrays plus DCP metadata under a kvstore root."""

    def __init__(self, url: str, endpoint: str = "", retries: S3RetryConfig | None = None) -> None:
        local_root = open_local_dir(url) if local_path(url) is not None else None
        self.url = local_root.as_uri() if local_root is not None else url
        # One context for the root and every array: shared I/O pools, the S3 retry bounds, and for memory:// one
        # shared store.
        retries = retries or S3RetryConfig()
        if local_root is None:
            apply_stall_timeout(retries)
        self.context = ts.Context(retries.context_spec())
        self.endpoint = endpoint
        self.kvstore = open_kvstore(self.url, self.context, endpoint)
        self.objects = LocalObjects(local_root) if local_root is not None else KvObjects(self.kvstore)

    def writer(self, name: str) -> TensorStoreWriter:
        """A DCP writer for checkpoint ``name``."""
        return TensorStoreWriter(self.kvstore / f"{name}/", self.context, self.endpoint)

    def reader(self, name: str) -> TensorStoreReader:
        """A DCP reader for checkpoint ``name``."""
        return TensorStoreReader(self.kvstore / f"{name}/", self.context, self.endpoint)

    def put(self, name: str, data: bytes) -> None:
        """Atomically write control object ``name``, durable on return."""
        with self._errors_named(f"the write of {name}"):
            self.objects.put(name, data)

    def put_file(self, name: str, source: Path) -> int:
        """Atomically write control object ``name`` with the bytes of local file ``source``, durable on return;
        returns their CRC32C."""
        with self._errors_named(f"the write of {name}"):
            return self.objects.put_file(name, source)

    def get(self, name: str) -> bytes | None:
        """Read control object ``name``; ``None`` if missing."""
        with self._errors_named(f"the read of {name}"):
            return self.objects.get(name)

    def local_file(self, name: str) -> Path | None:
        """The local file of control object ``name`` under a local root; ``None`` on a remote kvstore."""
        return self.objects.local_file(name)

    def delete(self, name: str) -> None:
        """Remove checkpoint (or object) ``name`` and everything under it; missing is not an error."""
        with self._errors_named(f"the deletion of {name}"):
            self.objects.delete(name)

    def _errors_named(self, what: str) -> contextlib.AbstractContextManager[None]:
        """An error of the store the operator must act on (refused credentials, retries exhausted) as one error
        naming the options and ``what`` (:func:`~moc_lightning.storage.location.s3_errors_named`)."""
        return s3_errors_named(f"checkpoint.storage.url={self.url!r}", self.endpoint, what)
