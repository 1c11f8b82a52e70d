"""A restored state is marked complete or not, and nothing writes an incomplete one (issue 28 item 2): while a restore
is pending, every snapshot and persist is refused and nothing is committed; a final persist records the digests of
what it wrote, and a later "persisted already" decision checks the live state against them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainee import Trainee, every_step_config

from moc_lightning.engine.completeness import IncompleteRestore, state_digest
from moc_lightning.engine.manifest import Manifest
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology


def _engine(root: Path) -> tuple[Trainee, TwoLevelCheckpointer]:
    trainee = Trainee(ExpertParallelTopology.replicated())
    pec = trainee.engine(every_step_config(2, 1), (root / "ckpt").as_uri())
    engine = TwoLevelCheckpointer(pec, SnapshotStore(root / "shm" / "rank0"), behind=False)
    trainee.step(1)
    pec.record_tokens(trainee.model.moe_layers())
    return trainee, engine


def test_a_pending_restore_refuses_every_snapshot_and_persist_and_commits_nothing(tmp_path: Path) -> None:
    _, engine = _engine(tmp_path)
    engine.completeness.begin("the replay of the window from step 0 to step 1")
    with pytest.raises(IncompleteRestore, match=r"the snapshot of step 1 refused: .*the replay of the window from step 0"):
        engine.snapshot(1, {})
    with pytest.raises(IncompleteRestore, match="the final persist of step 1 refused"):
        engine.persist_final(1, {})
    assert engine.pec.read_manifest().records == (), "nothing committed"
    assert engine.store.committed() == [], "no slot committed"
    engine.completeness.complete()
    assert engine.persist_final(1, {}) is not None
    assert [r.step for r in engine.pec.read_manifest().records] == [1]


def test_a_final_checkpoint_records_its_digest_and_persisted_already_is_decided_by_it(tmp_path: Path) -> None:
    """Failed on 72cf597 (no digest: a second final persist of step 1 from another live state returned "persisted
    already" and kept the first one)."""
    trainee, engine = _engine(tmp_path)
    layout = engine.pec.layout
    first = engine.persist_final(1, {})
    record = engine.pec.read_manifest().latest
    assert first is not None and record.digests == (state_digest(layout.pieces(layout.units)),)
    assert engine.persist_final(1, {}) is None, "the live state is what step 1's checkpoint holds"
    with torch.no_grad():
        next(trainee.model.parameters()).add_(1.0)  # a live state that checkpoint does not hold
    again = engine.persist_final(1, {})
    assert again is not None, "written again from the live state"
    rewritten = engine.pec.read_manifest().latest
    assert rewritten.step == 1 and rewritten.name != record.name
    assert rewritten.digests == (state_digest(layout.pieces(layout.units)),) != record.digests
    fresh = Trainee(ExpertParallelTopology.replicated(), seed=1)
    fresh.engine(every_step_config(2, 1), (tmp_path / "ckpt").as_uri()).load_latest()
    loaded, live = fresh.snapshot(), trainee.snapshot()
    assert sorted(k for k in live if "/optim/" not in k and not torch.equal(loaded[k], live[k])) == []


def test_the_digests_round_trip_through_the_manifest_and_a_manifest_without_them_reads_as_before() -> None:
    raw = {
        "format": 1, "records": [{
            "name": "step_000000001", "step": 1, "units": ["dense/a"], "strategy": "adaptive", "world_size": 2,
            "ep": 1, "backend": "filesystem",
        }],
    }
    raw["format"] = Manifest((), None).to_dict()["format"]
    old = Manifest.from_dict(raw)
    assert old.latest.digests == () and "digests" not in old.to_dict()["records"][0]
    raw["records"][0]["digests"] = ["0000abcd", "ffff0000"]
    assert Manifest.from_json(Manifest.from_dict(raw).to_json()).latest.digests == ("0000abcd", "ffff0000")
    raw["records"][0]["digests"] = "0000abcd"
    with pytest.raises(ValueError, match="'digests' must be a list of strings"):
        Manifest.from_dict(raw)


def test_state_digest_sees_every_byte_dtype_shape_and_name() -> None:
    state = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    digest = state_digest(state)
    assert state_digest({k: v.clone() for k, v in state.items()}) == digest
    changed = [
        {**state, "a": state["a"].clone().index_fill_(0, torch.tensor([5]), 5.5)},
        {**state, "a": state["a"].reshape(2, 3)},
        {**state, "b": state["b"].float()},
        {"c": state["a"], "b": state["b"]},
    ]
    assert all(state_digest(other) != digest for other in changed)
