"""One run of ``recipes/bench.py preset=quick`` (the ``quick_bench`` fixture of ``conftest.py`` runs it once)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from recipe_runs import run_python

QUICK_BENCH = pytest.mark.xdist_group("quick_bench")
"""Mark of the tests that use the ``quick_bench`` fixture: one pytest-xdist worker runs them all, so the
benchmark runs once per session, as without workers."""


@dataclass(frozen=True)
class BenchRun:
    """The quick benchmark's JSON result and what it printed."""

    result: Path
    stdout: str


def run_quick_bench(directory: Path) -> BenchRun:
    out = directory / "bench.json"
    cmd = ["recipes/bench.py", "preset=quick", f"out={out}", f"hydra.run.dir={directory / 'run'}",
           f"shm_root={directory}"]  # fmt: skip
    proc = run_python(cmd, timeout=600)
    return BenchRun(out, proc.stdout)
