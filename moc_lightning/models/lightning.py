"""The reference GPT-MoE as a ``LightningModule``: thin glue that adds expert parallelism to Lightning's DDP.

The model is built in ``configure_model``, once the process group exists, because which experts a rank
holds depends on its place in the expert-parallel topology. Expert parameters are hidden from DDP (which
would average different experts of different ranks together) and reduced over their replicas instead.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch.nn.parallel import DistributedDataParallel

from moc_lightning.models.causal_lm import Batch, CausalLMModule, OptimConfig
from moc_lightning.models.gpt_moe import GPTMoE, GPTMoEConfig
from moc_lightning.models.moe import MoELayer
from moc_lightning.models.parallel import ExpertParallelTopology


class GPTMoEModule(CausalLMModule):
    """Trains :class:`GPTMoE` with expert parallelism degree ``ep`` (``None``: one EP group over all ranks) and
    ``data_parallel`` ``ddp`` or ``zero2`` (:data:`moc_lightning.models.causal_lm.DATA_PARALLEL`)."""

    def __init__(
        self,
        model: GPTMoEConfig,
        optim: OptimConfig | None = None,
        ep: int | None = None,
        seed: int = 0,
        data_parallel: str = "ddp",
    ) -> None:
        super().__init__(optim, data_parallel)
        self.save_hyperparameters(
            {"model": asdict(model), "optim": asdict(self.optim_config), "ep": ep, "data_parallel": data_parallel}
        )
        self.model_config = model
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

    def losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        _, lm_loss, aux = self.model(x, y)
        return lm_loss, lm_loss + self.model_config.aux_loss_coef * aux

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
