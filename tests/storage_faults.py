"""Storage that fails on purpose, for tests: a wrapper that injects I/O errors, a real file system that fills up,
and damage done to a stored file."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.storage import CheckpointStorage


def os_error(code: int, name: str) -> OSError:
    """The ``OSError`` the operating system would raise with ``code`` (``errno.ENOSPC``, ...) for ``name``."""
    return OSError(code, os.strerror(code), name)


def takes_direct_io(directory: Path) -> bool:
    """Whether files under ``directory`` can be opened for direct I/O (Linux; tmpfs before 6.6 refuses it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-io-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


class FaultyStorage:
    """``inner``, except that chosen DCP writes and control-object puts fail with an ``OSError``.

    ``fail_writes`` and ``fail_puts`` map the ordinal of a call (1 for the first ``write_data`` or ``put``, of
    bytes or of a file, made through this storage) to the errno it fails with. A failing ``write_data`` fails midway, as a disk
    that fills up during a save: the inner writer writes every item of its plan but the last, and the last
    raises. A failing ``put`` raises before the inner put, which is atomic, so the old object stays.
    """

    def __init__(
        self,
        inner: CheckpointStorage,
        fail_writes: Mapping[int, int] | None = None,
        fail_puts: Mapping[int, int] | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_writes = dict(fail_writes or {})
        self.fail_puts = dict(fail_puts or {})
        self.writes = 0
        self.puts = 0

    def writer(self, name: str) -> StorageWriter:
        """The inner writer for ``name``, whose ``write_data`` fails when its ordinal is in ``fail_writes``."""
        writer = self.inner.writer(name)
        write_data = writer.write_data

        def counted_write_data(plan: SavePlan, planner: SavePlanner) -> Any:
            self.writes += 1
            code = self.fail_writes.get(self.writes)
            return write_data(plan, planner if code is None else FailingPlanner(planner, len(plan.items), code, name))

        writer.write_data = counted_write_data  # type: ignore[method-assign]
        return writer

    def reader(self, name: str) -> StorageReader:
        return self.inner.reader(name)

    def put(self, name: str, data: bytes) -> None:
        self._count_put(name)
        self.inner.put(name, data)

    def put_file(self, name: str, source: Path) -> int:
        self._count_put(name)
        return self.inner.put_file(name, source)

    def _count_put(self, name: str) -> None:
        """Count a put (of bytes or of a file); raise where ``fail_puts`` says this one fails."""
        self.puts += 1
        code = self.fail_puts.get(self.puts)
        if code is not None:
            raise os_error(code, name)

    def get(self, name: str) -> bytes | None:
        return self.inner.get(name)

    def local_file(self, name: str) -> Path | None:
        return self.inner.local_file(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)


class FailingPlanner:
    """A save planner that hands the writer its first ``items - 1`` items, then fails resolving the last.

    Failing inside ``resolve_data`` lets the real writer put partial bytes on storage first, whichever
    order it writes items in.
    """

    def __init__(self, planner: SavePlanner, items: int, code: int, name: str) -> None:
        self.planner = planner
        self.items = items
        self.code = code
        self.name = name
        self.resolved = 0

    def resolve_data(self, item: WriteItem) -> Any:
        self.resolved += 1
        if self.resolved == self.items:
            raise os_error(self.code, f"{self.name}/{item.index.fqn}")
        return self.planner.resolve_data(item)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.planner, attribute)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the duration: writes past it fail with ``ENOSPC``.

    Mounting needs root (or ``CAP_SYS_ADMIN``); where it fails, this raises ``PermissionError`` naming why,
    for the caller to skip on.
    """
    path.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    mount = subprocess.run(command, capture_output=True, text=True)
    if mount.returncode != 0:
        reason = mount.stderr.strip() or f"exit status {mount.returncode}"
        raise PermissionError(errno.EPERM, f"cannot mount a {size} tmpfs: {reason}", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: files still mapped keep it alive


def flip_middle_byte(path: Path) -> None:
    """Flip one bit in the middle of ``path``."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate_to_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES: dict[str, Callable[[Path], None]] = {
    "flip": flip_middle_byte,
    "truncate": truncate_to_half,
    "delete": Path.unlink,
}
"""Damage a stored file can suffer, by name (test ids)."""


def flip_byte_of(path: Path, needle: bytes, at: int = 0) -> None:
    """Flip the lowest bit of byte ``at`` of the first ``needle`` in ``path``: damage a parser cannot see.

    Flipping a letter or digit of a key or a number gives another letter or digit (``expert/L1/E4`` becomes
    ``dxpert/L1/E4``, ``"step": 4`` becomes ``"step": 5``), so the pickle or JSON stays valid and says
    something else; only a checksum can tell.
    """
    data = bytearray(path.read_bytes())
    where = data.find(needle)
    if where < 0:
        raise ValueError(f"{needle!r} is not in {path}")
    data[where + at] ^= 0x01
    path.write_bytes(bytes(data))


def fail_first_commit(pec: PECCheckpointer) -> None:
    """Make ``pec``'s first persist fail at its first commit point, before anything is committed (a rank
    killed there): the persist fails alike on every rank and the next one tries again."""
    failed: list[str] = []

    def hook(point: str) -> None:
        if not failed:
            failed.append(point)
            raise OSError(f"injected at {point}")

    pec.persister.committer.fault_hook = hook
