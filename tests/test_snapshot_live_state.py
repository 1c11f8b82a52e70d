"""A snapshot copies the live state as it is at its step, after anything replaced the tensors since the last one: an
optimizer that assigned new state tensors, a roll back, an optimizer re-created with copies of its state.

Session 30 tried reusing each unit's views between snapshots, checked by the identity of the live tensors. The last
test here found that the views outlived a re-created optimizer, and the reuse was removed: it saved 0.1-0.2 ms a
snapshot in a hot loop and nothing measurable in training (docs/performance.md). These tests stay, for any later
attempt."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from buffered_model import BufferedMoE, optimizer_of, train
from test_training_state import _engine

from moc_lightning.engine.layout import build_layout
from moc_lightning.memory.two_level import TwoLevelCheckpointer


def _trained(tmp_path: Path) -> tuple[BufferedMoE, torch.optim.Optimizer, TwoLevelCheckpointer]:
    """A model two steps in, its optimizer, and an engine with its slots reserved that snapshots every unit and never
    persists."""
    model = BufferedMoE(seed=0)
    optimizer = optimizer_of(model)
    train(model, optimizer, range(1, 3))
    engine = _engine(model, optimizer, tmp_path, "shm", persist_every_n_snapshots=1000)
    engine.reserve_slots()
    return model, optimizer, engine


def _slot_of(engine: TwoLevelCheckpointer, step: int) -> dict[str, torch.Tensor]:
    slot = next(m for m in engine.store.committed() if m.step == step)
    return engine.store.read(slot)


def test_a_snapshot_copies_optimizer_state_that_was_replaced_since_the_last(tmp_path: Path) -> None:
    """An optimizer may assign new state tensors (torch's create theirs at the first step; a roll back refills them;
    others replace them every step): the views built for the last snapshot then view tensors no longer live."""
    _, optimizer, engine = _trained(tmp_path)
    engine.snapshot(2, {})
    engine.wait_snapshot()
    for index, state in enumerate(optimizer.state.values()):
        state["exp_avg"] = torch.full_like(state["exp_avg"], 1000.0 + index)  # a new tensor, not written in place
    engine.snapshot(3, {})
    engine.wait_snapshot()
    point = engine.pec.layout.rollback_point()
    engine.pec.layout.roll_back(point)  # refills the optimizer state with copies
    for state in optimizer.state.values():
        state["exp_avg_sq"].add_(7.0)  # in place, into the refilled tensors
    engine.snapshot(4, {})
    engine.wait_snapshot()
    engine.finish()
    live = {k: v.clone() for k, v in engine.pec.layout.pieces(engine.pec.layout.units).items()}
    step3, step4 = _slot_of(engine, 3), _slot_of(engine, 4)
    moments = [k for k in live if k.endswith("/exp_avg")]
    assert moments and all(torch.equal(step3[k], live[k]) for k in moments), "step 3 holds the replaced moments"
    assert all(float(step3[k].flatten()[0]) >= 1000.0 for k in moments)
    assert sorted(step4) == sorted(live)
    for key, tensor in live.items():
        assert torch.equal(step4[key], tensor), f"{key}: step 4's slot is not the live state after the roll back"


def test_a_snapshot_after_the_optimizer_was_re_created_copies_the_new_optimizers_state(tmp_path: Path) -> None:
    """Lightning may re-create the optimizer (a restore loads the state into a new object), and the engine then takes a
    layout of the new one (``PECCheckpointer.attach``). Views built from the old layout still answer, with the old
    optimizer's state, which nothing updates any more. Failed on 69b3420, whose snapshots reused views built from the
    old layout (found by a randomized ZeRO-2 chaos trial, seed 3025: every restored unit's optimizer state was the
    state before the resume)."""
    model, optimizer, engine = _trained(tmp_path)
    engine.snapshot(2, {})
    engine.wait_snapshot()
    recreated = optimizer_of(model)
    recreated.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new state tensors, as a restore makes them
    engine.pec.attach(build_layout(model, recreated, num_experts=engine.pec.layout.num_experts[0]))
    train(model, recreated, range(3, 4))
    engine.snapshot(3, {})
    engine.wait_snapshot()
    engine.finish()
    live = {k: v.clone() for k, v in engine.pec.layout.pieces(engine.pec.layout.units).items()}
    step3 = _slot_of(engine, 3)
    assert sorted(step3) == sorted(live)
    stale = [key for key, tensor in live.items() if not torch.equal(step3[key], tensor)]
    assert stale == [], f"step 3's slot holds the old optimizer's state of {stale[:3]} ({len(stale)} tensors)"
