"""The scale report (issue 30, item 1) at small simulated sizes: every field of every row is there (a null one says
why), and the figures grow as the report says they do (DESIGN.md, Scale): a recovery's exchange at most linearly in
world size (O(units) per rank), a snapshot's collective not at all; one rank's plan, in time and memory, at most
linearly (O(units + ranks))."""

from __future__ import annotations

import pytest

from moc_lightning.tools.moe_shapes import GptMoeShape, numel
from moc_lightning.tools.mtbf_projection import project_mtbf
from moc_lightning.tools.scale_projection import ESTIMATED, MEASURED, scale_costs, scale_inputs
from moc_lightning.tools.scale_report import MODELS, growth, markdown, rank_bytes, replay_bytes, report, verdicts

FIELDS = (
    "plan_s", "plan_on_training_thread", "coordinator_plan_s", "metadata_bytes", "manifest_bytes", "commit_s",
    "inventory_bytes_per_rank", "recovery_exchange_bytes", "recovery_plan_s", "snapshot_collective_bytes",
    "snapshot_collectives", "plan_memory_bytes",
)  # fmt: skip


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return report(["gpt350m16e"], [32, 128], ["1", "N"], item_cap=20_000, log=lambda _: None)


def test_every_row_has_every_field_and_a_reason_for_each_null(rows: list[dict]) -> None:
    assert [(r["world_size"], r["k"]) for r in rows] == [(32, 1), (128, 1), (32, 16), (128, 16)]
    for row in rows:
        assert set(FIELDS) <= row.keys()
        for field in ("coordinator_plan", "dcp_coordinator_plan"):
            estimate = row[f"{field}_s_estimate"]
            if row[f"{field}_s"] is None:
                assert "linear in items" in row[f"{field}_reason"]
                assert estimate > 0 and f"~{estimate:.1f} s" in row[f"{field}_reason"], "the estimate, as a number"
            else:
                assert estimate is None, "a measured figure needs no estimate"
        assert row["plan_on_training_thread"] is None and "unmeasured" in row["plan_thread"], "unknown, and says why"
        assert all(row[f] is None or row[f] > 0 for f in FIELDS if f != "plan_on_training_thread")
    assert any(r["dcp_coordinator_plan_s"] is None for r in rows), "the cap leaves DCP's largest plans unbuilt here"
    assert "| GPT-350M-16E | 128 | 16 |" in markdown(rows)
    assert verdicts(rows) == ["- targets: DeepSeek-V3-shaped with K=N not in this run"]


def test_growth_stays_within_the_stated_order(rows: list[dict]) -> None:
    for k in (1, 16):
        ((_, _, worlds, exchange),) = growth(rows, "recovery_exchange_bytes", "GPT-350M-16E", k)
        assert exchange <= worlds, f"K={k}: the exchange grew {exchange:.1f}x for {worlds:.0f}x the ranks"
        ((_, _, _, snapshot),) = growth(rows, "snapshot_collective_bytes", "GPT-350M-16E", k)
        assert snapshot == 1.0
        ((_, _, _, plan),) = growth(rows, "plan_s", "GPT-350M-16E", k)
        assert plan <= worlds, f"K={k}: one rank's plan grew {plan:.1f}x for {worlds:.0f}x the ranks"
        ((_, _, _, memory),) = growth(rows, "plan_memory_bytes", "GPT-350M-16E", k)
        assert memory <= worlds, f"K={k}: one rank's plan memory grew {memory:.1f}x for {worlds:.0f}x the ranks"


def test_bytes_per_rank_add_up_to_the_models_state() -> None:
    """What the projection at scale copies and writes per rank (issue 30, item 4), against the shape's own count: bf16
    weights, fp32 master and moments (14 bytes a parameter) and a 4-byte step per tensor; every byte snapshotted once
    by its owner at K=N, and written once (the write plan rounds a unit up to whole rows)."""
    shape = GptMoeShape()
    units = [t for _, t in shape.dense_tensors()] + [shape.expert_tensors()] * (len(shape.moe_layers) * shape.experts)
    state = sum(14 * numel(t) + 4 * len(t) for t in units)
    full, k1 = rank_bytes(MODELS["gpt350m16e"], 64, 16), rank_bytes(MODELS["gpt350m16e"], 64, 1)
    assert full.state_total == full.snapshot_total == state
    one_expert = 14 * numel(shape.expert_tensors()) + 4 * len(shape.expert_tensors())
    held = sum(14 * numel(t) + 4 * len(t) for _, t in shape.dense_tensors()) + len(shape.moe_layers) * one_expert
    assert full.restore_units_max == len(shape.dense_tensors()) + len(shape.moe_layers), (
        "EP 16 of 16 experts: a rank restores the dense units and one expert per MoE layer, its own"
    )
    experts = len(shape.moe_layers) * numel(shape.expert_tensors())  # one a layer
    weights = 2 * (sum(numel(t) for _, t in shape.dense_tensors()) + experts)  # bf16
    kept_on_average = sum(12 * numel(t) + 4 * len(t) for t in units) / 64
    assert weights + kept_on_average <= full.restore_max <= weights + full.snapshot_max < held, (
        "a rank copies in the weights of what it holds and only the optimizer state it keeps as ZeRO owner"
    )
    assert full.persist_total == pytest.approx(state, rel=1e-4)
    assert state / 64 < full.snapshot_max < state and full.persist_max <= full.persist_total
    assert k1.snapshot_total == state - 15 * len(shape.moe_layers) * one_expert, "K=1: one expert per layer"
    replay = replay_bytes(MODELS["gpt350m16e"], 64, 4)
    per_ep_rank = shape.experts // MODELS["gpt350m16e"].ep * len(shape.moe_layers)  # experts a rank holds
    held = 2 * (sum(numel(t) for _, t in shape.dense_tensors()) + per_ep_rank * numel(shape.expert_tensors()))
    assert len(replay.capture_max) == 4 and replay.capture_max[0] >= held, "offset 0 copies every held weight"
    assert max(replay.capture_max) <= replay.window_max <= sum(replay.capture_max)


def test_the_projection_at_scale_takes_these_rows(rows: list[dict]) -> None:
    """The report's own rows feed the projection at scale: each control-plane figure is the row's, measured, or its
    estimate where the row is null."""
    inputs = scale_inputs({"rows": rows}, None, "gpt350m16e", 128, "cluster", {})
    for key, row in (("1", rows[1]), ("N", rows[3])):
        for field in ("plan_s", "recovery_plan_s", "coordinator_plan_s"):
            figure = inputs.figure(f"{field}[K={key}]")
            measured = row[field] is not None
            assert (figure.value, figure.label) == (
                (row[field], MEASURED) if measured else (row[f"{field}_estimate"], ESTIMATED)
            )
    table = project_mtbf(scale_costs(inputs), [7200.0, 1800.0])
    assert all(0 < p.ettr < 1 for row in table for p in row)
