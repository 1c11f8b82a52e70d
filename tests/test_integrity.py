"""Integrity of stored checkpoints (DESIGN.md, hard part 5): checksums verified on load, damage reported as
:class:`CorruptCheckpointError`, and failed writes (injected, or a real full disk) that commit nothing."""

from __future__ import annotations

import errno
import pickle
import struct
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from storage_faults import (
    DAMAGES,
    FaultyStorage,
    flip_byte_of,
    flip_middle_byte,
    small_filesystem,
    truncate_to_half,
)
from torch.distributed.checkpoint.api import CheckpointException
from trainee import TINY, Trainee, every_step_config

from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.manifest import Manifest
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.stored import MANIFEST
from moc_lightning.sharding.planner import MoCSavePlanner
from moc_lightning.storage import CheckpointStorage, CorruptCheckpointError, corrupt_from, make_storage
from moc_lightning.storage.filesystem import ChecksummedStorageInfo
from moc_lightning.storage.integrity import find_cause
from moc_lightning.storage.zarr_dcp import BlobRef

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore:Detected an existing checkpoint:UserWarning"
)

BACKENDS = ("filesystem", "tensorstore")
NAME = "step_00000010"


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(3, generator=g).bfloat16(), "note": "lr v2"}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(8, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "note": None}


def _save(storage: CheckpointStorage, name: str = NAME) -> None:
    """The state, written by MoC's planner: rows 2..6 of ``w`` (a partial chunk) and all of ``b``."""
    planner = MoCSavePlanner({"w": (2, 6), "b": (0, 3)})
    dcp.save(_state(), storage_writer=storage.writer(name), planner=planner, no_dist=True)


def _load(storage: CheckpointStorage, name: str = NAME) -> dict[str, object]:
    loaded = _blank()
    dcp.load(loaded, storage_reader=storage.reader(name), no_dist=True)
    return loaded


def _corruption(storage: CheckpointStorage) -> tuple[CorruptCheckpointError, dict[str, object]]:
    """What loading the damaged checkpoint raised, dug out of DCP's wrapper, and what reached the targets."""
    loaded = _blank()
    with pytest.raises(CheckpointException) as caught:
        dcp.load(loaded, storage_reader=storage.reader(NAME), no_dist=True)
    error = corrupt_from(caught.value)
    assert error is not None, f"damage not reported as CorruptCheckpointError: {caught.value}"
    return error, loaded


def _assert_nothing_damaged_delivered(loaded: dict[str, object]) -> None:
    """Every target is untouched or holds exactly the saved bytes: no damaged item was handed over."""
    saved, blank = _state(), _blank()
    expected_w = blank["w"].clone()
    expected_w[2:6] = saved["w"][2:6]
    assert torch.equal(loaded["w"], blank["w"]) or torch.equal(loaded["w"], expected_w)
    assert torch.equal(loaded["b"], blank["b"]) or torch.equal(loaded["b"], saved["b"])
    assert loaded["note"] in (None, saved["note"])


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStorage:
    return make_storage(request.param, str(tmp_path))


# ---------------------------------------------------------------- intact checkpoints


def _crc(data: bytes) -> int:
    return google_crc32c.value(data)


def test_intact_filesystem_checkpoint_records_each_items_crc32c(tmp_path: Path) -> None:
    storage = make_storage("filesystem", str(tmp_path))
    _save(storage)
    metadata = storage.reader(NAME).read_metadata()
    assert len(metadata.storage_data) == 3
    for info in metadata.storage_data.values():
        assert isinstance(info, ChecksummedStorageInfo)
        data = (tmp_path / NAME / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert info.crc32c == _crc(data)
    assert _load(storage)["note"] == "lr v2"


def test_intact_tensorstore_checkpoint_stores_a_crc32c_in_every_zarr_chunk(tmp_path: Path) -> None:
    storage = make_storage("tensorstore", str(tmp_path))
    _save(storage)
    chunks = [p for p in (tmp_path / NAME).rglob("*") if p.is_file() and "c" in p.relative_to(tmp_path / NAME).parts]
    assert len(chunks) == 2  # one zarr chunk per stored tensor chunk at this size
    for chunk in chunks:
        data = chunk.read_bytes()
        assert struct.unpack("<I", data[-4:])[0] == _crc(data[:-4]), f"{chunk} does not end with its CRC32C"
    refs = storage.reader(NAME).read_metadata().storage_data.values()
    (note,) = [ref for ref in refs if isinstance(ref, BlobRef)]
    blob = (tmp_path / NAME / note.key).read_bytes()
    assert note.crc32c == _crc(blob[note.offset : note.offset + note.length])
    assert _load(storage)["note"] == "lr v2"


def test_intact_checkpoint_round_trips(storage: CheckpointStorage) -> None:
    _save(storage)
    loaded, saved = _load(storage), _state()
    assert torch.equal(loaded["w"][2:6], saved["w"][2:6]) and torch.equal(loaded["b"], saved["b"])
    assert loaded["note"] == saved["note"]


# ---------------------------------------------------------------- damage


DATA_FILES = [
    ("filesystem", "__0_0.distcp"),  # every byte of it belongs to one item
    ("tensorstore", "w/@2.0/c/0/0"),  # the zarr chunk of w's rows 2..6
    ("tensorstore", "b/@0/c/0"),
    ("tensorstore", ".bytes/0"),  # the non-tensor values
    ("tensorstore", "w/@2.0/zarr.json"),  # a flipped byte there may leave valid, harmless JSON: not checked
]


@pytest.mark.parametrize(
    ("backend", "file", "damage"),
    [(b, f, d) for b, f in DATA_FILES for d in DAMAGES if not (f.endswith(".json") and d == "flip")],
)
def test_damaged_data_file_is_reported_by_name(tmp_path: Path, backend: str, file: str, damage: str) -> None:
    storage = make_storage(backend, str(tmp_path))
    _save(storage)
    DAMAGES[damage](tmp_path / NAME / file)
    error, loaded = _corruption(storage)
    assert NAME in error.checkpoint and file in str(error), str(error)
    _assert_nothing_damaged_delivered(loaded)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(b"\x80\x05garbage that is no pickle"), id="garbage"),
        pytest.param(truncate_to_half, id="truncate"),
        pytest.param(lambda p: p.write_bytes(pickle.dumps({"not": "metadata"})), id="wrong_type"),
        pytest.param(Path.unlink, id="delete"),
    ],
)
def test_damaged_metadata_is_reported(
    storage: CheckpointStorage, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    _save(storage)
    damage(tmp_path / NAME / ".metadata")
    error, _ = _corruption(storage)
    assert NAME in error.checkpoint and ".metadata" in error.detail, str(error)


def test_corrupt_from_digs_through_dcp_wrappers_and_survives_pickling() -> None:
    """DCP gathers every rank's failure (pickled) into a ``CheckpointException`` raised on all ranks."""
    original = CorruptCheckpointError("file:///ckpt/step_1", "item fails its CRC32C check")
    try:
        try:
            raise pickle.loads(pickle.dumps(original))
        except CorruptCheckpointError as err:
            raise RuntimeError("while loading") from err
    except RuntimeError as err:
        wrapped = CheckpointException("read", {1: (err, traceback.extract_tb(err.__traceback__))})
    found = corrupt_from(wrapped)
    assert found is not None and (found.checkpoint, found.detail) == (original.checkpoint, original.detail)
    assert str(found) == "checkpoint file:///ckpt/step_1 is corrupt: item fails its CRC32C check"
    assert corrupt_from(CheckpointException("read", {0: (ValueError("a bug"), None)})) is None


def _damage_seen_by_one_rank(rank: int, world_size: int, backend: str, root: str, damaged: str) -> str | None:
    """Each rank writes half of ``w``; ``damaged`` (rank 1's half) gets a flipped byte; only rank 1 reads it."""
    storage = make_storage(backend, root)
    writes = {"w": [(0, 4), (4, 8)][rank]} | ({"b": (0, 3)} if rank == 0 else {})
    dcp.save(_state(), storage_writer=storage.writer(NAME), planner=MoCSavePlanner(writes))
    dist.barrier()
    if rank == 0:
        flip_middle_byte(Path(root) / NAME / damaged)
    dist.barrier()
    mine = {"w": torch.zeros(8, 4)} if rank == 1 else {"b": torch.zeros(3, dtype=torch.bfloat16)}
    try:
        dcp.load(mine, storage_reader=storage.reader(NAME))
    except CheckpointException as err:
        found = corrupt_from(err)
        return None if found is None else str(found)
    return "loaded"


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "damaged"), [("filesystem", "__1_0.distcp"), ("tensorstore", "w/@4.0/c/0/0")])
def test_every_rank_sees_the_corruption_one_rank_found(tmp_path: Path, backend: str, damaged: str) -> None:
    """DCP gathers failures to all ranks, so every rank can fall back the same way (a collective decision)."""
    seen = run_ranks(_damage_seen_by_one_rank, 2, tmp_path, backend, str(tmp_path / "ckpt"), damaged)
    assert all(message is not None and damaged in message for message in seen), seen


# ---------------------------------------------------------------- failed writes


def _oserror(exc: BaseException) -> OSError:
    found = find_cause(exc, OSError)
    assert found is not None, f"no OSError behind {exc!r}"
    return found


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_write_failing_midway_leaves_an_unloadable_location(storage: CheckpointStorage, code: int) -> None:
    faulty = FaultyStorage(storage, fail_writes={2: code})
    _save(faulty, "step_1")
    with pytest.raises(CheckpointException) as caught:
        _save(faulty, "step_2")
    assert _oserror(caught.value).errno == code
    with pytest.raises(CheckpointException) as refused:
        _load(faulty, "step_2")
    assert ".metadata is missing" in corrupt_from(refused.value).detail
    assert torch.equal(_load(faulty, "step_1")["w"][2:6], _state()["w"][2:6])


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_failed_put_keeps_the_old_object(storage: CheckpointStorage, code: int) -> None:
    faulty = FaultyStorage(storage, fail_puts={2: code})
    faulty.put(MANIFEST, b"old")
    with pytest.raises(OSError) as caught:
        faulty.put(MANIFEST, b"new")
    assert caught.value.errno == code and faulty.get(MANIFEST) == b"old"


def _engine(trainee: Trainee, storage: CheckpointStorage) -> PECCheckpointer:
    layout = build_layout(trainee.model, trainee.optimizer, num_experts=TINY.num_experts)
    every_expert = every_step_config(TINY.num_experts, TINY.num_experts)  # so step 1 alone restores everything
    return PECCheckpointer(every_expert, layout, trainee.model.topology, storage)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_persist_failing_anywhere_commits_nothing(tmp_path: Path, backend: str) -> None:
    """A data write failing midway (step 2) or the manifest put failing (step 3) leaves step 1 the latest."""
    url = str(tmp_path / "ckpt")
    trainee = Trainee(ExpertParallelTopology())
    # puts: step 1's moc.json, previous manifest, manifest (1-3); step 3's (step 2 never gets to a put): its
    # manifest put (6) fails
    faulty = FaultyStorage(make_storage(backend, url), fail_writes={2: errno.ENOSPC}, fail_puts={6: errno.EIO})
    engine = _engine(trainee, faulty)
    trainee.step(1)
    engine.checkpoint(1)
    at_step_1 = trainee.snapshot()
    trainee.step(2)
    with pytest.raises(PersistFailed) as caught:
        engine.checkpoint(2)
    assert _oserror(caught.value).errno == errno.ENOSPC
    trainee.step(3)
    with pytest.raises(PersistFailed, match="commit:manifest: OSError") as caught_put:
        engine.checkpoint(3)
    assert _oserror(caught_put.value).errno == errno.EIO
    storage = make_storage(backend, url)
    assert [r.step for r in Manifest.from_json(storage.get(MANIFEST)).records] == [1]
    fresh = Trainee(ExpertParallelTopology(), seed=1)
    report = _engine(fresh, storage).load_latest()
    assert report is not None and report.resume_step == 1
    for key, value in fresh.snapshot().items():
        assert torch.equal(value, at_step_1[key]), f"{key} is not the value committed at step 1"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB file system; skipped, with the reason, where this machine cannot mount one."""
    try:
        with small_filesystem(tmp_path / "small", "4m") as root:
            yield root
    except PermissionError as err:
        pytest.skip(f"no small file system to fill: {err}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_full_disk_raises_enospc_and_commits_nothing(full_disk: Path, backend: str) -> None:
    storage = make_storage(backend, str(full_disk / "ckpt"))
    _save(storage, "step_1")
    storage.put(MANIFEST, b"names step_1")
    big = {"w": torch.randn(2 << 20)}  # 8 MiB of float32: twice the file system
    with pytest.raises(CheckpointException) as caught:
        dcp.save(big, storage_writer=storage.writer("step_2"), no_dist=True)
    assert _oserror(caught.value).errno == errno.ENOSPC
    assert storage.get(MANIFEST) == b"names step_1"
    with pytest.raises(CheckpointException) as refused:
        dcp.load({"w": torch.zeros(2 << 20)}, storage_reader=storage.reader("step_2"), no_dist=True)
    assert corrupt_from(refused.value) is not None
    storage.delete("step_2")  # room again: the committed checkpoint still verifies and loads
    assert torch.equal(_load(storage, "step_1")["w"][2:6], _state()["w"][2:6])


@pytest.mark.parametrize("key", [b"note", b"w"])
def test_metadata_damage_that_keeps_the_pickle_valid_is_reported(
    storage: CheckpointStorage, tmp_path: Path, key: bytes
) -> None:
    """A renamed key (``note`` -> ``ooue``) unpickles fine; only ``.metadata``'s own checksum catches it."""
    _save(storage)
    path = tmp_path / NAME / ".metadata"
    flip_byte_of(path, key)
    pickle.loads(path.read_bytes())  # still a valid pickle
    error, loaded = _corruption(storage)
    assert NAME in error.checkpoint and ".metadata" in error.detail and "CRC32C" in error.detail, str(error)
    _assert_nothing_damaged_delivered(loaded)
