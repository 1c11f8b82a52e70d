"""Running a recipe, or any script of the repository, as a user would: in its own Python process, from the root."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(
    args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd`` (the repository root unless given), its output captured; a failure shows the tail of
    what it printed."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
