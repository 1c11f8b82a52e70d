"""A checkpoint written before the package was split into subpackages (issue 29) resumes bitwise with today's code:
the on-disk format, the manifest and the recovery's choice of sources did not change with the import paths."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from lightning_run import Recorder, fit, moc_config

from moc_lightning.config import CheckpointConfig
from moc_lightning.models import GPTMoEConfig

FIXTURE = Path(__file__).parent / "fixtures" / "pre_restructure"
MODEL = GPTMoEConfig(block_size=32, n_layer=2, n_embd=32, n_head=2, num_experts=4)
"""The model the fixture was recorded with (its README)."""
RECORDED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The CPU kernels the fixture was recorded with (an AVX2 machine). On an AVX-512 machine PyTorch's own kernels and
oneDNN's sum in other orders, so the steps after the resume differ in their last bits (118 tensors at step 12 on
session 29's machine, the restore itself bitwise); capping both at AVX2 gives the recorded bits back."""


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, k_snapshot=1, k_persist=1, every_n_train_steps=2, persist_every_n_snapshots=2)


def _digests(states: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        key: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for key, t in sorted(states.items())
    }


def test_a_checkpoint_from_before_the_split_resumes_bitwise(tmp_path: Path) -> None:
    """Run under :data:`RECORDED_KERNELS`: in a pytest of its own unless this process already is (the kernels are
    chosen when torch is imported)."""
    if any(os.environ.get(name) != value for name, value in RECORDED_KERNELS.items()):
        test = f"{Path(__file__).resolve()}::test_a_checkpoint_from_before_the_split_resumes_bitwise"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'pinned'}", test],
            env={**os.environ, **RECORDED_KERNELS}, capture_output=True, text=True, timeout=600,
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        assert run.returncode == 0, f"under {RECORDED_KERNELS}:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
        return
    _resume_and_hold_to_the_fixture(tmp_path)


def _resume_and_hold_to_the_fixture(tmp_path: Path) -> None:
    expected = json.loads((FIXTURE / "expected.json").read_text())
    shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt")
    (tmp_path / "shm").mkdir()
    resumed = Recorder(at=(12,), model=MODEL)
    moc = fit(tmp_path, _config(tmp_path), 12, [resumed], model=MODEL)
    assert moc.recovery.resume_step == expected["resume_step"] == 6
    sources = {unit: source["step"] for unit, source in moc.recovery.sources.items()}
    assert sources == {unit: source["step"] for unit, source in expected["sources"].items()}
    assert {2, 6} <= set(sources.values()), "the fixture's recovery takes experts from both partial persists"
    for name, states in (("restored", resumed.start), ("step_12", resumed.states[12])):
        digests = _digests(states)
        assert digests.keys() == expected[name].keys(), f"{name}: other tensors than before the split"
        differ = [key for key, value in digests.items() if value != expected[name][key]]
        assert not differ, f"{name}: {len(differ)} tensors differ from the resume before the split, e.g. {differ[:3]}"
