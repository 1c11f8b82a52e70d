"""Which replica of a piece writes which of its rows under HSDP: every byte once, the writing spread by ownership.

Under HSDP a DTensor's local piece is held alike by its replicas (:func:`moc_lightning.engine.pieces.replicas`), one rank
in each replica group. Written by all of them, a persist would store each byte once per group. Instead the replicas
of a piece split it as DDP's ranks split a replicated unit (:mod:`moc_lightning.sharding.ownership`, MoC-System section 4):
a unit's pieces held by one set of replicas form a unit of a world of those replicas, and ``equal``/``adaptive``
ownership cuts the experts into equal byte ranges (as one run, :class:`~moc_lightning.sharding.ownership.SplitRun`)
and places (or pours) the dense units over them. All replicas of a piece hold the same pieces of the same units (HSDP's
replica groups are alike), so each computes the same ownership from its own pieces, with no communication; under FSDP2
every replica set is one rank, which writes its whole piece.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from moc_lightning.engine.pieces import piece, replicas
from moc_lightning.engine.units import ExpertUnit, parse_unit
from moc_lightning.sharding.ownership import ShardingUnit, Topology, plan_ownership
from moc_lightning.sharding.planner import RowRange, shard_rows, whole_rows


def replica_writes(state: Mapping[str, torch.Tensor], rank: int, strategy: str) -> dict[str, RowRange]:
    """Rows of each DTensor's local piece in ``state`` that ``rank`` writes: the whole piece when no other rank holds
    it, else its share under ownership ``strategy`` among the piece's replicas. Plain tensors are not listed."""
    writes: dict[str, RowRange] = {}
    shared: dict[tuple[int, ...], dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, DTensor):
            continue
        holders = replicas(tensor)
        if len(holders) == 1:
            writes[key] = whole_rows(piece(tensor))
        else:
            shared.setdefault(holders, {}).setdefault(parse_unit(key).key, {})[key] = piece(tensor)
    for holders, units in shared.items():
        writes.update(_split(units, holders.index(rank), len(holders), strategy))
    return writes


def _split(
    units: Mapping[str, Mapping[str, torch.Tensor]], replica: int, replica_count: int, strategy: str
) -> dict[str, RowRange]:
    """Rows that replica number ``replica`` of ``replica_count`` writes of ``units`` (unit key -> its local pieces)."""
    sharding_units = tuple(_sharding_unit(key, units[key], replica_count) for key in sorted(units))
    ownership = plan_ownership(sharding_units, Topology(replica_count, 1), strategy)
    writes: dict[str, RowRange] = {}
    for unit, shard in ownership.writes_of(replica):
        for key, local in units[unit.key].items():
            if (rows := shard_rows(shard, unit.rows, local)) is not None:
                writes[key] = rows
    return writes


def _sharding_unit(key: str, pieces: Mapping[str, torch.Tensor], replica_count: int) -> ShardingUnit:
    """A unit's local pieces as ownership sees them: rows of its longest piece, held by every replica."""
    rows = max([t.shape[0] for t in pieces.values() if t.dim() > 0] or [1])
    nbytes = sum(t.numel() * t.element_size() for t in pieces.values())
    unit = parse_unit(key)
    expert = {"layer": unit.layer, "expert": unit.expert} if isinstance(unit, ExpertUnit) else {}
    return ShardingUnit(
        key=key, kind="expert" if expert else "dense", rows=rows, row_bytes=max(1, math.ceil(nbytes / rows)),
        holders=range(replica_count), **expert,
    )
