"""One small CPU fit of the reference GPT-MoE with MoC, as the Lightning-level tests run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from moc_lightning.callback import MoCCheckpoint
from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule

MODEL = GPTMoEConfig(block_size=32)


def cpu_trainer(root: Path, max_steps: int, callbacks: list[L.Callback], devices: int = 1, **kw: Any) -> L.Trainer:
    """A quiet Trainer on CPU (DDP over gloo for more than one device), no validation, no logger."""
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DDPStrategy(process_group_backend="gloo") if devices > 1 else "auto",
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        **kw,
    )


def moc_config(tmp_path: Path, **kw: Any) -> CheckpointConfig:
    """MoC with its storage under ``tmp_path/ckpt`` and its slots under ``tmp_path/shm``."""
    return CheckpointConfig(storage=StorageConfig(url=(tmp_path / "ckpt").as_uri()), shm_root=str(tmp_path / "shm"), **kw)


def fit(tmp_path: Path, config: CheckpointConfig, max_steps: int, callbacks: list[L.Callback], **kw: Any) -> MoCCheckpoint:
    """Fit the reference model (seed 0) under ``tmp_path/run``, resuming where ``resume_target()`` says."""
    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(tmp_path / "run", max_steps, [moc, *callbacks], **kw)
    module = GPTMoEModule(MODEL, seed=0)
    data = LMDataModule(DataConfig(batch_size=8), block_size=MODEL.block_size, vocab_size=MODEL.vocab_size)
    trainer.fit(module, datamodule=data, ckpt_path=moc.resume_target())
    return moc
