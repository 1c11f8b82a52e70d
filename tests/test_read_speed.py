"""The speed of light of a restore from storage (:mod:`moc_lightning.storage.read_speed`): a sequential read of a fresh file,
its pages evicted from the page cache first, as the benchmark evicts the replay windows' objects."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from moc_lightning.storage.read_speed import evict, read_gbps, read_through
from moc_lightning.storage.sealed import CHECKSUM_SLICE, checksum, checksum_view


def test_the_read_bound_reads_a_fresh_file_of_the_size_and_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "speed_of_light.bin"
    gbps = read_gbps(path, 3_000_000 + 7, chunk=1 << 20)  # several chunks and a partial one
    print(f"sequential read of 3 MB in {tmp_path}: {gbps:.3f} GB/s")
    assert gbps > 0 and not path.exists()
    with pytest.raises(ValueError, match="needs at least one byte, got nbytes=0"):
        read_gbps(path, 0)


def test_evicting_a_file_from_the_page_cache_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "window.pt"
    path.write_bytes(bytes(range(256)) * 1000)
    evict(path)
    assert path.read_bytes() == bytes(range(256)) * 1000


def test_reading_a_file_through_reads_every_byte_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "window.pt"
    data = bytes(range(256)) * 9766 + b"x"  # 2,500,097 bytes: the last chunk is short
    path.write_bytes(data)
    assert read_through(path, chunk=1 << 20) == (len(data), None)
    assert read_through(path, chunk=1 << 20, crc=True) == (len(data), checksum(data)), "the CRC32C of every chunk"


@pytest.mark.parametrize("size", [0, 1, CHECKSUM_SLICE - 1, CHECKSUM_SLICE, 3 * CHECKSUM_SLICE + 5])
def test_a_buffer_checksummed_a_slice_at_a_time_has_the_crc32c_of_its_bytes(tmp_path: Path, size: int) -> None:
    """:func:`checksum_view` takes what ``checksum`` does not (a mapping, a memoryview of a reused buffer), in slices
    that need not divide it, continuing a CRC32C begun elsewhere."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "window"
    path.write_bytes(data)
    assert checksum_view(bytearray(data)) == checksum(data)
    assert checksum_view(memoryview(b"head" + data)[4:], checksum(b"before")) == checksum(data, checksum(b"before"))
    if size:
        with path.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapping:
            assert checksum_view(mapping) == checksum(data)
