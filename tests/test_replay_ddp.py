"""``checkpoint.mode=replay`` under ``trainer.data_parallel=ddp`` on 2 and 4 ranks (gloo, CPU), with and without
expert parallelism: after a crash at a random step, a new Trainer on every rank agrees on the newest window that all
ranks completed, replays it together through the DDP-wrapped ``training_step``, and every rank lands bitwise on the
uninterrupted run's state (every parameter, buffer and optimizer tensor), then trains on bitwise identically to
``max_steps``. The resume runs in the crashed fit's processes (a spawn costs tens of seconds on the test machine);
nothing of the crashed Trainer, module or optimizer carries over."""

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
from moc_lightning.replay_driver import window_object

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


class FirstStep(Recorder):
    """The state as the first step of a fit begins: after MoC's replay (Lightning calls a checkpoint callback's
    ``on_train_start`` after the other callbacks')."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.start_step is None:
            self.start_step = trainer.global_step
            self.start = self._tensors(trainer, module)


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))


def _fit(root: Path, devices: int, ep: int, callbacks: list[L.Callback], **kw: Any) -> MoCCheckpoint:
    moc = MoCCheckpoint(_config(root))
    callbacks = [moc, RankSeed(), *callbacks]
    trainer = cpu_trainer(root / "run", MAX_STEPS, callbacks, devices=devices, gradient_clip_val=CLIP, **kw)
    trainer.fit(GPTMoEModule(NOISY, ep=ep, seed=0), datamodule=datamodule(NOISY), ckpt_path=moc.resume_target())
    return moc


def _runs(
    rank: int, world_size: int, root: str, ep: int, crash: int, lose_newest: bool, precision: str
) -> dict[str, Any]:
    """The uninterrupted run (its state at every window's end and at ``max_steps``); a run that crashes after step
    ``crash`` on every rank (with ``lose_newest``, rank 1 lost its newest window: it was killed before writing
    it); its resume in a new Trainer (the state as its first step begins, and at ``max_steps``)."""
    straight = Recorder(at=(*range(WINDOW, MAX_STEPS, WINDOW), MAX_STEPS), model=NOISY)
    _fit(Path(root) / "straight", world_size, ep, [straight], precision=precision)
    try:
        _fit(Path(root) / "faulty", world_size, ep, [Recorder(crash_after=crash, model=NOISY)], precision=precision)
    except Crash:
        pass
    if lose_newest and rank == 1:
        (Path(root) / "faulty" / "ckpt" / window_object(rank, crash // WINDOW - 1)).unlink()
    torch.distributed.barrier()
    resumed = FirstStep(at=(MAX_STEPS,), model=NOISY)
    logger = CSVLogger(Path(root) / "faulty" / "logs", name="", version="")
    moc = _fit(Path(root) / "faulty", world_size, ep, [resumed], logger=logger, precision=precision)
    return {
        "straight": straight.states,
        "report": asdict(moc.replay_report) if moc.replay_report is not None else None,
        "start_step": resumed.start_step,
        "start": resumed.start,
        "final": resumed.states[MAX_STEPS],
    }


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "ep", "lose_newest", "precision"),
    [(2, 1, False, "32-true"), (2, 2, False, "bf16-mixed"), (4, 2, True, "32-true")],
    ids=["2_ranks_ddp", "2_ranks_ep2_bf16_mixed", "4_ranks_ep2_rank1_lost_its_newest_window"],
)
def test_ranks_replay_the_same_window_and_end_bitwise_on_the_uninterrupted_state(
    tmp_path: Path, world_size: int, ep: int, lose_newest: bool, precision: str
) -> None:
    """``lose_newest``: the ranks agree on the window before the newest, the newest one rank 1 completed."""
    crash = _crash_step(2 * WINDOW if lose_newest else WINDOW + 1)
    ranks = run_ranks(
        _runs, world_size, tmp_path, str(tmp_path), ep, crash, lose_newest, precision, init_process_group=False
    )

    resume_step = crash // WINDOW * WINDOW - (WINDOW if lose_newest else 0)
    for rank, run in enumerate(ranks):
        report = run["report"]
        print(f"rank {rank}: {report}")
        assert report is not None and report["resume_step"] == resume_step == run["start_step"]
        assert report["replay_iterations"] == WINDOW - 1 and report["plt"] == 0.0
        assert _differing(run["start"], run["straight"][resume_step]) == [], f"rank {rank} after the replay"
        assert _differing(run["final"], run["straight"][MAX_STEPS]) == [], f"rank {rank} at max_steps"
    logged = (tmp_path / "faulty" / "logs" / "metrics.csv").read_text()
    assert "moc/replay_iterations" in logged and "moc/replay_seconds" in logged


@pytest.mark.parametrize("data_parallel", ["zero2"])
def test_replay_refuses_a_data_parallel_mode_it_cannot_replay_by_name(tmp_path: Path, data_parallel: str) -> None:
    recorder = Recorder()
    moc = MoCCheckpoint(_config(tmp_path))
    trainer = cpu_trainer(tmp_path / "run", MAX_STEPS, [moc, recorder])
    with pytest.raises(ValueError, match=None) as err:
        trainer.fit(GPTMoEModule(MODEL, data_parallel=data_parallel), datamodule=datamodule())
    assert f"checkpoint.mode=replay with trainer.data_parallel={data_parallel}" in str(err.value)
    assert "use checkpoint.mode=pec otherwise" in str(err.value)
    assert recorder.start_step is None, "refused before training started"
