"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest
from quick_bench import BenchRun, run_quick_bench


@pytest.fixture(scope="session")
def quick_bench(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    """The quick benchmark, run once per session: the bench test checks it, the notebook test plots it."""
    return run_quick_bench(tmp_path_factory.mktemp("quick_bench"))
