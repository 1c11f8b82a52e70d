"""``scripts/take_loop.py``, whose figures ``docs/performance.md`` cites, still runs: a few calls of each timed step,
hot and with the caches evicted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_loop_times_every_step_of_a_snapshots_preparation_hot_and_cold(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("take_loop", ROOT / "scripts" / "take_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CALLS = 3
    module.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("21 units, 116 tensors"), lines[0]
    timed = [line.split() for line in lines[1:] if line.endswith("x")]
    assert len(timed) == 9, lines
    for words in timed:
        hot, cold = float(words[words.index("hot") + 1]), float(words[words.index("cold") + 1])
        ratio = float(words[-1].removesuffix("x"))  # of the unrounded medians
        assert hot > 0 and cold > 0 and ratio == pytest.approx(cold / hot, rel=0.1, abs=0.1), words
