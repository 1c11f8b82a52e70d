"""The write plan: which tensors a persist writes and which rows of each fall to this rank.

Ownership is a pure function of layout and topology (:mod:`moc_lightning.sharding.ownership`); this module applies
it to the three ways a rank can hold a unit's state: replicated (DDP: ownership splits the rows), a ZeRO partition
(the optimizer state's owner writes it whole, the replicated weights are split), or DTensor pieces (FSDP2/HSDP:
each piece once, split among its replicas). It also sizes units whether or not this rank holds them, which
ownership and the persist's expected bytes need.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout, UnitBytes
from moc_lightning.engine.parts import always_saved, part_key, part_of, split_part_key
from moc_lightning.engine.pieces import as_dtensors, gather_holders, unit_replicas
from moc_lightning.engine.size_model import model_unit_bytes
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit, parse_unit
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.sharding.ownership import Ownership, ShardingUnit, Topology, plan_ownership
from moc_lightning.sharding.planner import RowRange, shard_rows, whole_rows
from moc_lightning.sharding.replica_writes import replica_writes

Writes = dict[str, RowRange]
"""Key -> the rows of that tensor this rank writes (a key it does not write is absent)."""


class WritePlan:
    """What this rank writes of a persist, under DDP, ZeRO or FSDP2/HSDP.

    Public: :meth:`attach`, :meth:`persisted_state`, :meth:`partial_parts`, :meth:`part_tensors`,
    :meth:`unit_nbytes`, :meth:`local_twin`; the ``layout``, ``state_owners`` and ``piece_holders`` it plans over.
    """

    def __init__(self, cfg: CheckpointConfig, layout: Layout, topology: ExpertParallelTopology) -> None:
        self.cfg = cfg
        self.topology = topology
        self.layout = layout
        self._unit_rows = {unit: _unit_rows(layout, unit) for unit in layout.units}
        self._twins = _first_expert_of_each_layer(layout)
        self.state_owners = gather_state_owners(layout)
        """Under ZeRO: unit key -> the rank keeping the unit's optimizer state, for every unit of the model; each
        unit is snapshotted whole there; a persist from the live tensors writes its optimizer state there and splits
        its replicated weights over their holders (:meth:`_zero_writes`). ``None`` when every holder keeps the state
        (DDP)."""
        self.piece_holders = _gather_piece_holders(layout, topology.rank) if layout.sharded else None
        """Under FSDP2/HSDP (DTensor parameters, :mod:`moc_lightning.engine.pieces`): unit key -> the holders of each of
        its pieces (a piece's replicas under HSDP), for every unit of the model; each holder snapshots its own pieces,
        and a persist writes each piece once. ``None`` otherwise."""

    def attach(self, layout: Layout) -> None:
        """Plan over ``layout`` from now on (same model, new optimizer object)."""
        self.layout = layout
        self._unit_rows = {unit: _unit_rows(layout, unit) for unit in layout.units}
        self._twins = _first_expert_of_each_layer(layout)
        self.state_owners = gather_state_owners(layout)

    def persisted_state(
        self, units: Sequence[Unit], parts: Sequence[str], from_slot: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, Any], Writes | None]:
        """The state dict a persist of ``units`` whole and ``parts`` (part keys) hands DCP, and the rows of it this
        rank writes (``None``: DCP's default deduplication, ``checkpoint.sharding=dcp_default``).

        From the live tensors by default; with ``from_slot``, those tensors (a snapshot slot's) as they are: whole
        units this rank owns, or under FSDP2 its pieces, placed at their offsets again."""
        live_units = [u for u in units if u in self.layout.slots]
        if from_slot is None:
            state: dict[str, Any] = self.layout.tensors(live_units)
            state.update(self.part_tensors(parts))
            return state, self._writes(units, state, parts)
        if self.piece_holders is not None:
            state = as_dtensors(from_slot, self.layout.tensors(live_units) | self.part_tensors(parts))
            return state, self._piece_writes(state)
        state = dict(from_slot)
        return state, None if self.cfg.sharding == "dcp_default" else {k: whole_rows(t) for k, t in state.items()}

    def partial_parts(self, whole: Collection[Unit]) -> tuple[str, ...]:
        """Part keys a checkpoint of the ``whole`` units saves besides them: the non-PEC part of every other
        expert (``checkpoint.pec_scope``); none under ``both``."""
        part = always_saved(self.cfg.pec_scope)
        if part is None:
            return ()
        return tuple(
            part_key(u.key, part) for u in model_units(self.layout) if isinstance(u, ExpertUnit) and u not in whole
        )

    def part_tensors(self, parts: Iterable[str], local: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors of the units it holds among ``parts`` (part keys), as in-place views; ``local``: each
        DTensor as this rank's piece of it (what a snapshot copies)."""
        tensors: dict[str, torch.Tensor] = {}
        for key in parts:
            unit_key, part = split_part_key(key)
            unit = parse_unit(unit_key)
            if unit in self.layout.slots:
                held = self.layout.pieces([unit]) if local else self.layout.tensors([unit])
                tensors.update({k: t for k, t in held.items() if part_of(k) == part})
        return tensors

    def local_twin(self, unit: Unit) -> Unit:
        """``unit`` itself if held here, else a local expert of the same MoE layer (experts share one shape)."""
        if unit in self.layout.slots:
            return unit
        assert isinstance(unit, ExpertUnit)
        return self._twins[unit.layer]

    def unit_nbytes(self, unit: Unit, part: str | None = None) -> int:
        """Weights and optimizer state of ``unit`` in bytes, whether or not this rank holds it (or, under ZeRO,
        keeps its optimizer state: :func:`model_unit_bytes`); with ``part``, of that part only (``weights``:
        with the persistent buffers)."""
        return _part_bytes(model_unit_bytes(self.layout, self.local_twin(unit)), part)

    def _plan_sizes(self) -> Callable[[Unit, str | None], int]:
        """:meth:`unit_nbytes` for one plan, each local twin sized once: the thousands of experts a rank plans for but
        does not hold share their layer's twin, and a unit's bytes change only when the optimizer creates its state,
        never within one plan."""
        sized: dict[Unit, UnitBytes] = {}

        def size(unit: Unit, part: str | None) -> int:
            twin = self.local_twin(unit)
            if twin not in sized:
                sized[twin] = model_unit_bytes(self.layout, twin)
            return _part_bytes(sized[twin], part)

        return size

    def _writes(
        self, units: Sequence[Unit], state: dict[str, torch.Tensor], parts: Sequence[str] = ()
    ) -> Writes | None:
        """Rows of every local tensor this rank writes, from the ownership of ``units`` and of the units of
        ``parts`` (sized by that part); under ZeRO, :meth:`_zero_writes`; under FSDP2, its pieces
        (:meth:`_piece_writes`)."""
        if self.piece_holders is not None:
            return self._piece_writes(state)
        if self.cfg.sharding == "dcp_default":
            return None
        partial = {parse_unit(u): part for u, part in map(split_part_key, parts)}
        if self.state_owners is not None:
            return self._zero_writes(units, state, partial, self.state_owners)
        size = self._plan_sizes()
        sharding_units = tuple(self._sharding_unit(u, None, size) for u in units) + tuple(
            self._sharding_unit(u, part, size) for u, part in partial.items()
        )
        return self._owned_rows(plan_ownership(sharding_units, self._sharding_topology, self.cfg.sharding), state)

    def _zero_writes(
        self,
        units: Sequence[Unit],
        state: Mapping[str, torch.Tensor],
        partial: Mapping[Unit, str],
        state_owners: Mapping[str, int],
    ) -> Writes:
        """Under ZeRO: the optimizer state of the saved units whose state this rank keeps, whole (no other rank
        holds it), and the rows of the saved weights that ownership gives it. The weights are replicated over
        their holders as under DDP, so ``checkpoint.sharding`` splits them as it does there; ``adaptive`` counts
        the optimizer bytes each owner writes anyway when it places them (the paper's AN, section 4.3)."""
        saved: list[tuple[Unit, str | None]] = [(u, None) for u in units] + list(partial.items())
        size = self._plan_sizes()
        states = [(state_owners[u.key], size(u, "optimizer")) for u, part in saved if part != "weights"]
        weights = tuple(self._sharding_unit(u, "weights", size) for u, part in saved if part != "optimizer")
        ownership = zero_weights_ownership(weights, states, self._sharding_topology, self.cfg.sharding)
        writes = self._owned_rows(ownership, {k: t for k, t in state.items() if part_of(k) == "weights"})
        rank = self.topology.rank
        for key, tensor in state.items():
            if part_of(key) == "optimizer" and state_owners[parse_unit(key).key] == rank:
                writes[key] = whole_rows(tensor)
        return writes

    @property
    def _sharding_topology(self) -> Topology:
        return Topology(self.topology.world_size, self.topology.ep)

    def _owned_rows(self, ownership: Ownership, state: Mapping[str, torch.Tensor]) -> Writes:
        """Rows of each tensor in ``state`` that ``ownership`` gives this rank (a scalar whole, to its first row's
        writer); a key of a unit ``ownership`` does not cover is not written."""
        by_unit: dict[str, list[str]] = {}
        for key in state:
            by_unit.setdefault(parse_unit(key).key, []).append(key)
        writes: Writes = {}
        for unit, shard in ownership.writes_of(self.topology.rank):
            for key in by_unit.get(unit.key, ()):
                if (rows := shard_rows(shard, unit.rows, state[key])) is not None:
                    writes[key] = rows
        return writes

    def _piece_writes(self, state: Mapping[str, torch.Tensor]) -> Writes:
        """Under FSDP2/HSDP: every DTensor's local piece, whole when no other rank holds it, else this rank's share of
        it among its replicas (:mod:`moc_lightning.sharding.replica_writes`; DCP records the offsets); a plain tensor
        beside them (Adam's scalar ``step``, alike on every holder) by the unit's first holder."""
        assert self.piece_holders is not None
        writes = replica_writes(state, self.topology.rank, self.cfg.sharding)
        for key, tensor in state.items():
            if not isinstance(tensor, DTensor) and self.piece_holders[parse_unit(key).key][0][0] == self.topology.rank:
                writes[key] = whole_rows(tensor)
        return writes

    def _sharding_unit(self, unit: Unit, part: str | None, size: Callable[[Unit, str | None], int]) -> ShardingUnit:
        rows = self._unit_rows[self.local_twin(unit)]
        nbytes = size(unit, part)
        row_bytes = max(1, math.ceil(nbytes / rows))
        if isinstance(unit, DenseUnit):
            return ShardingUnit(unit.key, "dense", rows, row_bytes, range(self.topology.world_size))
        assert isinstance(unit, ExpertUnit)
        holders = self.topology.replicas_of(unit.expert, self.layout.num_experts[unit.layer])
        return ShardingUnit(unit.key, "expert", rows, row_bytes, holders, layer=unit.layer, expert=unit.expert)


def zero_weights_ownership(
    weights: Sequence[ShardingUnit], states: Iterable[tuple[int, int]], topology: Topology, strategy: str
) -> Ownership:
    """Under ZeRO: who writes which rows of the saved units' replicated weights, the optimizer state being written by
    its owners anyway (``states``: (owner rank, bytes) of each saved unit's state), which ``adaptive`` counts when it
    places the dense weights. Pure: the persist's plan (:meth:`WritePlan._zero_writes`) and the scale report's
    simulated ranks (:mod:`moc_lightning.tools.scale_report`) call the same function."""
    loads = [0] * topology.world_size
    for owner, nbytes in states:
        loads[owner] += nbytes
    return plan_ownership(weights, topology, strategy, base_loads=loads)


def model_units(layout: Layout) -> list[Unit]:
    """Every unit of the model, on any rank: the dense units, then every expert of every MoE layer."""
    experts = [ExpertUnit(layer, e) for layer, n in enumerate(layout.num_experts) for e in range(n)]
    return [*layout.dense_units, *experts]


def gather_state_owners(layout: Layout) -> dict[str, int] | None:
    """Every unit's ZeRO state owner (:attr:`Layout.state_owners` of each rank, gathered over the default group on
    the training thread, where a persist's own group may be busy: collective under ZeRO), by unit key; ``None``
    without ZeRO."""
    local = layout.state_owners
    if local is None:
        return None
    mine = {u.key: r for u, r in local.items()}
    parts: list[dict[str, int]] = [mine]
    if dist.is_initialized():
        parts = [{}] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    owners: dict[str, int] = {}
    for part in parts:
        for key, rank in part.items():
            if owners.setdefault(key, rank) != rank:
                raise ValueError(f"ranks disagree on the ZeRO owner of unit {key} ({owners[key]} and {rank})")
    return owners


def _gather_piece_holders(layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Unit key -> the holders of each of its pieces, from every rank's DTensor placements (collective)."""
    return gather_holders(
        {u.key: unit_replicas([layout.params[n] for n in layout.param_names(u)], rank) for u in layout.units}
    )


def _part_bytes(size: UnitBytes, part: str | None) -> int:
    """Bytes of a unit (``None``), of its ``weights`` (with the persistent buffers) or of its ``optimizer`` state."""
    return {None: size.total, "weights": size.weights + size.buffers, "optimizer": size.optimizer}[part]


def _first_expert_of_each_layer(layout: Layout) -> dict[int, ExpertUnit]:
    """MoE layer -> its first local expert: the twin that sizes the layer's experts held elsewhere (a plan asks for
    each of thousands of them)."""
    twins: dict[int, ExpertUnit] = {}
    for unit in layout.expert_units:
        twins.setdefault(unit.layer, unit)
    return twins


def _unit_rows(layout: Layout, unit: Unit) -> int:
    """Rows a unit is split into: the longest dim 0 among its tensors (1 for scalar-only units)."""
    return max([t.shape[0] for t in layout.tensors([unit]).values() if t.dim() > 0] or [1])
