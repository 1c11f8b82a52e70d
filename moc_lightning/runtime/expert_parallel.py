"""Expert-parallel topology and the collectives the MoE layer needs.

Ranks form EP groups of ``ep`` consecutive ranks (``[0..ep-1], [ep..2ep-1], ...``). Inside an EP group,
EP rank ``p`` holds the experts ``[p*N/ep, (p+1)*N/ep)`` of every MoE layer, and tokens travel to their
experts with ``all_to_all``. The ranks with the same EP rank in different EP groups hold the same experts:
they are the *replicas* of those experts, and expert gradients are reduced among them only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def ep_position(expert: int, num_experts: int, ep: int) -> int:
    """The EP position holding expert ``expert`` of a layer of ``num_experts`` at EP degree ``ep``: each position holds
    one contiguous block of ``num_experts // ep`` experts (:meth:`ExpertParallelTopology.local_experts`)."""
    return expert // (num_experts // ep)


@dataclass(frozen=True)
class ExpertParallelTopology:
    """Where this rank sits in the expert-parallel layout, and the process groups that go with it."""

    world_size: int = 1
    """Number of ranks training together (data-parallel degree)."""
    rank: int = 0
    """This rank's global rank."""
    ep: int = 1
    """Expert-parallel degree: ranks per EP group. Must divide ``world_size``."""
    ep_group: dist.ProcessGroup | None = None
    """The ranks that exchange tokens with this rank (``None`` when ``ep == 1``)."""
    replica_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts as this rank (``None`` when there is only one replica)."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.world_size % self.ep != 0:
            raise ValueError(
                f"expert parallel degree ep={self.ep} must be >= 1 and divide the world size {self.world_size}"
            )

    @property
    def ep_rank(self) -> int:
        """Position of this rank inside its EP group; selects which experts it holds."""
        return self.rank % self.ep

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each expert (the number of EP groups)."""
        return self.world_size // self.ep

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds, out of ``num_experts`` per MoE layer."""
        if num_experts % self.ep != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the expert parallel degree ep={self.ep}")
        per_rank = num_experts // self.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def replicas_of(self, expert: int, num_experts: int) -> range:
        """The ranks holding expert ``expert`` of a layer of ``num_experts``: its EP position in every EP group."""
        return range(ep_position(expert, num_experts, self.ep), self.world_size, self.ep)

    @classmethod
    def replicated(cls) -> ExpertParallelTopology:
        """The topology of a model without expert parallelism: every rank of the default group holds every expert."""
        if dist.is_available() and dist.is_initialized():
            return cls(world_size=dist.get_world_size(), rank=dist.get_rank(), ep=1)
        return cls()

    @classmethod
    def from_process_group(cls, ep: int | None = None) -> ExpertParallelTopology:
        """Build the topology of the default process group, creating the EP and replica groups.

        Every rank must call this in the same order (``new_group`` is collective). ``ep=None`` means one EP
        group spanning all ranks. Without an initialised process group this is the single-process topology.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if ep not in (None, 1):
                raise ValueError(f"expert parallel degree ep={ep} needs an initialised process group")
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        ep = world if ep is None else ep
        if ep < 1 or world % ep != 0:
            raise ValueError(f"expert parallel degree ep={ep} must be >= 1 and divide the world size {world}")
        ep_group = replica_group = None
        for start in range(0, world, ep):
            group = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                ep_group = group
        for position in range(ep):
            group = dist.new_group(list(range(position, world, ep)))
            if rank % ep == position:
                replica_group = group
        return cls(
            world_size=world,
            rank=rank,
            ep=ep,
            ep_group=ep_group if ep > 1 else None,
            replica_group=replica_group if world // ep > 1 else None,
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits; its gradient is the same exchange run backwards."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None  # type: ignore[attr-defined]


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange equal chunks of ``x`` (split along dim 0) with every rank of ``group``; identity without one."""
    if group is None:
        return x
    return _AllToAll.apply(x, group)
