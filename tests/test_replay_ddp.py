"""``checkpoint.mode=replay`` under ``trainer.data_parallel=ddp`` on 2 ranks (gloo, CPU), with and without expert
parallelism: after a crash at a random step, new processes agree on the newest window every rank completed, replay
it together through the DDP-wrapped ``training_step``, and every rank lands bitwise on the uninterrupted run's
state (every parameter, buffer and optimizer tensor), then trains on bitwise identically to ``max_steps``."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning.pytorch.loggers import CSVLogger
from lightning_run import MODEL, Crash, Recorder, cpu_trainer, datamodule, moc_config

from moc_lightning.callback import MoCCheckpoint
from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.models.lightning import GPTMoEModule

MAX_STEPS = 10
WINDOW = 3
CLIP = 0.05
"""Small enough that the module's global-norm clipping (a collective under EP) acts."""
NOISY = replace(MODEL, gate_noise=0.1)
"""Noisy gating: each iteration draws from its rank's RNG streams, which the replay must repeat."""


def _crash_step(low: int) -> int:
    """A seeded random step in ``[low, MAX_STEPS)`` (``MOC_REPLAY_SEED`` picks another), printed."""
    seed = int(os.environ.get("MOC_REPLAY_SEED", "14"))
    step = random.Random(f"{seed}/{low}").randrange(low, MAX_STEPS)
    print(f"seed {seed}: crash after step {step}")
    return step


class RankSeed(L.Callback):
    """Per-rank RNG streams that differ (the model's initialisation seeds its own)."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))


def _fit(root: Path, ep: int, callbacks: list[L.Callback], **kw: Any) -> MoCCheckpoint:
    moc = MoCCheckpoint(_config(root))
    trainer = cpu_trainer(root / "run", MAX_STEPS, [moc, RankSeed(), *callbacks], devices=2, gradient_clip_val=CLIP, **kw)
    trainer.fit(GPTMoEModule(NOISY, ep=ep, seed=0), datamodule=datamodule(NOISY), ckpt_path=moc.resume_target())
    return moc


def _straight_then_crash(rank: int, world_size: int, root: str, ep: int, crash: int) -> dict[str, Any]:
    """The uninterrupted run (its state at every window's end and at ``max_steps``), then a run that crashes."""
    straight = Recorder(at=(*range(WINDOW, MAX_STEPS, WINDOW), MAX_STEPS), model=NOISY)
    _fit(Path(root) / "straight", ep, [straight])
    try:
        _fit(Path(root) / "faulty", ep, [Recorder(crash_after=crash, model=NOISY)])
    except Crash:
        pass
    return straight.states


def _resume(rank: int, world_size: int, root: str, ep: int) -> dict[str, Any]:
    resumed = Recorder(at=(MAX_STEPS,), model=NOISY)
    logger = CSVLogger(Path(root) / "faulty" / "logs", name="", version="")
    moc = _fit(Path(root) / "faulty", ep, [resumed], logger=logger)
    return {
        "report": asdict(moc.replay_report) if moc.replay_report is not None else None,
        "start_step": resumed.start_step,
        "start": resumed.start,
        "final": resumed.states[MAX_STEPS],
    }


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2], ids=["ddp", "ddp_ep2"])
def test_two_ranks_replay_the_same_window_and_end_bitwise_on_the_uninterrupted_state(tmp_path: Path, ep: int) -> None:
    crash = _crash_step(WINDOW + 1)
    straight = run_ranks(_straight_then_crash, 2, tmp_path, str(tmp_path), ep, crash, init_process_group=False)
    resumed = run_ranks(_resume, 2, tmp_path, str(tmp_path), ep, init_process_group=False)

    expected_end = crash // WINDOW * WINDOW
    for rank, (want, got) in enumerate(zip(straight, resumed)):
        report = got["report"]
        print(f"rank {rank}: {report}")
        assert report is not None and report["resume_step"] == expected_end == got["start_step"]
        assert report["replay_iterations"] == WINDOW - 1 and report["plt"] == 0.0
        assert _differing(got["start"], want[expected_end]) == [], f"rank {rank} after the replay"
        assert _differing(got["final"], want[MAX_STEPS]) == [], f"rank {rank} at max_steps"
    logged = (tmp_path / "faulty" / "logs" / "metrics.csv").read_text()
    assert "moc/replay_iterations" in logged and "moc/replay_seconds" in logged
