"""ETTR against the job's MTBF for full checkpoints, PEC with Dynamic-K and replay mode, from a bench's measured
costs (issue 14, item 4). Failed on b4ba765: no such projection."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from recipe_runs import ROOT, run_python

from moc_lightning.tools.mtbf_projection import (
    CheckpointCosts,
    accumulated_plt,
    background_floor,
    parse_duration,
    project_full,
    project_mtbf,
    project_pec_dynamic_k,
    project_replay,
    young_interval,
)

COSTS = CheckpointCosts(
    iteration_seconds=1.0, num_experts=16, full_stall=0.4, full_recover=4.0, k1_stall=0.1, k1_recover=3.0,
    replay_stall_per_iteration=0.03, replay_recover=6.0, replay_seconds=2.5, replay_window=4,
)  # fmt: skip


def test_young_interval_and_accumulated_plt_by_hand() -> None:
    assert young_interval(0.5, 1.0, 400.0) == 20  # sqrt(2 * 0.5 * 400) = 20 s of 1 s iterations
    assert young_interval(0.0, 1.0, 400.0) == 1
    # a fault every 600 s of 1 s iterations, checkpoints every 10, K=1 of 16: experts 7.5 intervals stale on average
    assert accumulated_plt(1.0, 10, 1, 16, 600.0) == pytest.approx(10 * 15 / 2 / 600)
    assert accumulated_plt(1.0, 10, 16, 16, 600.0) == 0


def test_replay_loses_no_tokens_and_redoes_half_a_window() -> None:
    mtbf = 600.0
    point = project_replay(COSTS, mtbf)
    assert point.plt == 0 and point.interval == 1 and point.k is None
    assert point.per_fault_seconds == pytest.approx(6.0 + 1.5 * 1.03)  # restore + replay, then (W-1)/2 iterations
    busy = 1.03
    assert point.ettr == pytest.approx(1.0 / busy * (1 - point.per_fault_seconds / mtbf))


def test_dynamic_k_doubles_k_until_the_plt_fits_and_full_saves_every_expert() -> None:
    rare, frequent = project_pec_dynamic_k(COSTS, 3.1 * 3600), project_pec_dynamic_k(COSTS, 600.0)
    assert rare.k < frequent.k <= 16
    for point in (rare, frequent):
        assert point.plt <= 0.0375 or point.k == 16
        assert math.log2(point.k).is_integer()
    full = project_full(COSTS, 600.0)
    assert (full.k, full.plt) == (16, 0)
    assert full.stall_per_iteration == pytest.approx(0.4 / full.interval)


def test_background_work_floors_the_interval() -> None:
    """One persist in flight at most: a checkpoint whose background work takes 30 s of 1 s iterations cannot come
    sooner than every 30, however short Young's interval (sqrt(2 * 0.4 * 600) = 22 s here); PEC's is interpolated
    in K. Failed on 86abbc6: no background in the costs."""
    assert (background_floor(0.0, 1.0), background_floor(29.5, 1.0), background_floor(30.0, 0.5)) == (1, 30, 60)
    assert (project_full(COSTS, 600.0).interval, project_full(COSTS, 600.0).interval_floor) == (22, 1)
    floored = dataclasses.replace(COSTS, full_background=30.0, k1_background=15.0)
    full = project_full(floored, 600.0)
    assert (full.interval, full.interval_floor) == (30, 30)
    assert full.stall_per_iteration == pytest.approx(0.4 / 30)
    assert floored.pec(16) == (0.4, 4.0, 30.0) and floored.pec(1) == (0.1, 3.0, 15.0)
    rare = project_full(floored, 3.1 * 3600)
    assert rare.interval > rare.interval_floor == 30, "where Young's is longer, it stands"


def test_a_fault_costlier_than_the_mtbf_leaves_nothing() -> None:
    slow = dataclasses.replace(COSTS, replay_recover=700.0)
    assert project_replay(slow, 600.0).ettr == 0


def test_every_method_at_every_mtbf_side_by_side() -> None:
    table = project_mtbf(COSTS, [600.0, 1800.0, 7200.0])
    assert [[p.method for p in row] for row in table] == [["full", "pec+dynamic_k", "replay"]] * 3
    for method in range(3):
        ettrs = [row[method].ettr for row in table]
        assert ettrs == sorted(ettrs) and all(0 < e < 1 for e in ettrs), "rarer faults, higher ETTR"


def test_durations_parse() -> None:
    assert [parse_duration(d) for d in ("10m", "30m", "2h", "3.1h", "45s")] == [600, 1800, 7200, 3.1 * 3600, 45]
    with pytest.raises(ValueError, match=r"mtbf duration '10x': use a number with s, m or h"):
        parse_duration("10x")


def _bench() -> dict:
    """A bench result with the rows the projection reads (made-up figures)."""
    return {
        "baseline_iter_ms": 500.0, "model": {"num_experts": 16}, "replay_window": 4,
        "methods": [
            {"name": "moc_full", "skipped": None, "stall_ms_mean": 40.0, "recover_seconds": 3.0},
            {"name": "moc_k1", "skipped": None, "stall_ms_mean": 10.0, "recover_seconds": 2.0},
            {"name": "moc_replay", "skipped": None, "stall_ms_per_iteration": 5.0, "recover_seconds": 4.0,
             "replay_seconds": 1.5},
        ],
    }  # fmt: skip


def test_costs_come_from_a_bench_result_and_name_what_is_missing() -> None:
    bench = _bench()
    costs = CheckpointCosts.from_bench(bench)
    assert (costs.iteration_seconds, costs.full_stall, costs.k1_stall) == (0.5, 0.04, 0.01)
    assert (costs.replay_stall_per_iteration, costs.replay_recover, costs.replay_seconds) == (0.005, 4.0, 1.5)
    assert (costs.replay_window, costs.num_experts) == (4, 16)
    bench["methods"][2]["paired_overhead_pct"] = 3.0  # 15 ms of a 500 ms iteration: more than the 5 ms stall
    assert CheckpointCosts.from_bench(bench).replay_stall_per_iteration == pytest.approx(0.015)
    bench["methods"][2]["paired_overhead_pct"] = -2.0  # noise: the stall stands
    assert CheckpointCosts.from_bench(bench).replay_stall_per_iteration == 0.005
    del bench["replay_window"]
    with pytest.raises(ValueError, match=r"does not say moc_replay's window \(replay_window\)"):
        CheckpointCosts.from_bench(bench)
    del bench["methods"][2]
    with pytest.raises(ValueError, match="the bench result has no measured moc_replay row"):
        CheckpointCosts.from_bench(bench)


@pytest.mark.slow
def test_recipe_prints_the_mtbf_table_from_a_bench(tmp_path: Path) -> None:
    bench = _bench() | {"speed_of_light": {"copy_gbps": 7.0}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "projection.json"
    proc = run_python([str(ROOT / "recipes/projection.py"), "bench=bench.json", f"out={out}"], 120, cwd=tmp_path)
    assert "| MTBF | ETTR full | ETTR pec+dynamic_k | ETTR replay |" in proc.stdout
    sweep = json.loads(out.read_text())["mtbf_sweep"]
    assert [row["mtbf_seconds"] for row in sweep] == [600, 1800, 7200, pytest.approx(3.1 * 3600)]
    assert all(set(row["methods"]) == {"full", "pec+dynamic_k", "replay"} for row in sweep)
