"""The speed of light of a restore from storage: sequential read bandwidth of the checkpoint storage's directory,
and the read a restore from a local storage object does (:func:`read_through`).

The page cache decides what such a read measures. A file just written sits in it, and a read it serves measures
memory, not storage. Without root the whole cache cannot be dropped (``/proc/sys/vm/drop_caches``), but a file's
own pages can be: once ``fsync`` has made them clean, ``posix_fadvise(POSIX_FADV_DONTNEED)`` asks the kernel to
drop them, and Linux does so for clean pages that nothing maps. :func:`read_gbps` evicts its file that way before
timing the read, and the benchmark evicts the replay windows' storage objects the same way (:func:`evict`) before
the recovery that reads them, so the bound and the recovery start from the same cache state.

What this cannot promise: a filesystem that ignores the advice (tmpfs, whose page cache *is* the storage; some
network filesystems) serves both reads from memory, and a device's own cache may serve either; the two reads then
still see the same state, and the bound is as fast as the recovery's read could be.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moc_lightning.storage.sealed import checksum_view

GB = 1e9
CHUNK = 64 << 20
"""Bytes per read call."""


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (flushed first, so they are clean), where the OS supports it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: Path, chunk: int = CHUNK, crc: bool = False) -> tuple[int, int | None]:
    """Read ``path`` sequentially, one large read at a time, leaving its pages in the page cache; returns the bytes
    read and, with ``crc``, their CRC32C (:func:`~moc_lightning.storage.sealed.checksum_view` of each chunk).

    A restore from a mapped storage object reads it so first: one large read at a time, as the bound
    :func:`read_gbps` does (without a checksum), rather than a page fault per page while its tensors are copied
    out; the checksum is what lets it trust bytes a device held."""
    read, digest = 0, 0 if crc else None
    with path.open("rb", buffering=0) as f:
        buffer = bytearray(max(1, min(chunk, os.fstat(f.fileno()).st_size)))
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            read += n
            if digest is not None:
                digest = checksum_view(view[:n], digest)
    return read, digest


def read_gbps(path: Path, nbytes: int, chunk: int = CHUNK) -> float:
    """Sequential read bandwidth of a fresh ``nbytes`` file at ``path`` (written, flushed and evicted first, then
    read into one reused buffer; removed afterwards): the bound of reading a checkpoint of that size back."""
    if nbytes < 1:
        raise ValueError(f"a read's speed of light needs at least one byte, got nbytes={nbytes}")
    block = os.urandom(min(chunk, nbytes))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("wb") as f:
            remaining = nbytes
            while remaining > 0:
                remaining -= f.write(block[: min(remaining, len(block))])
        evict(path)
        start = time.perf_counter()
        read, _ = read_through(path, len(block))
        seconds = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return read / seconds / GB
