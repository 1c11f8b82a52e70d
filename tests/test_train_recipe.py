"""The training recipe end to end: 2 CPU processes, expert-parallel, CSV metrics, loss going down."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from recipe_runs import run_python
from torch.distributed.checkpoint import FileSystemReader

from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.units import parse_unit


def _read_metrics(run_dir: Path) -> list[dict[str, str]]:
    files = list(run_dir.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {run_dir}, found {files}"
    with files[0].open() as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


@pytest.mark.slow
def test_train_recipe_two_processes_learns_and_writes_pec_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    cmd = [
        "recipes/train.py",
        "model=tiny",
        "trainer.devices=2",
        "trainer.max_steps=60",
        f"hydra.run.dir={run_dir}",
        "checkpoint.k_snapshot=2",
        "checkpoint.k_persist=1",
        "checkpoint.every_n_train_steps=10",
        "checkpoint.persist_every_n_snapshots=2",
        "checkpoint.storage.backend=filesystem",
        f"checkpoint.storage.url={ckpt.as_uri()}",
        f"checkpoint.shm_root={tmp_path / 'shm'}",
    ]
    proc = run_python(cmd, timeout=180)
    rows = _read_metrics(run_dir)
    train_loss = _column(rows, "train_loss")
    assert len(train_loss) >= 5
    assert train_loss[-1] < train_loss[0] - 1.0, f"training loss did not fall: {train_loss}"
    assert _column(rows, "val_loss"), "validation loss is logged"
    assert "metrics.csv" in proc.stdout

    # Snapshots at 10, 20, ..., 60; every second one persisted (10, 30, 50) and the last step wholly (60), each a
    # DCP checkpoint; retention keeps 3, and 10 no longer holds the newest version of any unit.
    manifest = Manifest.from_json((ckpt / "manifest.json").read_bytes())
    assert [r.step for r in manifest.records] == [30, 50, 60]
    for record in manifest.records:
        metadata = FileSystemReader(str(ckpt / record.name)).read_metadata()
        keys = set(metadata.state_dict_metadata)
        own = {key for key in keys if key.startswith("rank_state/")}
        assert own == {"rank_state/0", "rank_state/1"}, "each rank's own trainer state (RNG, data position)"
        assert {parse_unit(key).key for key in keys - own} == set(record.units)
        experts = sum(key.startswith("expert/") for key in record.units)
        assert experts == (16 if record.step == 60 else 2), "k_persist=1 of each of 2 MoE layers; all 8 at the end"


@pytest.mark.slow
def test_train_recipe_runs_under_torchrun(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--standalone",
        "recipes/train.py",
        "trainer.devices=2",
        "trainer.max_steps=12",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2",
        f"hydra.run.dir={run_dir}",
        f"checkpoint.shm_root={tmp_path / 'shm'}",
    ]
    proc = run_python(cmd, timeout=180)
    assert "finished 12 steps" in proc.stdout
    assert _column(_read_metrics(run_dir), "val_loss")
