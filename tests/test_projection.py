"""Eq. 3/4 and ETTR (moc_lightning.tools.projection): hand-computed cases, monotonicity, validation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from recipe_runs import ROOT, run_python

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


@pytest.mark.slow
def test_recipe_takes_bandwidths_from_a_bench_and_defaults_without_one(tmp_path: Path) -> None:
    bench = {
        "speed_of_light": {"copy_gbps": 7.0, "write_fsync_gbps": 1.5},
        "methods": [{"name": "moc_paper", "snapshot_gbps": 0.25, "persist_gbps": 0.02}],
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    for bench_arg, snapshot, persist in (("bench.json", 0.25, 1.5), ("missing.json", 10.0, 0.1)):
        out = tmp_path / f"projection_{bench_arg}"
        run_python([str(ROOT / "recipes/projection.py"), f"bench={bench_arg}", f"out={out}"], timeout=120, cwd=tmp_path)
        result = json.loads(out.read_text())
        assert result["scenario"]["snapshot_gbps"] == snapshot  # moc_paper's figure, or the default
        assert result["scenario"]["persist_gbps"] == persist  # no moc_full row: speed of light, or the default
        assert len(result["methods"]) == 3 and all(0 < m["ettr"] < 1 for m in result["methods"])
