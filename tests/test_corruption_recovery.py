"""A damaged checkpoint is never loaded: recovery falls back to the version stored before it and says so."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from storage_faults import DAMAGES, flip_byte_of
from trainee import TINY, Trainee, every_step_config

from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.units import ExpertUnit
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.pec.stored import MANIFEST


def _two_checkpoints(url: str) -> tuple[dict[int, dict[str, torch.Tensor]], Path]:
    """Full checkpoints (K=N) at steps 2 and 4; the tensors captured at each."""
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    captured = {}
    for step in range(1, 5):
        trainee.step(step)
        engine.record_tokens(trainee.model.moe_layers())
        if step in (2, 4):
            engine.checkpoint(step)
            captured[step] = trainee.snapshot()
    return captured, Path(url.removeprefix("file://"))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_tensor_file_falls_back_to_previous_version(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    data_file = next((root / "step_000000004").glob("*.distcp"))
    DAMAGES[damage](data_file)

    fresh = Trainee(ExpertParallelTopology(), seed=1)
    engine = fresh.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    report = engine.load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored), "every tensor is step 2's"
    assert "step_000000004 is unreadable" in capsys.readouterr().out
    assert [r.step for r in engine.read_manifest().records] == [2], "the damaged checkpoint is no longer listed"


def test_garbage_manifest_falls_back_to_the_previous_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    (root / "manifest.json").write_bytes(b"\x00garbage{")
    fresh = Trainee(ExpertParallelTopology(), seed=1)
    report = fresh.engine(every_step_config(TINY.num_experts, TINY.num_experts), url).load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored)
    assert "manifest.json is unreadable" in capsys.readouterr().out


def _restore(url: str) -> tuple[Trainee, object]:
    fresh = Trainee(ExpertParallelTopology(), seed=1)
    engine = fresh.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    return fresh, engine


@pytest.mark.parametrize(
    ("file", "needle", "at"),
    [
        pytest.param("step_000000004/.metadata", b"expert/L1/E4", 0, id="metadata_key"),  # -> dxpert/L1/E4
        pytest.param("step_000000004/moc.json", b"snapshots_taken", 0, id="moc_json_key"),
        pytest.param("step_000000004/moc.json", b'"step": 4', 8, id="moc_json_step"),  # -> "step": 5
    ],
)
def test_damage_a_parser_cannot_see_falls_back_to_previous_version(
    tmp_path: Path, file: str, needle: bytes, at: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped byte that leaves valid pickle or JSON is still damage: every control byte has a checksum."""
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    flip_byte_of(root / file, needle, at)
    fresh, engine = _restore(url)
    report = engine.load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored), "every tensor is step 2's"
    out = capsys.readouterr().out
    assert "step_000000004 is unreadable" in out and "CRC32C" in out, out
    assert [r.step for r in engine.read_manifest().records] == [2]


def test_manifest_damage_a_parser_cannot_see_falls_back_to_the_previous_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    flip_byte_of(root / "manifest.json", b'"step": 4', 8)  # valid JSON, now says step 5
    fresh, engine = _restore(url)
    report = engine.load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored)
    out = capsys.readouterr().out
    assert "manifest.json is unreadable" in out and "CRC32C" in out, out


def test_a_unit_the_manifest_lists_but_the_checkpoint_lacks_is_an_unreadable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP's "Missing key in checkpoint state_dict" from a checkpoint said to hold the unit: fall back, not crash."""
    url = (tmp_path / "ckpt").as_uri()
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    trainee.step(1)
    engine.checkpoint(1)
    at_step_1 = trainee.snapshot()
    trainee.step(2)
    engine.persist(2, engine.layout.dense_units)  # dense units only
    manifest = engine.read_manifest()
    first, second = manifest.records
    claims_more = Manifest((first, dataclasses.replace(second, units=(*second.units, "expert/L1/E4"))))
    engine.storage.put(MANIFEST, claims_more.to_json())  # a valid manifest that is wrong about step 2

    fresh, engine = _restore(url)
    report = engine.load_latest()
    assert report.resume_step == 1
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], at_step_1[k]) for k in restored)
    out = capsys.readouterr().out
    assert "step_000000002 is unreadable" in out and "expert/L1/E4" in out, out


def test_slot_metadata_damage_a_parser_cannot_see_skips_the_slot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "slots")
    store.write(0, 7, ("dense/a",), {"dense/a/param/w": torch.ones(3)}, {"engine": {}})
    store.write(1, 8, ("dense/a",), {"dense/a/param/w": torch.ones(3)}, {"engine": {}})
    flip_byte_of(store.slot_dir(1) / "meta.json", b'"step": 8', 8)  # valid JSON, now says step 9
    assert [m.step for m in SnapshotStore(tmp_path / "slots").committed()] == [7], "the damaged slot is torn"


def test_a_unit_only_the_damaged_checkpoint_held_is_rolled_back_to_its_state_before_the_load(tmp_path: Path) -> None:
    """The damaged checkpoint's load copies its items in one by one until the damaged one; the fallback has no
    version of an expert that only it held, so nothing reloads that expert: it must be as before the load (its
    initial state, no optimizer state), not half the damaged checkpoint's. Failed on 25ba8bd (the expert kept the
    items of step 2 copied before the damaged one)."""
    url = (tmp_path / "ckpt").as_uri()
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    only_in_step_2 = ExpertUnit(1, 4)
    for step, units in ((1, engine.layout.dense_units), (2, (*engine.layout.dense_units, only_in_step_2))):
        trainee.step(step)
        engine.record_tokens(trainee.model.moe_layers())
        engine.tokens.mark_step(step)
        engine.persist(step, units)
    root = Path(url.removeprefix("file://")) / "step_000000002"
    data = next(root.glob("*.distcp"))
    reader = engine.storage.reader("step_000000002")
    places = reader.read_metadata().storage_data
    last = max(places.values(), key=lambda place: place.offset)
    expert_items = [i for i, place in places.items() if i.fqn.startswith(only_in_step_2.key)]
    assert any(places[i].offset < last.offset for i in expert_items), "some of the expert's items load before it"
    with data.open("r+b") as f:  # damage the file's last item: every item before it loads
        f.seek(last.offset + last.length - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))

    fresh, engine = _restore(url)
    before = {k: t.clone() for k, t in engine.layout.model_tensors([only_in_step_2]).items()}
    report = engine.load_latest()
    assert report.resume_step == 1
    after = engine.layout.model_tensors([only_in_step_2])
    assert all(torch.equal(after[k], before[k]) for k in before), "the expert holds no byte of step 2"
    assert not engine.layout.tensors([only_in_step_2]).keys() - before.keys(), "nor optimizer state from it"
