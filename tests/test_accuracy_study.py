"""recipes/accuracy_study.py end to end at a tiny size: JSON schema, and PLT where faults lose expert updates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {"config", "seed", "plt", "plt_recomputed", "faults", "final_k", "val_loss", "recoveries", "seconds"}


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
