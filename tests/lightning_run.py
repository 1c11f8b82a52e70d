"""One small CPU fit of the reference GPT-MoE with MoC, as the Lightning-level tests run it; a recorder of its
state at chosen steps that can also stand in for a crash, and the check of a recovery against that record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from storage_faults import fail_first_commit

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.parts import part_of
from moc_lightning.engine.units import parse_unit
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.replay.window_store import WINDOW_SUFFIX, WindowHead, memory_head

MODEL = GPTMoEConfig(block_size=32)


class DrainPersists(L.Callback):
    """Waits for the background persist after every step, before MoC's snapshot of the next (checkpoint callbacks run
    last), so no due persist is skipped as still in flight: a test that expects a persist at a given step needs it
    there (on a loaded machine the step-10 persist of a lineage test, and the step-15 persist of a node-loss drill,
    were skipped)."""

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()


def cpu_trainer(root: Path, max_steps: int, callbacks: list[L.Callback], devices: int = 1, **kw: Any) -> L.Trainer:
    """A quiet Trainer on CPU (DDP over gloo for more than one device unless ``strategy`` is given), no validation, no
    logger unless given."""
    kw.setdefault("logger", False)
    kw.setdefault("strategy", DDPStrategy(process_group_backend="gloo") if devices > 1 else "auto")
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        **kw,
    )


def moc_config(tmp_path: Path, **kw: Any) -> CheckpointConfig:
    """MoC with its storage under ``tmp_path/ckpt`` and its slots under ``tmp_path/shm``."""
    return CheckpointConfig(storage=StorageConfig(url=(tmp_path / "ckpt").as_uri()), shm_root=str(tmp_path / "shm"), **kw)


def fit(
    tmp_path: Path, config: CheckpointConfig, max_steps: int, callbacks: list[L.Callback],
    model: GPTMoEConfig = MODEL, **kw: Any,
) -> MoCCheckpoint:
    """Fit the reference model (seed 0) under ``tmp_path/run``, resuming where ``resume_target()`` says."""
    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(tmp_path / "run", max_steps, [moc, *callbacks], **kw)
    trainer.fit(GPTMoEModule(model, seed=0), datamodule=datamodule(model), ckpt_path=moc.resume_target())
    return moc


def datamodule(model: GPTMoEConfig = MODEL) -> LMDataModule:
    """The shipped byte corpus in batches of 8 sequences of ``model``'s context length."""
    return LMDataModule(DataConfig(batch_size=8), block_size=model.block_size, vocab_size=model.vocab_size)


class Crash(Exception):
    """A stand-in for a killed process: fit ends by an exception, and nothing cleans up after it."""


class Recorder(L.Callback):
    """The full state at the start of training and after chosen steps (this rank's pieces of it: under FSDP2 the
    local shards of the DTensors); optionally crash after a step."""

    def __init__(self, at: tuple[int, ...] = (), crash_after: int | None = None, model: GPTMoEConfig = MODEL) -> None:
        self.at = set(at)
        self.crash_after = crash_after
        self.num_experts = model.num_experts
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.start_step: int | None = None

    def _tensors(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
        layout = build_layout(module, trainer.optimizers[0], num_experts=self.num_experts)
        return {k: v.detach().clone() for k, v in layout.pieces(layout.units).items()}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.start = self._tensors(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step in self.at:
            self.states[trainer.global_step] = self._tensors(trainer, module)
        if trainer.global_step == self.crash_after:
            self.moc = next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint))
            self.moc.engine.finish()  # let the background persist end, as a killed process's would not matter
            if self.moc.windows is not None:
                self.moc.windows.flush()  # and the replay window's writes: a resume in this process must not race them
            raise Crash(f"killed after step {trainer.global_step}")


def fit_or_crash(
    tmp_path: Path, config: CheckpointConfig, max_steps: int, recorder: Recorder,
    extra_callbacks: tuple[L.Callback, ...] | list[L.Callback] = (), **kw: Any,
) -> MoCCheckpoint:
    """:func:`fit` with ``recorder``; the MoC callback whether the fit ended or the recorder crashed it."""
    try:
        return fit(tmp_path, config, max_steps, [recorder, *extra_callbacks], **kw)
    except Crash:
        return recorder.moc


def source_step(sources: dict[str, dict[str, Any]], key: str) -> int:
    """The step the recovery reports for tensor ``key``: its part's (``pec_scope`` other than ``both``), else its
    unit's."""
    source = sources[parse_unit(key).key]
    return source["parts"][part_of(key)]["step"] if "parts" in source else source["step"]


def check_sources(first: Recorder, resumed: Recorder, sources: dict[str, dict[str, Any]]) -> None:
    """Every restored tensor is bitwise its unit's (or part's) version at the step the recovery reports for it."""
    for key, tensor in resumed.start.items():
        step = source_step(sources, key)
        if "/optim/" in key and step < 0:
            continue
        expected = first.start[key] if step < 0 else first.states[step][key]
        assert torch.equal(tensor, expected), f"{key} (source step {step}) is not its version of that step"


class FailFirstCommit(L.Callback):
    """Makes the run's first persist fail in its commit, before anything is written (a rank killed there)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        fail_first_commit(next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.pec)


def window_slots(shm: Path, rank: int = 0) -> list[Path]:
    """``rank``'s replay window slots under the shared-memory root ``shm`` that hold a sealed window, newest first."""
    sealed = [p for p in shm.rglob(f"rank{rank}.*{WINDOW_SUFFIX}") if memory_head(p).exists()]
    return sorted(sealed, key=lambda p: -WindowHead.from_bytes(memory_head(p).read_bytes()).end_step)
