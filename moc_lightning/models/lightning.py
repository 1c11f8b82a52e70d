"""The reference GPT-MoE as a ``LightningModule``: thin glue that adds expert parallelism to Lightning's DDP, or
to FSDP2/HSDP under Lightning's ``ModelParallelStrategy``.

The model is built in ``configure_model``, once the process group exists, because which experts a rank
holds depends on its place in the expert-parallel topology. Under DDP (``ddp``, ``zero2``) expert parameters are
hidden from DDP (which would average different experts of different ranks together) and reduced over their
replicas instead; under ``fsdp2``/``hsdp`` the model is ``fully_shard``-ed there (:mod:`moc_lightning.models.sharded`)
and FSDP reduces every gradient.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from moc_lightning.models.causal_lm import DATA_PARALLEL, Batch, CausalLMModule, OptimConfig
from moc_lightning.models.gpt_moe import GPTMoE, GPTMoEConfig
from moc_lightning.models.moe import MoELayer
from moc_lightning.models.sharded import (
    SHARDED_DATA_PARALLEL,
    data_parallel_meshes,
    mixed_precision_policy,
    shard_gpt_moe,
)
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology


class GPTMoEModule(CausalLMModule):
    """Trains :class:`GPTMoE` with expert parallelism degree ``ep`` (``None``: one EP group over all ranks) and any
    ``data_parallel`` of :data:`moc_lightning.models.causal_lm.DATA_PARALLEL`; under ``hsdp``, parameters are
    sharded within groups of ``hsdp_shard_size`` consecutive ranks (``None``: the ranks of a node)."""

    supported_data_parallel = DATA_PARALLEL

    def __init__(
        self,
        model: GPTMoEConfig,
        optim: OptimConfig | None = None,
        ep: int | None = None,
        seed: int = 0,
        data_parallel: str = "ddp",
        hsdp_shard_size: int | None = None,
    ) -> None:
        super().__init__(optim, data_parallel)
        if hsdp_shard_size is not None and data_parallel != "hsdp":
            raise ValueError(f"trainer.hsdp_shard_size is for trainer.data_parallel=hsdp, not {data_parallel!r}")
        self.save_hyperparameters(
            {
                "model": asdict(model),
                "optim": asdict(self.optim_config),
                "ep": ep,
                "data_parallel": data_parallel,
                "hsdp_shard_size": hsdp_shard_size,
            }
        )
        self.model_config = model
        self.ep = ep
        self.seed = seed
        self.hsdp_shard_size = hsdp_shard_size
        self.model: GPTMoE | None = None

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the model (``fsdp2``, ``hsdp``) rather than DDP replicating it."""
        return self.data_parallel in SHARDED_DATA_PARALLEL

    def _built(self) -> GPTMoE:
        """The model, which ``configure_model`` builds once the process group exists. Before then an AttributeError,
        as reading the attributes of ``None`` raised, so that ``getattr(module, "expert_topology", None)`` still
        falls back to a replicated topology."""
        if self.model is None:
            raise AttributeError(
                "GPTMoEModule.model is not built yet: Lightning builds it in configure_model, once the process group "
                "exists"
            )
        return self.model

    def configure_model(self) -> None:
        if self.model is not None:
            return
        topology = ExpertParallelTopology.from_process_group(self.ep)
        self.model = GPTMoE(self.model_config, topology, seed=self.seed)
        if self.sharded:
            self._shard(topology)
        else:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self, [f"model.{name}" for name in self.model.expert_parameter_names()]
            )

    def _shard(self, topology: ExpertParallelTopology) -> None:
        """``fully_shard`` the model over this run's meshes, in the precision the Trainer was given."""
        if self.device_mesh is None:
            raise ValueError(
                f"trainer.data_parallel={self.data_parallel} trains under Lightning's ModelParallelStrategy "
                "(moc_lightning.jobs.training.build_trainer chooses it); this Trainer has another strategy"
            )
        shard_size = topology.world_size
        if self.data_parallel == "hsdp":
            shard_size = self.hsdp_shard_size or self.trainer.num_devices
        dense, experts = data_parallel_meshes(topology.world_size, shard_size, topology.ep, self.device_mesh.device_type)
        shard_gpt_moe(self._built(), dense, experts, mixed_precision_policy(self.trainer.precision))

    @property
    def expert_topology(self) -> ExpertParallelTopology:
        """Where this rank sits in the expert-parallel layout (read by ``MoCCheckpoint``)."""
        return self._built().topology

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers whose routers report token counts (read by ``MoCCheckpoint`` for the ledger)."""
        return self._built().moe_layers()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._built()(idx)[0]

    def losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        _, lm_loss, aux = self._built()(x, y)
        return lm_loss, lm_loss + self.model_config.aux_loss_coef * aux

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.sharded:  # FSDP has reduced the experts' gradients over their replicas
            self._built().reduce_expert_gradients()

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
        model = self._built()
        dense: list[torch.Tensor] = []
        expert: list[torch.Tensor] = []
        for name, p in model.named_parameters():
            if p.grad is not None:
                (expert if ".experts." in name else dense).append(p.grad)
        squares = _sum_of_squares(dense)
        expert_sq = _sum_of_squares(expert) if expert else squares.new_zeros(())
        if model.topology.ep_group is not None:
            torch.distributed.all_reduce(expert_sq, group=model.topology.ep_group)
        total_norm = (squares + expert_sq).sqrt()
        scale = (gradient_clip_val / (total_norm + 1e-6)).clamp(max=1.0)
        for g in dense + expert:
            _local(g).mul_(scale)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: a DTensor's local shard (sharing its storage), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the squares of the whole ``grads``: a DTensor's local shards are summed over the ranks it is sharded
    on (once per group of ranks, not per tensor), its replicas counted once."""
    local: dict[tuple[torch.distributed.ProcessGroup, ...], list[torch.Tensor]] = {}
    for g in grads:
        groups: tuple[torch.distributed.ProcessGroup, ...] = ()
        if isinstance(g, DTensor):
            groups = tuple(g.device_mesh.get_group(dim) for dim, p in enumerate(g.placements) if p.is_shard())
        local.setdefault(groups, []).append(_local(g).pow(2).sum())
    totals: list[torch.Tensor] = []
    for groups, squares in local.items():
        total = torch.stack(squares).sum()
        for group in groups:
            torch.distributed.all_reduce(total, group=group)
        totals.append(total)
    return torch.stack(totals).sum()
