"""One fit of the benchmark's model, as every method runs it, and a resume from a method's newest checkpoint
(:func:`recover_seconds`); figures agreed over ranks (the slowest rank's)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch.distributed as dist

from moc_lightning.data import LMDataModule
from moc_lightning.jobs.training import build_trainer
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.replay.driver import ReplayReport
from moc_lightning.tools.bench.config import GB, BenchConfig, train_config
from moc_lightning.tools.bench.timing import AlignRanks, StepClock

if TYPE_CHECKING:  # a method resumes through fit(): methods import this module
    from moc_lightning.tools.bench.methods import Method


def no_setup(trainer: L.Trainer) -> None:
    """No Trainer set-up needed to resume."""


@dataclass
class Fit:
    """A finished ``trainer.fit`` and when it began (before the module was built)."""

    trainer: L.Trainer
    clock: StepClock
    started: float


def fit(
    cfg: BenchConfig,
    run_dir: Path,
    callbacks: list[L.Callback],
    setup: Callable[[L.Trainer], None] = no_setup,
    ckpt_path: str | None = None,
    resuming: bool = False,
) -> Fit:
    """Train from the seed (every run sees the same initial weights and batches), or resume and take one step."""
    started = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = GPTMoEModule(cfg.model, cfg.optim, seed=cfg.seed, data_parallel=cfg.data_parallel)
    data = LMDataModule(cfg.data, block_size=cfg.model.block_size, vocab_size=cfg.model.vocab_size)
    clock = StepClock(stop_after_first=resuming)
    max_steps = cfg.steps + 1 if resuming else cfg.steps  # a resumed run goes one step past the checkpoint
    trainer = build_trainer(train_config(cfg, max_steps), run_dir, [AlignRanks(), *callbacks, clock])
    setup(trainer)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return Fit(trainer, clock, started)


def recover_seconds(cfg: BenchConfig, method: Method) -> float:
    """From building a fresh module and Trainer to the start of the first step after restoring (the slowest
    rank's)."""
    callbacks, setup, ckpt_path = method.resume()
    run = fit(cfg, method.root / "resume", callbacks, setup, ckpt_path, resuming=True)
    return round(slowest([run.clock.starts[0] - run.started])[0], 3)


def restore_figures(report: ReplayReport, gbps: float) -> tuple[float, int, float, float]:
    """A replay recovery's restore seconds, restored bytes, restore time over the time of moving those bytes at
    ``gbps`` (its speed of light), and replay seconds: per figure the slowest rank's (each rank's ratio is against
    its own bytes and bound)."""
    light_seconds = report.restored_bytes / (gbps * GB)
    seconds, nbytes, ratio, replay = slowest(
        [report.restore_seconds, report.restored_bytes, report.restore_seconds / light_seconds, report.replay_seconds]
    )
    return round(seconds, 6), int(nbytes), round(ratio, 3), round(replay, 3)


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(values: list[Any]) -> list[list[Any]]:
    """Every rank's ``values``, in rank order (``[values]`` in one process)."""
    if not dist.is_initialized():
        return [values]
    every: list[list[Any]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, values)
    return every


def slowest(values: list[float]) -> list[float]:
    """Per position, the largest of every rank's ``values``: synchronous training waits for the slowest rank."""
    return [max(column) for column in zip(*gather(values))]


def release_memory() -> None:
    """Free the last run's tensors and hand the memory back to the OS.

    glibc keeps freed blocks under its adaptive mmap threshold (up to 32 MiB, the size of many expert
    tensors) in the heap: without a trim the process keeps about three copies of the state after a few
    methods, which for GPT-125M-8E exhausts a 24 GiB machine shared with others.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
