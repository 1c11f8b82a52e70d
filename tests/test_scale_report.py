"""The scale report (issue 30, item 1) at small simulated sizes: every field of every row is there (a null one says
why), and the figures grow as the report says they do (DESIGN.md, Scale): a recovery's exchange at most linearly in
world size (O(units) per rank), a snapshot's collective not at all; one rank's plan, in time and memory, at most
linearly (O(units + ranks))."""

from __future__ import annotations

import pytest

from moc_lightning.tools.scale_report import growth, markdown, report, verdicts

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
            if row[f"{field}_s"] is None:
                assert "linear in items" in row[f"{field}_reason"]
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
