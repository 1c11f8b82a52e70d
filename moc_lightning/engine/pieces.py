"""Pieces of sharded state (FSDP2 ``fully_shard``, HSDP): what a rank holds of a unit when its parameters are DTensors.

Under ``trainer.data_parallel=fsdp2`` every parameter, and every optimizer state shaped like it, is a DTensor
sharded along dim 0 over its mesh: the rank holds one *piece* of it, its local shard, and no other rank holds
that piece. Under ``hsdp`` the mesh has ``Replicate`` dimensions besides: a piece is held alike by its
*replicas* (:func:`replicas`: one rank per replica group), and a persist splits its writing over them by ownership
(:mod:`moc_lightning.sharding.replica_writes`). Every holder of a unit snapshots its pieces, and a persist writes them as
DTensors, so that DCP records each piece's offsets in the whole tensor and a load under any other world size or
mode reshards (:func:`as_dtensors` describes a snapshot slot's local pieces so again). Only plain tensors beside
them (Adam's scalar ``step``, kept alike by every holder) are replicated over all holders; the unit's first holder
writes them. A unit comes back from memory only when each of its pieces survived on one of its holders
(:mod:`moc_lightning.memory.recovery`). Nothing is all-gathered.

A stacked ``[E, ...]`` expert DTensor sharded along dim 0 is whole experts on each rank; :mod:`moc_lightning.engine.layout`
hands out each expert's slice of the local piece as a plain tensor, held by the piece's replicas
(:func:`unit_replicas`). Tensor parallelism (a DTensor sharded along another dim, or partial) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

SHARDED_MODES = "trainer.data_parallel=ddp, zero2, fsdp2 and hsdp"
"""The modes MoC checkpoints, as the refusals name them."""


def piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: a DTensor's local shard (sharing its storage), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def has_dtensors(params: Iterable[nn.Parameter]) -> bool:
    """Whether any parameter is a DTensor (the model is sharded by FSDP2)."""
    return any(isinstance(p, DTensor) for p in params)


def check_supported(named: Mapping[str, torch.Tensor], owner: str = "the model") -> None:
    """Refuse DTensor parameters placed other than sharded along dim 0 or replicated on each mesh dimension (tensor
    parallelism's other dims, partial sums): their pieces are split in ways MoC does not write."""
    for name, tensor in named.items():
        if isinstance(tensor, DTensor) and any(p not in (Shard(0), Replicate()) for p in tensor.placements):
            raise ValueError(
                f"{owner} has DTensor parameter {name!r} with placements {tuple(tensor.placements)}; MoCCheckpoint "
                f"supports {SHARDED_MODES} (DTensors sharded along dim 0 or replicated on each mesh dimension). "
                "Tensor parallelism is not supported yet: train it with checkpoint.enabled=false (no MoCCheckpoint)"
            )


def replicas(tensor: DTensor) -> tuple[int, ...]:
    """The global ranks holding the same piece of ``tensor`` as this rank, ascending (this rank alone unless a mesh
    dimension replicates it): the mesh's ranks at this rank's coordinates on every sharded dimension."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank holds no piece of a DTensor on {mesh}: it is not in the mesh")
    at = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(tensor.placements, coordinate))
    return tuple(sorted(mesh.mesh[at].flatten().tolist()))


def as_dtensors(local: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``local`` pieces (a snapshot slot's) as DTensors placed as the live tensors in ``like`` are, so that DCP
    writes them at their offsets; keys whose live tensor is plain are kept as they are. No communication."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in local.items():
        live = like.get(key)
        if isinstance(live, DTensor):
            tensor = DTensor.from_local(
                tensor, live.device_mesh, live.placements, run_check=False, shape=live.shape, stride=live.stride()
            )
        out[key] = tensor
    return out


def unit_replicas(params: Iterable[torch.Tensor], rank: int) -> tuple[int, ...]:
    """The ranks holding the same pieces of a unit as ``rank`` (this rank), from the unit's ``params``: its first
    DTensor's :func:`replicas` (a unit's parameters share a mesh; an expert's slice of a stacked DTensor is held
    where that rows' piece is), or ``rank`` alone when it has none."""
    return next((replicas(t) for t in params if isinstance(t, DTensor)), (rank,))


def gather_holders(held: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Unit key -> the holders of each of its pieces (each a tuple of replicas; one rank under FSDP2), ascending, from
    every rank's ``held``: unit key -> :func:`unit_replicas` (collective over the default group, on the training
    thread)."""
    parts: list[dict[str, tuple[int, ...]]] = [dict(held)]
    if dist.is_initialized():
        parts = [{}] * dist.get_world_size()
        dist.all_gather_object(parts, dict(held))
    holders: dict[str, set[tuple[int, ...]]] = {}
    for part in parts:
        for key, replica_set in part.items():
            holders.setdefault(key, set()).add(tuple(replica_set))
    return {key: tuple(sorted(sets)) for key, sets in holders.items()}
