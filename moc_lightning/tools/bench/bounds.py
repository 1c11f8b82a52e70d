"""The speed of light: of a snapshot, the copy of its bytes into a reused buffer; of a persist, the write-and-fsync
bandwidth of the storage directory, the faster of cached and direct (``O_DIRECT``) writes. Each is measured in trials
spread over the run, interleaved with the methods (:class:`Bounds`), and the best trial is the bound: on a shared
machine a trial can only come out slower than the hardware allows, so a single trial at the start is a bound that
a method's own figure, measured at a quieter moment, may exceed."""

from __future__ import annotations

import errno
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moc_lightning.memory.copy_speed import copy_gbps
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


@dataclass
class Bounds:
    """The speed of light of the whole state's copy and write, over every trial of the run; the best is the bound."""

    copy_trials: list[float] = field(default_factory=list)
    """GB/s of each copy of this rank's state into a reused buffer (:func:`copy_gbps`)."""
    write_trials: list[float] = field(default_factory=list)
    """GB/s of each write+fsync of a state-sized file (:func:`write_fsync_gbps`)."""

    def trial(self, tensors: list[torch.Tensor], directory: Path) -> None:
        """One more trial of each bound, on ``tensors`` (this rank's state) and a file of their size in
        ``directory``."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.copy_trials.append(round(copy_gbps(tensors), 3))
        self.write_trials.append(round(write_fsync_gbps(directory, nbytes), 3))

    @property
    def copy_gbps(self) -> float:
        return max(self.copy_trials)

    @property
    def write_fsync_gbps(self) -> float:
        return max(self.write_trials)
