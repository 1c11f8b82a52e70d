"""notebooks/moc_analysis.ipynb: valid nbformat 4, and its code cells, run in order as one script on the quick
outputs of the recipes, write every figure."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from quick_bench import QUICK_BENCH, BenchRun
from recipe_runs import ROOT, run_python

NOTEBOOK = ROOT / "notebooks/moc_analysis.ipynb"
FIGURES = ("checkpoint_size_vs_k", "stall_and_overhead", "speed_of_light", "plt_vs_k_and_interval",
           "val_loss_per_method", "ettr_vs_mtbf")  # fmt: skip
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def test_notebook_is_nbformat_4_without_outputs() -> None:
    notebook = load_notebook()
    assert (notebook["nbformat"], notebook["nbformat_minor"]) == (4, 5)
    assert notebook["metadata"]["kernelspec"]["language"] == "python"
    kinds = [cell["cell_type"] for cell in notebook["cells"]]
    assert set(kinds) == {"markdown", "code"}
    ids = [cell["id"] for cell in notebook["cells"]]
    assert len(set(ids)) == len(ids), "nbformat 4.5 needs a unique id per cell"
    for cell in notebook["cells"]:
        assert isinstance(cell["metadata"], dict) and all(isinstance(line, str) for line in cell["source"])
        if cell["cell_type"] == "code":
            assert cell["execution_count"] is None and cell["outputs"] == []
            compile("".join(cell["source"]), str(NOTEBOOK), "exec")


def recipe(*args: str) -> None:
    run_python(args, timeout=300)


@pytest.mark.slow
@QUICK_BENCH
def test_notebook_plots_every_figure_from_the_quick_outputs(tmp_path: Path, quick_bench: BenchRun) -> None:
    shutil.copy(quick_bench.result, tmp_path / "bench.json")
    # the smallest study that fills every figure: a few configurations and the sweep (26 s against 49 s for the
    # defaults at steps=24 on the reference machine); the figures' content is the analysis's, not this test's
    recipe("recipes/accuracy_study.py", f"out={tmp_path / 'accuracy.json'}", "steps=12", "fault_every=5",
           "val_batches=1", "sweep=1", "configs=no_faults,pec_k1_persist_only,replay")  # fmt: skip
    recipe("recipes/sharding_report.py", f"out={tmp_path / 'sharding.json'}", "plan_ranks=64")
    script = tmp_path / "moc_analysis.py"
    cells = [cell for cell in load_notebook()["cells"] if cell["cell_type"] == "code"]
    script.write_text("\n\n".join("".join(cell["source"]) for cell in cells))

    env = {**os.environ, "MOC_ANALYSIS_DIR": str(tmp_path)}
    run_python([str(script)], timeout=300, env=env)
    for name in FIGURES:
        png = tmp_path / "figures" / f"{name}.png"
        assert png.stat().st_size > 0 and png.read_bytes().startswith(PNG_SIGNATURE), png
