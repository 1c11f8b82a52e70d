"""FSDP2 and HSDP of the reference GPT-MoE with expert parallelism (``trainer.data_parallel=fsdp2|hsdp``).

Dense modules are ``fully_shard``-ed over the data-parallel ranks: over all of them under ``fsdp2``, and under
``hsdp`` over a 2-D mesh ``(replicate, shard)``, sharded within each group of ``shard_size`` consecutive ranks and
replicated across the groups. Their gradients are averaged over all ranks by FSDP's reduce-scatter (and
all-reduce across groups), as DDP would.

Experts keep expert parallelism as it is (our ``all_to_all`` inside EP groups of consecutive ranks). As torchtitan
does for FSDP2 + EP (``parallelize`` of its MoE models: the experts ``fully_shard``-ed on the ``dp_mod_ep`` mesh),
each MoE layer's experts are sharded over the *expert-data-parallel* ranks, the ranks holding the same experts
(the replicas of :mod:`moc_lightning.runtime.expert_parallel`): under ``fsdp2`` all of them, under ``hsdp`` those of the same
shard group, replicated across groups. So expert weights and optimizer state are sharded too, not kept whole on
every replica, and FSDP's reduce-scatter replaces :meth:`GPTMoE.reduce_expert_gradients`. An expert's gradient
already sums the tokens of its whole EP group (the all-to-all backward brings them), so FSDP's default division by
the expert mesh's size would overweight it by ``ep``; as torchtitan does, the experts' gradient divide factor is set
to the data-parallel degree (the world size), making every gradient that of the global mean loss.

An EP group must lie inside one shard group (``shard_size`` a multiple of ``ep``), as in torchtitan, where EP is
carved out of the data-parallel shard dimension: the ranks of a shard group are ``(shard_size / ep, ep)``, and the
expert mesh is the first of those dimensions (with the replicate dimension under ``hsdp``).

Mixed precision is FSDP2's :class:`MixedPrecisionPolicy`: with ``trainer.precision=bf16-mixed`` the sharded fp32
parameters are the master weights (the optimizer state is fp32 beside them), all-gathered in bf16 for compute, and
gradients reduced in fp32. Lightning's ``bf16-mixed`` autocast stays on around the step, as under DDP: the matmuls
already meet bf16 weights, and the ops autocast keeps in fp32 (layer norm, softmax, the loss) stay there.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moc_lightning.models.gpt_moe import GPTMoE

SHARDED_DATA_PARALLEL = ("fsdp2", "hsdp")
"""``trainer.data_parallel`` modes built here."""

SHARDED_PRECISIONS = ("32-true", "bf16-mixed")
"""``trainer.precision`` values the sharded modes support: fp32, or bf16 compute over fp32 master weights."""


def check_precision(precision: str) -> None:
    """Refuse a Lightning ``precision`` the sharded modes do not train in (``bf16-true`` would keep bf16 master
    weights and bf16 optimizer state)."""
    if precision not in SHARDED_PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision!r} is not supported with trainer.data_parallel=fsdp2|hsdp; choose one of: "
            f"{', '.join(SHARDED_PRECISIONS)} (bf16-mixed keeps fp32 sharded master weights and computes in bf16)"
        )


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning ``precision``: ``bf16-mixed`` all-gathers bf16 parameters for compute and
    reduces gradients in fp32; ``32-true`` computes in the parameters' fp32."""
    check_precision(precision)
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_shard_size(world_size: int, shard_size: int, ep: int) -> None:
    """Refuse a shard-group size that does not tile the ranks or splits an EP group (see the module)."""
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"trainer.hsdp_shard_size={shard_size} must be >= 1 and divide the number of processes {world_size}"
        )
    if shard_size % ep:
        raise ValueError(
            f"the EP degree {ep} (trainer.ep; null means all {world_size} ranks) must divide "
            f"trainer.hsdp_shard_size={shard_size}: an EP group lies inside one shard group"
        )


def data_parallel_meshes(world_size: int, shard_size: int, ep: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The device meshes of the dense parameters and of the experts (collective: every rank calls it in order).

    ``shard_size == world_size`` is FSDP2 (1-D meshes); otherwise HSDP, with a leading ``replicate`` dimension.
    """
    check_shard_size(world_size, shard_size, ep)
    replicas = world_size // shard_size
    dense = init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
    experts = init_device_mesh(
        device_type, (replicas, shard_size // ep, ep), mesh_dim_names=("replicate", "expert_shard", "ep")
    )
    if replicas == 1:
        return dense["shard"], experts["expert_shard"]
    return dense, experts["replicate", "expert_shard"]


def shard_gpt_moe(model: GPTMoE, dense: DeviceMesh, experts: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    """``fully_shard`` each MoE layer's experts over ``experts``, then each block and the root over ``dense``."""
    world_size = dense.size()
    for layer in model.moe_layers():
        local_experts = list(layer.experts.values())  # one FSDP group per layer (a ModuleDict has no forward)
        fully_shard(local_experts, mesh=experts, mp_policy=policy)
        group = cast(FSDPModule, local_experts[0])  # fully_shard made every member an FSDPModule
        group.set_gradient_divide_factor(float(world_size))  # the group's, set through any member
        if experts.size(experts.ndim - 1) > 1:
            # A factor other than the shard group's size reduce-scatters with PREMUL_SUM, which gloo lacks; forced
            # sums divide afterwards instead. Not on a one-rank shard dimension: torch 2.13 skips the reduce-scatter
            # there, divides by the factor while copying, and with forced sums would divide a second time.
            group.set_force_sum_reduction_for_comms(True)
    for block in model.blocks:
        fully_shard(block, mesh=dense, mp_policy=policy)
    fully_shard(model, mesh=dense, mp_policy=policy)
