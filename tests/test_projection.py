"""Eq. 3/4 and ETTR (moc_lightning.tools.projection): hand-computed cases, monotonicity, validation; and the
projection at 16,384 ranks (moc_lightning.tools.scale_projection, issue 30 item 4): every input labelled measured,
estimated, computed or assumed, none made up. The scale tests failed on 86abbc6: no such projection."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from recipe_runs import ROOT, run_python

from moc_lightning.tools.mtbf_projection import project_mtbf
from moc_lightning.tools.projection import (
    ClusterScenario,
    ettr,
    expected_faults,
    lost_work,
    pec_bytes,
    project_all,
    project_full_sync,
    project_pec,
    project_two_level,
    save_overhead,
    snapshot_stall,
)
from moc_lightning.tools.scale_projection import (
    ASSUMED,
    COMPUTED,
    ESTIMATED,
    MEASURED,
    Figure,
    ScaleInputs,
    checkpoint_parts,
    load_inputs,
    scale_costs,
    scale_inputs,
)

SMALL = ClusterScenario(
    gpus=2,
    total_iterations=1000,
    iteration_seconds=1.0,
    full_bytes=4e9,
    expert_share=0.5,
    num_experts=4,
    k_snapshot=2,
    k_persist=1,
    mtbf_gpu_hours=1.0,  # cluster MTBF 1800 s
    snapshot_gbps=2.0,
    persist_gbps=1.0,
    restart_seconds=10.0,
    checkpoint_interval=100,
    snapshot_interval=10,
    persist_interval=50,
    overlap_fraction=0.5,
    memory_survival=0.5,
)
"""Round numbers: a rank holds 2e9 of the 4e9 bytes, so a full write takes 2 s at 1 GB/s."""


def test_formulas_by_hand() -> None:
    assert pec_bytes(100.0, 0.8, 2, 8) == pytest.approx(100 * (0.2 + 0.8 * 2 / 8))
    assert save_overhead(2.0, 1000, 100) == pytest.approx(20.0)
    assert lost_work(10, 0.5) == pytest.approx(2.5)
    assert snapshot_stall(0.3, 0.5) == 0.0
    assert snapshot_stall(0.8, 0.5) == pytest.approx(0.3)
    assert expected_faults(900.0, 100.0, 1000.0) == pytest.approx(1.0)  # N = 900 / (1000 - 100)
    assert ettr(90.0, 10.0) == pytest.approx(0.9)


def test_full_sync_by_hand() -> None:
    """Stall 2 s per save, 10 saves; a fault costs 10 s + 2 s read + 50 s lost."""
    p = project_full_sync(SMALL)
    faults = (1000 + 20) / (1800 - 62)
    assert p.stall_per_save == pytest.approx(2.0)
    assert p.save_seconds == pytest.approx(20.0)
    assert p.expected_faults == pytest.approx(faults)
    assert p.restart_seconds == pytest.approx(faults * 12)
    assert p.lost_seconds == pytest.approx(faults * 50)
    assert p.ettr(SMALL.useful_seconds) == pytest.approx(1000 / (1000 + 20 + faults * 62))


def test_pec_by_hand() -> None:
    """Eq. 6 with K=1 of 4: 4e9 * (0.5 + 0.5 / 4) = 2.5e9 bytes, 1.25 s per rank; the fault cost is unchanged."""
    p = project_pec(SMALL)
    assert p.stall_per_save == pytest.approx(1.25)
    assert p.save_seconds == pytest.approx(12.5)
    assert p.expected_faults == pytest.approx((1000 + 12.5) / (1800 - 62))


def test_two_level_by_hand() -> None:
    """Snapshot 1.5e9 B per rank at 2 GB/s = 0.75 s, 0.5 s hidden: 0.25 s stall every 10 iterations.

    Half the faults recover from memory (interval 10, read 1 s), half from storage (interval 50, read 2 s):
    per fault 10 + 1.5 restart and 30 / 2 = 15 s lost.
    """
    p = project_two_level(SMALL)
    faults = (1000 + 25) / (1800 - 26.5)
    assert p.stall_per_save == pytest.approx(0.25)
    assert p.save_seconds == pytest.approx(25.0)
    assert p.recovery_interval == pytest.approx(30.0)
    assert p.expected_faults == pytest.approx(faults)
    assert p.restart_seconds == pytest.approx(faults * 11.5)
    assert p.lost_seconds == pytest.approx(faults * 15)


def test_a_persist_slower_than_its_interval_stretches_the_interval() -> None:
    """K_persist=1 is 2.5e9 B, 1.25e9 per rank: at 0.01 GB/s 125 s, i.e. 125 iterations instead of 50."""
    slow = dataclasses.replace(SMALL, persist_gbps=0.01, memory_survival=0.0)
    assert project_two_level(slow).recovery_interval == pytest.approx(125.0)


@pytest.mark.parametrize("mtbf", [0.5, 2.0, 10.0])
def test_more_faults_lower_ettr(mtbf: float) -> None:
    fewer = dataclasses.replace(SMALL, mtbf_gpu_hours=mtbf * 2)
    more = dataclasses.replace(SMALL, mtbf_gpu_hours=mtbf)
    for a, b in zip(project_all(more), project_all(fewer)):
        assert a.expected_faults > b.expected_faults
        assert a.ettr(SMALL.useful_seconds) < b.ettr(SMALL.useful_seconds)


def test_smaller_checkpoints_less_save_overhead() -> None:
    assert project_pec(SMALL).save_seconds < project_full_sync(SMALL).save_seconds
    more_experts = dataclasses.replace(SMALL, k_persist=2)
    assert project_pec(SMALL).save_seconds < project_pec(more_experts).save_seconds
    smaller_state = dataclasses.replace(SMALL, full_bytes=SMALL.full_bytes / 2)
    for method in (project_full_sync, project_pec, project_two_level):
        assert method(smaller_state).save_seconds < method(SMALL).save_seconds


def test_a_fault_costlier_than_the_mtbf_never_finishes() -> None:
    hopeless = dataclasses.replace(SMALL, restart_seconds=1e6)
    p = project_full_sync(hopeless)
    assert math.isinf(p.expected_faults)
    assert p.ettr(hopeless.useful_seconds) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpus", 0),
        ("total_iterations", 0),
        ("iteration_seconds", 0.0),
        ("full_bytes", -1.0),
        ("expert_share", 1.0),
        ("mtbf_gpu_hours", 0.0),
        ("persist_gbps", 0.0),
        ("restart_seconds", -1.0),
        ("overlap_fraction", 1.5),
        ("memory_survival", -0.1),
        ("k_snapshot", 5),
        ("k_persist", 3),
        ("persist_interval", 5),
    ],
)
def test_validation_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"ClusterScenario\.{field}={value!r} "):
        dataclasses.replace(SMALL, **{field: value})


def _scale_row(k: int, plan_s: float, coordinator: float | None) -> dict:
    """A scale report row of GPT-350M-16E at 64 ranks with made-up control-plane figures (the fields the projection
    reads); ``coordinator=None``: not built, with the report's estimate."""
    row = {
        "model": "GPT-350M-16E", "world_size": 64, "k": k, "plan_s": plan_s, "plan_on_training_thread": None,
        "plan_thread": "unmeasured", "commit_s": 0.02, "recovery_exchange_bytes": 30_000, "recovery_plan_s": 0.01,
        "snapshot_collective_bytes": 1640, "coordinator_plan_s": coordinator, "metadata_bytes": 400_000,
        "coordinator_plan_s_estimate": None, "metadata_bytes_estimate": None,
    }  # fmt: skip
    if coordinator is None:
        row.update(metadata_bytes=None, coordinator_plan_s_estimate=12.5, metadata_bytes_estimate=3e6,
                   coordinator_plan_reason="not built; linear in items from 32 ranks: ~12.5 s, ~0.00 GB")  # fmt: skip
    return row


SCALE = {"rows": [_scale_row(1, 0.005, 0.03), _scale_row(16, 0.02, None)]}
BENCH = {
    "methods": [
        {"name": "moc_full", "skipped": None, "snapshot_gbps": 2.0, "persist_gbps": 0.5},
        {"name": "moc_replay", "skipped": None, "restore_memory_seconds": 0.25, "restore_memory_bytes": 1e9},
    ]
}


def _scale(**overrides: str) -> ScaleInputs:
    return scale_inputs(SCALE, BENCH, "gpt350m16e", 64, "bench", overrides)


def test_every_input_at_scale_says_where_it_comes_from() -> None:
    inputs = _scale(iteration_seconds="0.5", write_gbps="3")
    labelled = {f.name: (f.value, f.label) for f in inputs.figures}
    assert labelled["plan_s[K=1]"] == (0.005, MEASURED) and labelled["plan_s[K=N]"] == (0.02, MEASURED)
    assert labelled["coordinator_plan_s[K=1]"] == (0.03, MEASURED)
    assert labelled["coordinator_plan_s[K=N]"] == (12.5, ESTIMATED), "the report's estimate, labelled so"
    assert labelled["metadata_bytes[K=N]"] == (3e6, ESTIMATED)
    assert labelled["copy_gbps"] == (2.0, MEASURED) and labelled["restore_gbps"] == (4.0, MEASURED)
    assert labelled["write_gbps"] == (3.0, ASSUMED), "an argument replaces the bench's figure, and is assumed"
    assert labelled["iteration_seconds"] == (0.5, ASSUMED) and labelled["restart_seconds"] == (600.0, ASSUMED)
    assert labelled["plan_on_training_thread[K=1]"] == (0.0, ASSUMED), "the report could not tell"
    assert labelled["snapshot_max_bytes[K=N]"][1] == COMPUTED
    assert {f.label for f in inputs.figures} <= {MEASURED, ESTIMATED, COMPUTED, ASSUMED}
    cluster = scale_inputs(SCALE, None, "gpt350m16e", 64, "cluster", {})
    default = Figure("copy_gbps", 25.0, ASSUMED, "default: see ClusterAssumptions.copy_gbps")
    assert cluster.figure("copy_gbps") == default


def test_a_missing_report_row_or_estimate_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no scale report \(.*missing.json does not exist\)"):
        load_inputs(tmp_path / "missing.json", None, "gpt350m16e", 64, "bench", {})
    with pytest.raises(ValueError, match=r"no row of GPT-350M-16E at 128 ranks with K=1: run recipes/scale_report"):
        scale_inputs(SCALE, BENCH, "gpt350m16e", 128, "bench", {})
    unestimated = {"rows": [SCALE["rows"][0], {**SCALE["rows"][1], "coordinator_plan_s_estimate": None}]}
    with pytest.raises(ValueError, match="coordinator_plan_s is null and the report gives no coordinator_plan_s_est"):
        scale_inputs(unestimated, BENCH, "gpt350m16e", 64, "bench", {})
    with pytest.raises(ValueError, match=r"bandwidths=bench needs a bench result \(bench=FILE\)"):
        scale_inputs(SCALE, None, "gpt350m16e", 64, "bench", {})
    with pytest.raises(ValueError, match=r"unknown assumption\(s\) \['copy_speed'\]"):
        _scale(copy_speed="1")
    with pytest.raises(ValueError, match=r"ClusterAssumptions.overlap_fraction must be in \[0, 1\], got 2.0"):
        _scale(overlap_fraction="2")


def test_a_checkpoint_at_scale_by_hand() -> None:
    """Round figures: a 1 GB snapshot at 2 GB/s, half hidden by a 0.5 s overlap; 4 GB written at 1 GB/s."""
    given = {
        "snapshot_max_bytes[K=1]": 1e9, "snapshot_collective_bytes[K=1]": 5e8, "plan_s[K=1]": 3.0,
        "plan_on_training_thread[K=1]": 0.0, "persist_max_bytes[K=1]": 4e9, "persist_total_bytes[K=1]": 1e12,
        "coordinator_plan_s[K=1]": 2.0, "metadata_bytes[K=1]": 1e9, "commit_s[K=1]": 0.5,
        "recovery_exchange_bytes[K=1]": 1e9, "recovery_plan_s[K=1]": 1.5, "restore_bytes": 1e10,
        "restore_units": 100, "copy_gbps": 2.0, "write_gbps": 1.0, "restore_gbps": 5.0, "storage_gbps": 500.0,
        "network_gbps": 10.0, "collective_latency_seconds": 0.01, "overlap_fraction": 0.5, "iteration_seconds": 0.5,
    }  # fmt: skip
    inputs = ScaleInputs("m", 8, 4, tuple(Figure(n, v, ASSUMED, "test") for n, v in given.items()))
    parts = checkpoint_parts(inputs, "1")
    assert parts.stall == pytest.approx((0.5 - 0.25) + (0.01 + 0.1))  # copy less overlap, then the all-reduce
    assert parts.background == pytest.approx(3.0 + max(4.0, 2.0) + 2.0 + 1.0 + 0.5)  # plan, write, coord, .metadata
    assert parts.recover == pytest.approx((0.01 + 0.1) + 1.5 + (2.0 + 1.0 + 1.0))  # exchange, plan, restore


def test_at_scale_etr_falls_as_the_mtbf_falls() -> None:
    costs = scale_costs(_scale())
    assert costs.full_background > costs.k1_background > 0, "background work floors the checkpoint interval"
    table = project_mtbf(costs, [3.1 * 3600, 7200.0, 1800.0, 900.0])
    for method in range(3):
        ettrs = [row[method].ettr for row in table]
        assert ettrs == sorted(ettrs, reverse=True) and ettrs[0] > ettrs[-1], f"{table[0][method].method}: {ettrs}"
    assert all(p.interval >= p.interval_floor for row in table for p in row)


@pytest.mark.slow
def test_recipe_takes_bandwidths_from_a_bench_and_defaults_without_one(tmp_path: Path) -> None:
    bench = {
        "speed_of_light": {"copy_gbps": 7.0, "write_fsync_gbps": 1.5},
        "methods": [{"name": "moc_paper", "snapshot_gbps": 0.25, "persist_gbps": 0.02}],
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "scale.json").write_text(json.dumps(SCALE))
    at_scale = ["world=64", "model=gpt350m16e", "bandwidths=cluster", "scale.copy_gbps=30"]
    for bench_arg, snapshot, persist, scale_arg in (
        ("bench.json", 0.25, 1.5, "scale.json"), ("missing.json", 10.0, 0.1, "missing_scale.json")
    ):
        out = tmp_path / f"projection_{bench_arg}"
        args = [f"bench={bench_arg}", f"out={out}", f"scale={scale_arg}", *at_scale]
        proc = run_python([str(ROOT / "recipes/projection.py"), *args], timeout=120, cwd=tmp_path)
        result = json.loads(out.read_text())
        assert result["scenario"]["snapshot_gbps"] == snapshot  # moc_paper's figure, or the default
        assert result["scenario"]["persist_gbps"] == persist  # no moc_full row: speed of light, or the default
        assert len(result["methods"]) == 3 and all(0 < m["ettr"] < 1 for m in result["methods"])
        assert "## ETTR against MTBF at 64 ranks (full, PEC + Dynamic-K, replay)" in proc.stdout
    unavailable = result["scale_sweep"]
    assert unavailable == {"unavailable": "no scale report (missing_scale.json does not exist): the projection at "
                           "scale takes its control-plane costs from the JSON of recipes/scale_report.py"}  # fmt: skip
    at_64 = json.loads((tmp_path / "projection_bench.json").read_text())["scale_sweep"]
    assert {"model", "world_size", "inputs", "parts", "costs", "mtbf"} <= at_64.keys()
    copy = next(f for f in at_64["inputs"] if f["name"] == "copy_gbps")
    assert (copy["value"], copy["label"], copy["source"]) == (30.0, ASSUMED, "argument")
    assert [set(row["methods"]) for row in at_64["mtbf"]] == [{"full", "pec+dynamic_k", "replay"}] * 4
    assert set(at_64["parts"]) == {"K=1", "K=N", "replay"}
