"""What every causal-LM ``LightningModule`` of the recipes shares: the logged losses and the optimizer.

The reference GPT-MoE (:mod:`moc_lightning.models.lightning`) and a Hugging Face model
(:mod:`moc_lightning.models.hf`) differ only in how a batch becomes a loss; the training and validation
steps, AdamW with decoupled weight decay on matrices only, and the warm-up + cosine schedule are the same,
so a comparison between them (or a switch from one to the other) changes the model and nothing else.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn

from moc_lightning.engine.layout import build_layout
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.sharding.zero import ZeroAdamW, partition_by_units

DATA_PARALLEL = ("ddp", "zero2", "fsdp2", "hsdp")
"""``trainer.data_parallel``: ``ddp`` (optimizer state replicated on every holder of a parameter), ``zero2``
(each parameter's optimizer state, fp32 master weights included, on one of its holders; :mod:`moc_lightning.sharding.zero`),
``fsdp2`` (parameters, gradients and optimizer state sharded over the data-parallel ranks with FSDP2's
``fully_shard``) or ``hsdp`` (sharded within groups of ranks, replicated across them); the last two for the
reference model (:mod:`moc_lightning.models.sharded`)."""


def check_data_parallel(data_parallel: str, supported: tuple[str, ...] = DATA_PARALLEL, by: str = "") -> None:
    """Refuse a ``trainer.data_parallel`` that is not one of ``supported`` (those of the model ``by``, when given)."""
    if data_parallel not in supported:
        where = f" with {by}" if by else ""
        raise ValueError(
            f"trainer.data_parallel={data_parallel!r} is not supported{where}; choose one of: {', '.join(supported)}"
        )


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    decay_steps: int = 1000
    """Steps of cosine decay after warm-up; the learning rate stays at ``min_lr`` afterwards."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr must be > 0 and optim.min_lr in [0, lr], got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.decay_steps >= 1")

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        floor = self.min_lr / self.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


Batch = tuple[torch.Tensor, torch.Tensor]
"""Input token ids and their next-token targets, both ``[B, T]``."""


class CausalLMModule(L.LightningModule, ABC):
    """Trains ``self.model`` (set by the subclass) on next-token prediction; logs ``train_loss``/``val_loss``."""

    model: nn.Module | None
    supported_data_parallel: ClassVar[tuple[str, ...]] = ("ddp", "zero2")
    """The ``trainer.data_parallel`` modes this module trains with (the sharded ones need a model-specific plan)."""

    def __init__(self, optim: OptimConfig | None = None, data_parallel: str = "ddp") -> None:
        super().__init__()
        check_data_parallel(data_parallel)
        check_data_parallel(data_parallel, self.supported_data_parallel, type(self).__name__)
        self.optim_config = optim or OptimConfig()
        self.data_parallel = data_parallel

    @abstractmethod
    def losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(language-model loss, loss to optimize)``: the second adds the model's auxiliary losses."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        lm_loss, loss = self.losses(batch)
        self.log("train_loss", lm_loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        lm_loss, _ = self.losses(batch)
        self.log("val_loss", lm_loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        cfg = self.optim_config
        assert self.model is not None, "the subclass sets self.model in its __init__"
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.data_parallel == "zero2":
            topology = getattr(self, "expert_topology", None) or ExpertParallelTopology.replicated()
            partition = partition_by_units(build_layout(self, None, expert_parallel=topology.ep), topology)
            optimizer: torch.optim.Optimizer = ZeroAdamW(groups, partition, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        else:
            optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
