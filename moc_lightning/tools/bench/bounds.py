"""The speed of light of a persist: the write-and-fsync bandwidth of the storage directory, the faster of cached and
direct (``O_DIRECT``) writes."""

from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

from moc_lightning.storage.objects import DIRECT_ALIGN
from moc_lightning.tools.bench.config import GB
from moc_lightning.tools.bench.fitting import this_rank


def write_fsync_gbps(directory: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Sequential write + ``os.fsync`` bandwidth of ``directory``'s storage for ``nbytes``: a persist's bound. The
    faster of writes through the page cache and direct writes (``O_DIRECT``, where the file system takes them, as
    a replay window's storage write does: :func:`~moc_lightning.storage.objects.copy_file_direct`)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"speed_of_light.{this_rank()}.bin"  # every process measures at once, as they would persist
    size = max(DIRECT_ALIGN, min(chunk, nbytes) // DIRECT_ALIGN * DIRECT_ALIGN)
    with mmap.mmap(-1, size) as block:  # page-aligned, as a direct write needs
        block.write(os.urandom(size))
        with memoryview(block) as view:
            timings = [_timed_write(path, nbytes, view, 0)]
            direct = getattr(os, "O_DIRECT", None)
            if direct is not None:
                try:
                    timings.append(_timed_write(path, max(size, nbytes // size * size), view, direct))
                except OSError as err:
                    if err.errno != errno.EINVAL:  # the file system takes no direct I/O: the cached write it is
                        raise
    return max(written / seconds for written, seconds in timings) / GB


def _timed_write(path: Path, nbytes: int, block: memoryview, flags: int) -> tuple[int, float]:
    """Bytes written to a new ``path`` from ``block`` over and over, and the seconds until they were fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    try:
        start = time.perf_counter()
        remaining = nbytes
        while remaining > 0:
            remaining -= os.write(fd, block[: min(remaining, len(block))])
        os.fsync(fd)
        return nbytes, time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
