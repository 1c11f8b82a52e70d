"""recipes/accuracy_study.py end to end at a tiny size: JSON schema, and PLT where faults lose expert updates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {
    "config", "seed", "plt", "plt_recomputed", "faults", "final_k", "val_loss", "recoveries", "seconds",
    "replay_iterations",
}


@pytest.mark.slow
def test_tiny_study_writes_the_schema_and_measures_plt(tmp_path: Path) -> None:
    out = tmp_path / "study.json"
    command = [
        sys.executable, str(ROOT / "recipes/accuracy_study.py"), f"out={out}", "steps=40", "fault_every=12",
        "val_batches=2", "configs=no_faults,pec_k1_persist_only",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())

    assert result["settings"]["fault_steps"] == [15, 27, 39]  # 12+3, 24+3, 36+3: none a snapshot step (every 10)
    assert result["plt_matches_recomputed"] is True
    runs = {row["config"]: row for row in result["runs"]}
    assert set(runs) == {"no_faults", "pec_k1_persist_only"}
    for row in runs.values():
        assert set(row) == RUN_KEYS
        assert row["seed"] == 0 and row["val_loss"] > 0
        assert row["plt"] == pytest.approx(row["plt_recomputed"], abs=1e-9)
    assert runs["no_faults"]["plt"] == 0 and runs["no_faults"]["faults"] == 0
    pec = runs["pec_k1_persist_only"]
    assert pec["plt"] > 0 and pec["faults"] == 3
    assert pec["final_k"] == {"snapshot": 1, "persist": 1}
    assert all(set(r["sources"]) <= {"storage", "none"} for r in pec["recoveries"]), "memory was cleared"


@pytest.mark.slow
def test_sweep_runs_storage_only_pec_over_k_and_interval(tmp_path: Path) -> None:
    out = tmp_path / "study.json"
    command = [
        sys.executable, str(ROOT / "recipes/accuracy_study.py"), f"out={out}", "steps=24", "fault_every=10",
        "fault_offset=0", "persist_every_n_snapshots=1", "val_batches=1", "configs=", "sweep=1",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())

    assert result["runs"] == [] and result["plt_matches_recomputed"] is True
    rows = {(row["k"], row["every_n_train_steps"]): row for row in result["sweep"]}
    assert set(rows) == {(k, n) for k in (1, 2, 4) for n in (5, 10)}
    assert all(row["fault_steps"] == [11, 21] for row in rows.values())  # 10 and 20 are snapshot steps: one later
    for (k, interval), row in rows.items():
        assert set(row) == RUN_KEYS | {"k", "every_n_train_steps", "fault_steps"}
        assert row["config"] == f"pec_k{k}_every{interval}" and row["final_k"] == {"snapshot": k, "persist": k}
        assert row["faults"] == 2 and all(set(r["sources"]) <= {"storage", "none"} for r in row["recoveries"])
        assert row["plt"] == pytest.approx(row["plt_recomputed"], abs=1e-9)


@pytest.mark.slow
def test_replay_under_faults_ends_on_the_no_fault_loss_exactly(tmp_path: Path) -> None:
    """``replay`` (checkpoint.mode=replay) loses no tokens: after a fault every fault_every steps, its final validation
    loss is the no-fault run's (same seed), equal, not close; the table prints its PLT (0) and replayed iterations."""
    out = tmp_path / "study.json"
    command = [
        sys.executable, str(ROOT / "recipes/accuracy_study.py"), f"out={out}", "steps=20", "fault_every=7",
        "val_batches=1", "batch_size=4", "configs=no_faults,replay",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())

    assert result["settings"]["fault_steps"] == [11, 17]  # 7+3, 14+3; 10 is a snapshot step: one later
    runs = {row["config"]: row for row in result["runs"]}
    replay, reference = runs["replay"], runs["no_faults"]
    assert set(replay) == RUN_KEYS
    assert replay["faults"] == 2 and replay["plt"] == 0 and replay["plt_recomputed"] == 0
    assert replay["replay_iterations"] > 0 and reference["replay_iterations"] == 0
    assert all(r["plt"] == 0 and r["replay_iterations"] > 0 for r in replay["recoveries"])
    assert replay["val_loss"] == reference["val_loss"], "replay must end on the fault-free state exactly"
    assert result["replay_equals_no_faults"] is True
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| replay |"))
    assert "| 0.000% |" in row and f"| {replay['replay_iterations']} |" in row
