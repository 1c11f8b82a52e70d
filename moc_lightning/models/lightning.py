"""The reference GPT-MoE as a ``LightningModule``: thin glue that adds expert parallelism to Lightning's DDP.

The model is built in ``configure_model``, once the process group exists, because which experts a rank
holds depends on its place in the expert-parallel topology. Expert parameters are hidden from DDP (which
would average different experts of different ranks together) and reduced over their replicas instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning as L
import torch
from torch.nn.parallel import DistributedDataParallel

from moc_lightning.models.gpt_moe import GPTMoE, GPTMoEConfig
from moc_lightning.models.moe import MoELayer
from moc_lightning.models.parallel import ExpertParallelTopology


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


class GPTMoEModule(L.LightningModule):
    """Trains :class:`GPTMoE` with expert parallelism degree ``ep`` (``None``: one EP group over all ranks)."""

    def __init__(
        self, model: GPTMoEConfig, optim: OptimConfig | None = None, ep: int | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters({"model": asdict(model), "optim": asdict(optim or OptimConfig()), "ep": ep})
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        self.ep = ep
        self.seed = seed
        self.model: GPTMoE | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        topology = ExpertParallelTopology.from_process_group(self.ep)
        self.model = GPTMoE(self.model_config, topology, seed=self.seed)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, [f"model.{name}" for name in self.model.expert_parameter_names()]
        )

    @property
    def expert_topology(self) -> ExpertParallelTopology:
        """Where this rank sits in the expert-parallel layout (read by ``MoCCheckpoint``)."""
        return self.model.topology

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers whose routers report token counts (read by ``MoCCheckpoint`` for the ledger)."""
        return self.model.moe_layers()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        _, lm_loss, aux = self.model(x, y)
        return lm_loss, lm_loss + self.model_config.aux_loss_coef * aux

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        lm_loss, loss = self._loss(batch)
        self.log("train_loss", lm_loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        lm_loss, _ = self._loss(batch)
        self.log("val_loss", lm_loss, prog_bar=True, sync_dist=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.model.reduce_expert_gradients()

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the norm of the *global* gradient: dense part once, every expert exactly once.

        Lightning's default clipping computes the norm of this rank's parameters, which differ across ranks
        under expert parallelism; dense replicas would then be scaled differently and drift apart.
        """
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm == "value":
            self.clip_gradients(optimizer, gradient_clip_val, "value")
            return
        dense, expert = [], []
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                (expert if ".experts." in name else dense).append(p.grad)
        squares = torch.stack([g.pow(2).sum() for g in dense]).sum()
        expert_sq = torch.stack([g.pow(2).sum() for g in expert]).sum() if expert else squares.new_zeros(())
        if self.model.topology.ep_group is not None:
            torch.distributed.all_reduce(expert_sq, group=self.model.topology.ep_group)
        total_norm = (squares + expert_sq).sqrt()
        scale = (gradient_clip_val / (total_norm + 1e-6)).clamp(max=1.0)
        for g in dense + expert:
            g.mul_(scale)

    def configure_optimizers(self) -> dict:
        cfg = self.optim_config
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
