"""ZeRO-2 data parallelism, the paper's setting: optimizer state, fp32 master weights included, partitioned
over the data-parallel ranks that hold each parameter.

Every rank still holds every weight it trains with (dense weights on all ranks, an expert's on its replicas)
and its full gradient (DDP reduces dense gradients, the model its experts' over their replicas; ZeRO-1 and
ZeRO-2 are the same to a checkpoint, as the paper notes). Only the *optimizer state* of a parameter lives on
one rank, its *ZeRO owner*: that rank steps the parameter and then broadcasts the new weights to the other
holders.

The partition is by unit (:mod:`moc_lightning.engine.layout`): all parameters of a unit share one owner, so a unit's
optimizer state is whole on one rank and a checkpoint can snapshot and write it there, whole, without
gathering anything; the unit's weights, replicated over its holders, a persist splits over them as under DDP
(:meth:`moc_lightning.pec.write_plan.WritePlan._zero_writes`). Units that share a parameter (the experts of a stacked ``[E, ...]`` tensor) form one
*bundle* and share their owner. Bundles are placed largest first onto the holder with the fewest parameters
so far (LPT): dense bundles over all ranks, then each expert bundle over its replicas. Every rank computes the
same answer for what it needs with no communication: the dense placement is the same everywhere, and the
replicas of an expert see the same experts.

Mixed precision: a parameter that is not fp32 (``trainer.precision=bf16-true``) gets an fp32 ``master`` copy
in its optimizer state, which the update is applied to before it is rounded into the parameter: 2 bytes of
weight and 12 of state (master, ``exp_avg``, ``exp_avg_sq``) per parameter, as in the paper's accounting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.units import ExpertUnit, Unit
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology

MASTER_DTYPE = torch.float32
"""Dtype of the master weights and the moments a ZeRO owner keeps."""


@dataclass(frozen=True)
class ZeroPartition:
    """Which rank holds the optimizer state of each parameter, and which ranks hold the parameter."""

    owner: Mapping[nn.Parameter, int]
    """Global rank that keeps the parameter's optimizer state and steps it."""
    holders: Mapping[nn.Parameter, tuple[int, ...]]
    """Global ranks holding the parameter (all ranks for a dense one, an expert's replicas)."""
    rank: int
    """This rank."""
    replica_group: dist.ProcessGroup | None = None
    """The process group of this rank's expert replicas (``None`` with one replica)."""

    def holds_state(self, param: nn.Parameter) -> bool:
        return self.owner[param] == self.rank

    def unit_owners(self, layout: Layout) -> dict[Unit, int]:
        """The ZeRO owner of each unit of ``layout``: of its parameters, in this partition. A unit of persistent
        buffers alone (a module keeping a statistic in ``state_dict`` and no parameter; only a dense unit can be one,
        and every rank holds those) has no optimizer state to keep, but a snapshot and a persist take it from its
        owner: rank 0.

        Raises ``ValueError`` when a unit's parameters have different owners (a partition made with other units
        than ``layout``'s): its optimizer state would then be spread over ranks, and no rank could snapshot it.
        """
        owners: dict[Unit, int] = {}
        for unit in layout.units:
            ranks = {self.owner[layout.params[name]] for name in layout.param_names(unit)}
            if len(ranks) > 1:
                raise ValueError(
                    f"the ZeRO partition gives the parameters of unit {unit.key} to ranks {sorted(ranks)}; partition "
                    "by the units the checkpoint uses (moc_lightning.sharding.zero.partition_by_units with the same layout)"
                )
            owners[unit] = ranks.pop() if ranks else 0
        return owners


def partition_by_units(layout: Layout, topology: ExpertParallelTopology) -> ZeroPartition:
    """Give each unit of ``layout`` (with the units it shares a parameter with) a ZeRO owner; see the module."""
    bundles = _bundles(layout)
    loads = [0] * topology.world_size
    owner: dict[nn.Parameter, int] = {}
    holders: dict[nn.Parameter, tuple[int, ...]] = {}
    replicas = tuple(range(topology.ep_rank, topology.world_size, topology.ep))
    dense = [b for b in bundles if not isinstance(b[0], ExpertUnit)]
    experts = [b for b in bundles if isinstance(b[0], ExpertUnit)]
    for group, candidates in ((dense, tuple(range(topology.world_size))), (experts, replicas)):
        by_key = {bundle[0].key: bundle for bundle in group}
        placed = lpt_owners([(key, _numel(layout, bundle)) for key, bundle in by_key.items()], candidates, loads)
        for key, rank in placed.items():
            for param in _params(layout, by_key[key]):
                owner[param] = rank
                holders[param] = candidates
    return ZeroPartition(owner=owner, holders=holders, rank=topology.rank, replica_group=topology.replica_group)


def lpt_owners(items: Sequence[tuple[str, int]], candidates: Sequence[int], loads: list[int]) -> dict[str, int]:
    """The ZeRO owner of each ``(key, parameters)`` bundle among ``candidates``: largest first (ties by key), each
    onto the candidate with the fewest parameters in ``loads`` (ties to the lower rank), which it then adds to.

    Pure apart from ``loads``, so a report can place the bundles of a model it never builds
    (:mod:`moc_lightning.tools.scale_report`) exactly as :func:`partition_by_units` does.
    """
    owners: dict[str, int] = {}
    for key, numel in sorted(items, key=lambda item: (-item[1], item[0])):
        rank = min(candidates, key=lambda r: (loads[r], r))
        loads[rank] += numel
        owners[key] = rank
    return owners


def _bundles(layout: Layout) -> list[tuple[Unit, ...]]:
    """Units joined when they share a parameter (a stacked tensor's experts), each bundle sorted."""
    by_param: dict[str, list[Unit]] = {}
    for unit in layout.units:
        for name in layout.param_names(unit):
            by_param.setdefault(name, []).append(unit)
    parent: dict[Unit, Unit] = {u: u for u in layout.units}

    def root(unit: Unit) -> Unit:
        while parent[unit] != unit:
            unit = parent[unit]
        return unit

    for units in by_param.values():
        for other in units[1:]:
            parent[root(other)] = root(units[0])
    bundles: dict[Unit, list[Unit]] = {}
    for unit in layout.units:
        if layout.param_names(unit):  # a unit of buffers only has no optimizer state
            bundles.setdefault(root(unit), []).append(unit)
    return [tuple(sorted(b)) for b in bundles.values()]


def _params(layout: Layout, bundle: Sequence[Unit]) -> list[nn.Parameter]:
    names = dict.fromkeys(name for unit in bundle for name in layout.param_names(unit))
    return [layout.params[name] for name in names]


def _numel(layout: Layout, bundle: Sequence[Unit]) -> int:
    return sum(p.numel() for p in _params(layout, bundle))


class ZeroAdamW(torch.optim.AdamW):
    """AdamW whose state lives only on each parameter's ZeRO owner (see the module docstring).

    ``state`` is keyed by the model's parameters, as torch's optimizers are, and holds entries only for the
    parameters this rank owns; a checkpoint reads and restores it as any optimizer's. Owned parameters that
    are not fp32 are stepped through their fp32 ``master`` copy.
    """

    def __init__(self, params: Iterable[Any], partition: ZeroPartition, **kwargs: Any) -> None:
        if kwargs.get("amsgrad") or kwargs.get("fused") or kwargs.get("foreach"):
            raise ValueError("ZeroAdamW supports neither amsgrad, fused nor foreach; leave them unset")
        super().__init__(params, **kwargs)
        self.partition = partition
        missing = [p for g in self.param_groups for p in g["params"] if p not in partition.owner]
        if missing:
            raise ValueError(f"{len(missing)} optimized parameter(s) have no ZeRO owner; partition the whole model")

    def holds_state(self, param: nn.Parameter) -> bool:
        """Whether this rank keeps ``param``'s optimizer state (a restore creates state only where it does)."""
        return self.partition.holds_state(param)

    def unit_owners(self, layout: Layout) -> dict[Unit, int]:
        """The rank keeping each unit's optimizer state (:meth:`ZeroPartition.unit_owners`): a checkpoint snapshots
        each unit whole there, and writes its optimizer state there."""
        return self.partition.unit_owners(layout)

    def state_nbytes(self, param: nn.Parameter, share: int = 1) -> int:
        """Bytes of optimizer state ``param`` has on its owner once stepped: moments (and master) in fp32, and the
        step; of one of ``share`` equal slices along dim 0 (an expert's slice of a stacked parameter), the slice
        of each tensor and the whole step, as a slice's state reads. What sizing uses before the first step."""
        tensors = 2 if param.dtype == MASTER_DTYPE else 3
        return param.numel() // share * MASTER_DTYPE.itemsize * tensors + MASTER_DTYPE.itemsize

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's load, but the moments and master stay fp32 (torch casts floating state to the parameter's
        dtype, which would round a bf16 parameter's fp32 state to bf16)."""
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = dict(zip(ids, params))
        for param_id, saved in state_dict["state"].items():
            live = self.state[by_id[param_id]]
            for name, value in saved.items():
                if name != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    live[name] = value.to(dtype=MASTER_DTYPE, device=by_id[param_id].device, copy=True)

    def _init_group(
        self,
        group: dict[str, Any],
        params_with_grad: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
    ) -> bool:
        """Torch's AdamW steps what this returns: the owned parameters (their masters when not fp32)."""
        for p in group["params"]:
            if p.grad is None or not self.holds_state(p):
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=MASTER_DTYPE)
                if p.dtype != MASTER_DTYPE:
                    state["master"] = p.detach().to(MASTER_DTYPE, copy=True)
                target = state.get("master", p)
                state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
            target = state.get("master", p)
            params_with_grad.append(target)
            grads.append(p.grad.to(target.dtype))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            state_steps.append(state["step"])
        return False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step the owned parameters, round masters into their parameters, and send every update to its holders."""
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master")
                if master is not None:
                    p.copy_(master)
        self._broadcast()
        return loss

    def _broadcast(self) -> None:
        """Owners send updated weights to the other holders, one flat message per (group, owner, dtype).

        All broadcasts over every rank come first, in parameter order, then those among expert replicas: a
        rank never waits in a replica group while a peer waits for it in the world group.
        """
        if not dist.is_initialized():
            return
        world = tuple(range(dist.get_world_size()))
        buckets: dict[tuple[bool, int, torch.dtype], list[nn.Parameter]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                holders = self.partition.holders[p]
                if len(holders) > 1:
                    buckets.setdefault((holders != world, self.partition.owner[p], p.dtype), []).append(p)
        for (among_replicas, owner, _), params in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=owner, group=self.partition.replica_group if among_replicas else None)
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(piece.view_as(p))
