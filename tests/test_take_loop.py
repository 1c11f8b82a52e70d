"""``scripts/take_loop.py``, whose figures ``docs/performance.md`` cites, still runs: a few calls of each timed step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_hot_loop_times_every_step_of_a_snapshots_preparation(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("take_loop", ROOT / "scripts" / "take_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CALLS = 3
    module.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("21 units, 116 tensors"), lines[0]
    timed = [line for line in lines[1:] if line.endswith(" us")]
    assert len(timed) == 6 and all(float(line.split()[-2]) > 0 for line in timed), lines
