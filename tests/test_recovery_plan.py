"""Two-level recovery planning: resume step and per-unit sources from slots and the manifest."""

from __future__ import annotations

from moc_lightning.ledger import NEVER
from moc_lightning.manifest import CheckpointRecord, Manifest
from moc_lightning.recovery import SlotInventory, Source, plan_recovery

DENSE = ["dense/a", "dense/b"]
EXPERTS = ["expert/L0/E0", "expert/L0/E1", "expert/L0/E2", "expert/L0/E3"]


def _manifest(*records: tuple[int, list[str]]) -> Manifest:
    m = Manifest()
    for step, units in records:
        m = m.with_record(CheckpointRecord(f"step_{step}", step, tuple(units), "adaptive", 2, 2, "filesystem"))
    return m


def _slot(rank: int, slot: int, step: int, units: list[str]) -> SlotInventory:
    return SlotInventory(rank, slot, step, frozenset(units))


def test_memory_newer_than_storage_wins() -> None:
    manifest = _manifest((10, DENSE + ["expert/L0/E0"]))
    slots = [
        _slot(0, 0, 10, ["dense/a", "expert/L0/E0", "expert/L0/E1"]),
        _slot(1, 0, 10, ["dense/b", "expert/L0/E2"]),
        _slot(0, 1, 20, ["dense/a", "expert/L0/E3"]),
        _slot(1, 1, 20, ["dense/b", "expert/L0/E0"]),
    ]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest)
    assert plan.resume_step == 20
    assert plan.sources["dense/a"] == Source("memory", 20, rank=0, slot=1)
    assert plan.sources["dense/b"] == Source("memory", 20, rank=1, slot=1)
    assert plan.sources["expert/L0/E0"] == Source("memory", 20, rank=1, slot=1)
    assert plan.sources["expert/L0/E1"] == Source("memory", 10, rank=0, slot=0)
    assert plan.sources["expert/L0/E3"].step == 20
    assert plan.sources["dense/a"].describe(0) == "memory_local" and plan.sources["dense/a"].describe(1) == "memory_peer"


def test_lost_node_makes_dense_fall_back_to_the_persisted_step() -> None:
    manifest = _manifest((10, DENSE + ["expert/L0/E0"]))
    # Rank 1's node is gone: dense/b at step 20 survives nowhere, so step 20 cannot be the resume step.
    slots = [_slot(0, 0, 10, ["dense/a", "expert/L0/E1"]), _slot(0, 1, 20, ["dense/a", "expert/L0/E3"])]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest)
    assert plan.resume_step == 10
    assert plan.sources["dense/a"].level == "memory" and plan.sources["dense/b"] == Source(
        "storage", 10, checkpoint="step_10"
    )
    assert plan.sources["expert/L0/E1"] == Source("memory", 10, rank=0, slot=0), "newer than storage's (none)"
    assert plan.sources["expert/L0/E3"] == Source("none", NEVER), "its only version is after the resume step"
    assert plan.sources["expert/L0/E0"].level == "storage"


def test_nothing_recoverable() -> None:
    assert plan_recovery(DENSE, EXPERTS, [_slot(0, 0, 5, ["dense/a"])], Manifest()) is None
