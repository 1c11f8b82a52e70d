"""Two-level recovery planning: resume step and per-unit sources from slots and the manifest."""

from __future__ import annotations

from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.memory.recovery import SlotInventory, Source, piece_donors, plan_recovery

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
    assert plan.unit_source("dense/a") == Source("memory", 20, rank=0, slot=1)
    assert plan.unit_source("dense/b") == Source("memory", 20, rank=1, slot=1)
    assert plan.unit_source("expert/L0/E0") == Source("memory", 20, rank=1, slot=1)
    assert plan.unit_source("expert/L0/E1") == Source("memory", 10, rank=0, slot=0)
    assert plan.unit_source("expert/L0/E3").step == 20
    assert plan.unit_source("dense/a").describe(0) == "memory_local" and plan.unit_source("dense/a").describe(1) == "memory_peer"


def test_lost_node_makes_dense_fall_back_to_the_persisted_step() -> None:
    manifest = _manifest((10, DENSE + ["expert/L0/E0"]))
    # Rank 1's node is gone: dense/b at step 20 survives nowhere, so step 20 cannot be the resume step.
    slots = [_slot(0, 0, 10, ["dense/a", "expert/L0/E1"]), _slot(0, 1, 20, ["dense/a", "expert/L0/E3"])]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest)
    assert plan.resume_step == 10
    assert plan.unit_source("dense/a").level == "memory" and plan.unit_source("dense/b") == Source(
        "storage", 10, checkpoint="step_10"
    )
    assert plan.unit_source("expert/L0/E1") == Source("memory", 10, rank=0, slot=0), "newer than storage's (none)"
    assert plan.unit_source("expert/L0/E3") == Source("none", NEVER), "its only version is after the resume step"
    assert plan.unit_source("expert/L0/E0").level == "storage"


def test_nothing_recoverable() -> None:
    assert plan_recovery(DENSE, EXPERTS, [_slot(0, 0, 5, ["dense/a"])], Manifest()) is None


def test_each_part_comes_from_the_newest_copy_of_that_part() -> None:
    """``pec_scope=optimizer``: E1's weights are in every checkpoint and slot, its optimizer state only where E1
    was taken whole (the persist of step 10); a slot of step 20 lost with its node held it whole."""
    whole = CheckpointRecord("step_10", 10, (*DENSE, "expert/L0/E1"), "adaptive", 2, 2, "filesystem")
    weights = CheckpointRecord("step_20", 20, tuple(DENSE), "adaptive", 2, 2, "filesystem", parts=("expert/L0/E1/weights",))
    slots = [SlotInventory(0, 0, 30, frozenset(DENSE), frozenset({"expert/L0/E1/weights"}))]
    plan = plan_recovery(DENSE, ["expert/L0/E1"], slots, Manifest((whole, weights)))
    assert plan.resume_step == 30
    assert plan.sources["expert/L0/E1/weights"] == Source("memory", 30, rank=0, slot=0)
    assert plan.sources["expert/L0/E1/optimizer"] == Source("storage", 10, checkpoint="step_10")
    assert plan.unit_source("dense/a") == Source("memory", 30, rank=0, slot=0)


def test_a_unit_in_pieces_is_in_memory_only_where_every_holder_has_its_piece() -> None:
    """FSDP2: every holder keeps its own piece of a unit. A step is in memory for a unit only when all its holders'
    slots of that step have it; then each takes its own piece (one source, no rank). A unit one holder lost comes
    from storage whole, not half from memory."""
    holders = {unit: ((0,), (1,)) for unit in DENSE + EXPERTS}
    manifest = _manifest((10, DENSE + ["expert/L0/E0"]))
    both = DENSE + ["expert/L0/E1", "expert/L0/E2"]
    slots = [_slot(0, 0, 20, both), _slot(1, 0, 20, both + ["expert/L0/E3"]), _slot(0, 1, 30, DENSE)]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest, holders)
    assert plan.resume_step == 20, "step 30 is on rank 0 only: its dense units are not whole anywhere"
    assert plan.unit_source("dense/a") == Source("memory", 20, pieces=True)
    assert plan.unit_source("dense/a").describe(1) == "memory_local"
    assert plan.unit_source("expert/L0/E1") == Source("memory", 20, pieces=True)
    assert plan.unit_source("expert/L0/E3") == Source("none", NEVER), "rank 0's piece of it was never snapshotted"
    assert plan.unit_source("expert/L0/E0") == Source("storage", 10, checkpoint="step_10")
    lost = plan_recovery(DENSE, EXPERTS, [s for s in slots if s.rank == 0], manifest, holders)
    assert lost.resume_step == 10
    assert {s.level for s in lost.sources.values()} == {"storage", "none"}


def test_hsdp_replicas_of_a_piece_stand_in_for_each_other() -> None:
    """HSDP, 4 ranks in 2 replica groups: ranks 0 and 2 hold one piece of every unit, 1 and 3 the other. A unit is in
    memory at a step while some slot of it holds each piece: rank 2 lost its slots, so rank 0 sends it its pieces.
    When both replicas of a piece are gone (ranks 1 and 3), the unit comes from storage, not half from memory."""
    holders = {unit: ((0, 2), (1, 3)) for unit in DENSE + EXPERTS}
    manifest = _manifest((10, DENSE + ["expert/L0/E0"]))
    units = DENSE + ["expert/L0/E1"]
    slots = [_slot(rank, 0, 20, units) for rank in (0, 1, 3)]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest, holders)
    assert plan.resume_step == 20
    assert plan.unit_source("expert/L0/E1") == plan.unit_source("dense/a") == Source("memory", 20, pieces=True)
    assert piece_donors("dense/a/weights", 20, slots, holders["dense/a"]) == {2: 0}
    assert piece_donors("dense/a/optimizer", 20, [*slots, _slot(2, 0, 20, units)], holders["dense/a"]) == {}
    lost = plan_recovery(DENSE, EXPERTS, [s for s in slots if s.rank == 0], manifest, holders)
    assert lost.resume_step == 10 and lost.unit_source("expert/L0/E1") == Source("none", NEVER)


def test_hsdp_replicas_stand_in_for_a_part_held_in_pieces() -> None:
    """HSDP under ``pec_scope=optimizer``: the slots of step 20 hold E1 whole and only the weights of E2, in pieces
    (ranks 0 and 2 one piece, 1 and 3 the other). Rank 2 lost its slots: E2's weights still come from memory, rank 0
    sending rank 2 its piece; E2's optimizer state, in no slot, from storage."""
    holders = {unit: ((0, 2), (1, 3)) for unit in DENSE + EXPERTS}
    manifest = _manifest((10, DENSE + ["expert/L0/E2"]))
    slots = [
        SlotInventory(rank, 0, 20, frozenset(DENSE + ["expert/L0/E1"]), frozenset({"expert/L0/E2/weights"}))
        for rank in (0, 1, 3)
    ]
    plan = plan_recovery(DENSE, EXPERTS, slots, manifest, holders)
    assert plan.resume_step == 20
    assert plan.sources["expert/L0/E2/weights"] == Source("memory", 20, pieces=True)
    assert plan.sources["expert/L0/E2/optimizer"] == Source("storage", 10, checkpoint="step_10")
    assert piece_donors("expert/L0/E2/weights", 20, slots, holders["expert/L0/E2"]) == {2: 0}
