"""Storage backends: atomic control objects, DCP round trips, zarr v3 arrays, partial and multi-rank chunks."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import io
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from dist_utils import run_ranks
from storage_faults import takes_direct_io
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import Float16

from moc_lightning.storage import CheckpointStorage, inflight, make_storage, objects, zarr_arrays, zarr_dcp
from moc_lightning.storage.sealed import checksum

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore:Detected an existing checkpoint:UserWarning"
)

BACKENDS = ("filesystem", "tensorstore")
LOCAL_ROOTS = [("filesystem", "path"), ("filesystem", "file_url"), ("tensorstore", "path"), ("tensorstore", "file_url")]


def _url(tmp_path: Path, form: str) -> str:
    root = tmp_path / "ckpt root"  # a space, so file:// URLs and kvstore specs must not mangle it
    return root.as_uri() if form == "file_url" else str(root)


@pytest.fixture(params=[*LOCAL_ROOTS, ("tensorstore", "memory"), ("tensorstore", "s3")], ids=lambda p: "-".join(p))
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStorage:
    """Every backend on a local root, and the tensorstore backend on non-file kvstores: ``memory://``, and ``s3://``
    on a live S3-protocol server (``s3_server``)."""
    backend, form = request.param
    if form == "s3":
        bucket = request.getfixturevalue("s3_server").new_bucket()
        return make_storage(backend, f"s3://{bucket}/run 1/ckpt")
    return make_storage(backend, "memory://ckpt" if form == "memory" else _url(tmp_path, form))


def _local_files(storage: CheckpointStorage) -> set[str]:
    root = Path(unquote(urlparse(storage.url).path))
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(6, 5, generator=g),
        "w16": torch.randn(4, 3, generator=g).half(),
        "wbf16": torch.randn(7, 2, generator=g).bfloat16(),
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=g),
        "i32": torch.randint(-(2**20), 2**20, (2, 2), dtype=torch.int32, generator=g),
        "u8": torch.randint(0, 256, (9,), dtype=torch.uint8, generator=g),
        "mask": torch.rand(3, 3, generator=g) > 0.5,
        "step": torch.tensor(1234.5),
        "empty": torch.zeros(0, 4),
        "note": "lr schedule v2",
    }


def _blank(state: dict[str, object]) -> dict[str, object]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_bitwise(expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
    assert _bits(actual) == _bits(expected)


# ---------------------------------------------------------------- control objects


def test_put_get_replace_and_missing(storage: CheckpointStorage) -> None:
    assert storage.get("manifest.json") is None
    storage.put("manifest.json", b"v1")
    storage.put("manifest.json", b"version two")
    storage.put("step_00000010/moc.json", b"{}")
    assert storage.get("manifest.json") == b"version two"
    assert storage.get("step_00000010/moc.json") == b"{}"
    if storage.url.startswith("file://"):
        assert _local_files(storage) == {"manifest.json", "step_00000010/moc.json"}  # no temp or lock files


def test_a_control_object_under_a_local_root_is_a_local_file_a_put_replaces(storage: CheckpointStorage) -> None:
    """Replay windows are mapped from it (:mod:`moc_lightning.replay.window_store`): a put must give the name a new file, so
    that a mapping of the old one keeps its bytes; a remote kvstore has no such file."""
    storage.put("replay_window.rank0.0.pt", b"old")
    path = storage.local_file("replay_window.rank0.0.pt")
    if not storage.url.startswith("file://"):
        assert path is None
        return
    assert path.read_bytes() == b"old"
    with path.open("rb") as old:
        storage.put("replay_window.rank0.0.pt", b"new bytes")
        assert old.read() == b"old" and path.read_bytes() == b"new bytes"


def test_put_file_stores_a_local_file_as_an_object_replacing_it_whole(storage: CheckpointStorage, tmp_path: Path) -> None:
    """A replay window goes to storage as a copy of its file in shared memory (:mod:`moc_lightning.replay.window_store`):
    the object gets the file's bytes and, under a local root, a new file (a mapping of the old one keeps its
    bytes), with no temp file left."""
    source = tmp_path / "window in shared memory"
    source.write_bytes(os.urandom(3 << 20) + b"tail")
    storage.put("replay_window.rank0.0.pt", b"old")
    path = storage.local_file("replay_window.rank0.0.pt")
    with contextlib.ExitStack() as stack:
        old = None if path is None else stack.enter_context(path.open("rb"))
        storage.put_file("replay_window.rank0.0.pt", source)
        assert old is None or old.read() == b"old"
    assert storage.get("replay_window.rank0.0.pt") == source.read_bytes()
    if storage.url.startswith("file://"):
        assert _local_files(storage) == {"replay_window.rank0.0.pt"}


def test_put_file_returns_the_crc32c_of_the_bytes_it_stored(
    storage: CheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored replay window's head names its object's CRC32C (:mod:`moc_lightning.replay.window_store`), computed while
    the file is copied rather than in a second read of it: it is the CRC32C of the bytes read back, over several
    chunks and a short last one."""
    monkeypatch.setattr(objects, "COPY_CHUNK", 1 << 16)
    source = tmp_path / "window in shared memory"
    source.write_bytes(os.urandom((3 << 16) + 5))
    crc = storage.put_file("replay_window.rank0.0.win", source)
    stored = storage.get("replay_window.rank0.0.win")
    assert stored == source.read_bytes()
    assert crc == checksum(stored), f"returned {crc}, the bytes read back have CRC32C {checksum(stored):08x}"


def _resident_pages(path: Path) -> tuple[int, int]:
    """Pages of file ``path`` in the page cache, and all its pages (``mincore`` of a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    size = path.stat().st_size
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapping:
        base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        pages = -(-size // page)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vector), pages


def test_put_file_writes_around_the_page_cache_where_the_file_system_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay window's storage write is the storage level's whole cost on a host with few cores: through the page
    cache it allocates a page per 4 KiB and leaves writeback to kernel threads, all beside training. Where the file
    system takes direct I/O the copy goes around the cache (only the short last page through it), in several chunks,
    with the same bytes and CRC32C, and leaves no temp file. Failed on 689f391: 84 of 84 pages went through."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} takes no direct I/O (O_DIRECT): no write can go around its cache")
    monkeypatch.setattr(objects, "DIRECT_CHUNK", 1 << 16)
    source = tmp_path / "window in shared memory"
    source.write_bytes(os.urandom((5 << 16) + 4096 * 3 + 7))
    store = objects.LocalObjects(tmp_path / "root")
    crc = store.put_file("replay_window.rank0.0.win", source)
    target = store.local_file("replay_window.rank0.0.win")
    resident, pages = _resident_pages(target)  # before any read of it brings its pages in
    assert resident <= 1, f"{resident} of the {pages} pages written went through the page cache"
    assert target.read_bytes() == source.read_bytes()
    assert crc == checksum(source.read_bytes())
    assert [p.name for p in target.parent.iterdir()] == [target.name], "a temp file was left"


def test_put_file_starts_over_through_the_page_cache_when_a_direct_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may open a file for direct I/O and then refuse a write (EINVAL: a device whose blocks are larger
    than :data:`objects.DIRECT_ALIGN`). The put starts over through the cache: the object holds the source's bytes
    only, under their CRC32C. Any other error fails the put, leaving the old object."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} takes no direct I/O (O_DIRECT): no direct write to refuse")
    source = tmp_path / "window"
    source.write_bytes(os.urandom((3 << 16) + 11))
    store = objects.LocalObjects(tmp_path / "root")
    store.put("w.win", b"old")

    def refused(error: int) -> Callable[..., int]:
        def copy(source: Path, size: int, direct: int, fd: int) -> int:
            os.write(fd, b"half a window written before the refusal")
            raise OSError(error, os.strerror(error))

        return copy

    monkeypatch.setattr(objects, "_copy_direct", refused(errno.ENOSPC))
    with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)):
        store.put_file("w.win", source)
    assert store.get("w.win") == b"old" and [p.name for p in (tmp_path / "root").iterdir()] == ["w.win"]
    monkeypatch.setattr(objects, "_copy_direct", refused(errno.EINVAL))
    crc = store.put_file("w.win", source)
    assert store.get("w.win") == source.read_bytes() and crc == checksum(source.read_bytes())


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_put_keeps_old_bytes_and_leaves_no_temp_file(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = make_storage(backend, str(tmp_path))
    storage.put("manifest.json", b"old")

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        storage.put("manifest.json", b"new")
    monkeypatch.undo()
    assert storage.get("manifest.json") == b"old"
    assert _local_files(storage) == {"manifest.json"}


def test_delete_removes_a_checkpoint_and_nothing_else(storage: CheckpointStorage) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=storage.writer("step_1"), no_dist=True)
    storage.put("step_1/moc.json", b"a")
    storage.put("step_10/moc.json", b"b")  # shares the prefix "step_1"
    storage.put("step_1.json", b"c")
    storage.delete("step_1")
    storage.delete("step_1")  # missing is fine
    storage.delete("never_written")
    assert storage.get("step_1/moc.json") is None
    assert storage.get("step_10/moc.json") == b"b"
    assert storage.get("step_1.json") == b"c"
    with pytest.raises(CheckpointException, match=r"metadata|\.metadata"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=storage.reader("step_1"), no_dist=True)
    if storage.url.startswith("file://"):
        assert not any(name.startswith("step_1/") for name in _local_files(storage))


# ---------------------------------------------------------------- DCP round trips


def test_dcp_round_trip_is_bitwise(storage: CheckpointStorage) -> None:
    state = _state()
    dcp.save(state, storage_writer=storage.writer("step_00000020"), no_dist=True)
    loaded = _blank(state)
    dcp.load(loaded, storage_reader=storage.reader("step_00000020"), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            _assert_bitwise(value, loaded[key])
        else:
            assert loaded[key] == value


def test_unfinished_save_is_never_read(storage: CheckpointStorage) -> None:
    """A save that fails over an older checkpoint of the same name leaves nothing loadable, not a mix."""
    dcp.save({"w": torch.ones(4)}, storage_writer=storage.writer("step_1"), no_dist=True)

    class Crashing(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> object:
            raise RuntimeError("killed mid-save")

    with pytest.raises(CheckpointException, match="killed mid-save"):
        retry = {"w": torch.full((4,), 2.0)}
        dcp.save(retry, storage_writer=storage.writer("step_1"), planner=Crashing(), no_dist=True)
    with pytest.raises(CheckpointException, match=r"metadata|\.metadata"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=storage.reader("step_1"), no_dist=True)
    dcp.save({"w": torch.full((4,), 3.0)}, storage_writer=storage.writer("step_1"), no_dist=True)  # a retry works
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    assert torch.equal(loaded["w"], torch.full((4,), 3.0))


def test_tensorstore_follows_a_dcp_checkpoint_id(tmp_path: Path) -> None:
    storage = make_storage("tensorstore", str(tmp_path / "root"))
    elsewhere = (tmp_path / "elsewhere").as_uri()
    dcp.save({"w": torch.ones(3)}, checkpoint_id=elsewhere, storage_writer=storage.writer("ignored"), no_dist=True)
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=elsewhere, storage_reader=storage.reader("ignored"), no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(3)) and (tmp_path / "elsewhere" / ".metadata").is_file()
    writer = type(storage.writer("x"))
    assert writer.validate_checkpoint_id(str(tmp_path)) and writer.validate_checkpoint_id("memory://a")
    assert not writer.validate_checkpoint_id("nosuch://a")


# ---------------------------------------------------------------- zarr v3 arrays


@dataclass(frozen=True, kw_only=True)
class _ZarrBFloat16(Float16):
    """zarr-python 3.1 lacks the zarr-extensions ``bfloat16`` data type TensorStore writes; a reader adds it so."""

    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name = "bfloat16"
    _zarr_v2_names = ()


@pytest.fixture
def zarr_with_bfloat16() -> Iterator[None]:
    added = "bfloat16" not in data_type_registry.contents
    if added:
        data_type_registry.register("bfloat16", _ZarrBFloat16)
    yield
    if added:
        del data_type_registry.contents["bfloat16"]


def _as_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


@pytest.mark.usefixtures("zarr_with_bfloat16")
def test_tensorstore_arrays_open_with_zarr_python(tmp_path: Path) -> None:
    storage = make_storage("tensorstore", str(tmp_path))
    state = _state()
    dcp.save(state, storage_writer=storage.writer("step_1"), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            offsets = ".".join("0" * value.dim())
            array = zarr.open_array(tmp_path / "step_1" / key / f"@{offsets}", mode="r")
            assert array.metadata.zarr_format == 3 and array.shape == value.shape
            _assert_bitwise(value, _as_torch(np.asarray(array[...]).reshape(array.shape)))


class RowsPlanner(DefaultSavePlanner):
    """DCP's planner, except that the tensors in ``rows`` are written as the row range given (as MoC's planner does)."""

    def __init__(self, rows: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.rows = rows

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[self._narrow(item) for item in plan.items])
        return self.plan

    def _narrow(self, item: WriteItem) -> WriteItem:
        if item.index.fqn not in self.rows:
            return item
        start, stop = self.rows[item.index.fqn]
        size = item.tensor_data.size
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([start, *[0] * (len(size) - 1)]), sizes=torch.Size([stop - start, *size[1:]])
        )
        return dataclasses.replace(
            item,
            index=MetadataIndex(item.index.fqn, chunk.offsets),
            type=WriteItemType.SHARD,  # DCP's word for "one chunk of a tensor that may have several"
            tensor_data=TensorWriteData(chunk=chunk, properties=item.tensor_data.properties, size=size),
        )

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.index.fqn not in self.rows:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk  # DCP looks chunks up by offset only in sharded tensors
        return self.state_dict[write_item.index.fqn].narrow(0, chunk.offsets[0], chunk.sizes[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_chunk_stores_and_reads_back_its_rows(backend: str, tmp_path: Path) -> None:
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    storage = make_storage(backend, str(tmp_path))
    planner = RowsPlanner({"w": (2, 5)})
    dcp.save({"w": w, "b": torch.ones(3)}, storage_writer=storage.writer("step_1"), planner=planner, no_dist=True)
    loaded = {"w": torch.full((8, 4), -1.0), "b": torch.zeros(3)}
    dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    expected = torch.full((8, 4), -1.0)
    expected[2:5] = w[2:5]  # rows never written keep the caller's values
    assert torch.equal(loaded["w"], expected)
    assert torch.equal(loaded["b"], torch.ones(3))
    if backend == "tensorstore":
        assert np.array_equal(zarr.open_array(tmp_path / "step_1" / "w" / "@2.0", mode="r")[...], w[2:5].numpy())


def test_tensorstore_reads_exactly_the_requested_box(tmp_path: Path) -> None:
    """A resharded load asks for a box inside a stored chunk; the reader must return that box, not the chunk."""
    w = torch.arange(48, dtype=torch.int32).reshape(8, 6)
    storage = make_storage("tensorstore", str(tmp_path))
    dcp.save({"w": w}, storage_writer=storage.writer("step_1"), planner=RowsPlanner({"w": (2, 8)}), no_dist=True)
    reader = storage.reader("step_1")
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    dest = torch.zeros(3, 2, dtype=torch.int32)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": dest}, metadata, is_coordinator=True)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w"),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", [2, 0]),
        storage_offsets=torch.Size([1, 3]),  # rows 3..6 and columns 3..5 of w, relative to the chunk at row 2
        lengths=torch.Size([3, 2]),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    assert torch.equal(dest, w[3:6, 3:5])


def test_tensorstore_round_trip_across_many_zarr_chunks_and_a_tiny_io_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large tensors span several zarr chunks and several tensors overlap in flight; both paths stay exact."""
    monkeypatch.setattr(zarr_arrays, "TARGET_CHUNK_BYTES", 64)  # 4 float32 rows of 4 per zarr chunk
    monkeypatch.setattr(zarr_dcp, "IN_FLIGHT_BYTES", 100)
    state = {f"w{i}": torch.randn(10, 4) for i in range(4)}
    storage = make_storage("tensorstore", str(tmp_path))
    dcp.save(state, storage_writer=storage.writer("step_1"), planner=RowsPlanner({"w0": (1, 10)}), no_dist=True)
    assert sorted(p.name for p in (tmp_path / "step_1" / "w0" / "@1.0" / "c").iterdir()) == ["0", "1", "2"]
    loaded = {key: torch.zeros(10, 4) for key in state}
    dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    assert torch.equal(loaded["w0"][1:], state["w0"][1:]) and torch.equal(loaded["w0"][0], torch.zeros(4))
    for key in ("w1", "w2", "w3"):
        _assert_bitwise(state[key], loaded[key])


class _Done:
    def __init__(self, i: int, settled: list[int]) -> None:
        self.i, self.settled = i, settled

    def result(self) -> int:
        self.settled.append(self.i)
        return self.i


@pytest.mark.parametrize("sizes", [[3, 3, 3, 10, 1, 2], [7], [1, 1, 1, 1]])
def test_in_flight_bounds_unfinished_bytes(sizes: list[int]) -> None:
    limit = 6
    unfinished: dict[int, int] = {}
    finished: list[int] = []

    def start(i: int) -> tuple[int, _Done]:
        unfinished[i] = sizes[i]
        assert sum(unfinished.values()) <= max(limit, sizes[i])  # the limit, or one big operation alone
        return i, _Done(i, finished)

    for i, operation in inflight.in_flight(((n, functools.partial(start, i)) for i, n in enumerate(sizes)), limit):
        operation.result()
        del unfinished[i]
    assert finished == list(range(len(sizes)))


def test_in_flight_settles_what_it_started_when_stopped_early() -> None:
    settled: list[int] = []
    operations = ((1, functools.partial(lambda i: (i, _Done(i, settled)), i)) for i in range(5))
    with contextlib.closing(inflight.in_flight(operations, limit_bytes=3)) as running:
        first, _ = next(running)  # operations 0, 1, 2 are running; the caller abandons the loop here
    assert first == 0 and settled == [1, 2]


def _save_my_rows(rank: int, world_size: int, url: str) -> None:
    """Each rank writes a different row range of ``w`` (rank 0 rows [0, 3), rank 1 rows [3, 8)); ``b`` is replicated."""
    rows = [(0, 3), (3, 8)][rank]
    state = {"w": torch.arange(40, dtype=torch.float32).reshape(8, 5).bfloat16(), "b": torch.ones(2), "note": "x"}
    dcp.save(state, storage_writer=make_storage("tensorstore", url).writer("step_1"), planner=RowsPlanner({"w": rows}))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["path", "s3"])
def test_two_ranks_write_row_ranges_one_process_reads_the_whole_tensor(
    tmp_path: Path, form: str, request: pytest.FixtureRequest
) -> None:
    """Resharding at the storage level, on a local root and in a bucket (the ranks find the endpoint in the
    environment they inherit, as a job's processes do)."""
    url = f"s3://{request.getfixturevalue('s3_server').new_bucket()}/ckpt" if form == "s3" else str(tmp_path / "ckpt")
    run_ranks(_save_my_rows, 2, tmp_path, url)
    storage = make_storage("tensorstore", url)
    loaded = {"w": torch.zeros(8, 5, dtype=torch.bfloat16), "b": torch.zeros(2), "note": None}
    dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    _assert_bitwise(torch.arange(40, dtype=torch.float32).reshape(8, 5).bfloat16(), loaded["w"])
    assert torch.equal(loaded["b"], torch.ones(2)) and loaded["note"] == "x"
    keys = [key.decode() for key in storage.kvstore.list().result()]
    assert sorted({k.split("/")[2] for k in keys if k.startswith("step_1/w/")}) == ["@0.0", "@3.0"]


# ---------------------------------------------------------------- configuration errors


def test_unknown_backend_names_the_option_and_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint\.storage\.backend='s3'.*filesystem, tensorstore"):
        make_storage("s3", str(tmp_path))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unopenable_url_names_the_option(backend: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    for url in (str(blocker / "ckpt"), "", "file://otherhost/ckpt"):
        with pytest.raises(ValueError, match=r"checkpoint\.storage\.url"):
            make_storage(backend, url)


def test_url_schemes_per_backend() -> None:
    with pytest.raises(ValueError, match=r"checkpoint\.storage\.url='gs://bucket/ckpt'.*backend=tensorstore"):
        make_storage("filesystem", "gs://bucket/ckpt")
    with pytest.raises(ValueError, match=r"checkpoint\.storage\.url='nosuch://x'"):
        make_storage("tensorstore", "nosuch://x")


def test_tensorstore_refuses_unsupported_dtypes_by_name(tmp_path: Path) -> None:
    storage = make_storage("tensorstore", str(tmp_path))
    with pytest.raises(CheckpointException, match=r"cannot store torch\.complex64.*bfloat16"):
        dcp.save({"z": torch.zeros(2, dtype=torch.complex64)}, storage_writer=storage.writer("step_1"), no_dist=True)


def test_filesystem_writer_writes_tensors_from_their_own_memory(tmp_path: Path) -> None:
    """A persist must not materialise a copy of what it writes (issue 12: a save's peak RSS): the raw writer
    hands each tensor's own bytes to the file and the checksum, so writing 3 x 64 MB grows ``RssAnon`` by far
    less than one tensor (a copy per item, kept while the next one is made, grew it by two)."""
    from moc_lightning.storage.filesystem import DurableFileSystemWriter, VerifyingFileSystemReader
    from moc_lightning.tools.memory_probe import RssSampler

    state = {f"t{i}": torch.randn(16 * 2**20) for i in range(3)}  # 64 MB each, every page touched
    sampler = RssSampler(interval=0.001)
    sampler.start()
    try:
        with sampler.phase("final_persist"):
            dcp.save(state, storage_writer=DurableFileSystemWriter(str(tmp_path / "ckpt")), no_dist=True)
    finally:
        sampler.stop()
    assert sampler.peaks["final_persist"].rise < 16 * 2**20, f"{sampler.peaks['final_persist'].rise / 2**20:.1f} MiB"
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=VerifyingFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state), "the bytes written are the tensors' own"
