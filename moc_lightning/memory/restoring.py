"""Restoring units from in-memory snapshots: a unit's slot owner broadcasts it to the ranks that hold it (a dense unit
to every rank, an expert to its replicas), and a unit in pieces (FSDP2/HSDP) comes back from each holder's own slot,
or from a replica's where a holder lost it.

Used by two-level recovery (:mod:`moc_lightning.memory.recovering`) for every unit whose plan names memory as its
source; every rank walks the units in the same order, so each broadcast, send and receive meets its peer.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from moc_lightning.engine.layout import Layout, TensorSpec
from moc_lightning.engine.parts import part_key_of, split_part_key
from moc_lightning.engine.slots import is_state_key
from moc_lightning.engine.units import ExpertUnit, Unit, parse_unit
from moc_lightning.memory.recovery import RecoveryPlan, Source
from moc_lightning.memory.snapshot import SlotEntry, SlotMeta, SnapshotStore
from moc_lightning.runtime.distributed import collective_device
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology

_Described = tuple[dict[str, SlotEntry], dict[int, dict[str, SlotEntry]]]
"""What one rank describes of the memory-sourced units: its own slots' entries, and per receiver the entries of the
pieces it sends."""


class MemoryRestore:
    """Copies memory-sourced units of a recovery plan into the live tensors (collective).

    Public: :meth:`specs`, :meth:`restore`.
    """

    def __init__(self, layout: Layout, store: SnapshotStore, topology: ExpertParallelTopology) -> None:
        self._layout = layout
        self._store = store
        self._topology = topology
        self._rank = topology.rank
        self._world_size = topology.world_size

    def specs(
        self, plan: RecoveryPlan, by_slot: Mapping[int, SlotMeta], donors: Mapping[str, Mapping[int, int]]
    ) -> dict[str, TensorSpec]:
        """Key -> (shape, dtype) of every tensor of every memory-sourced unit, in its slot's order, as the slot
        owners describe them (collective: one exchange). A restore creates optimizer state from these, and
        sizes the broadcasts by them: a unit's peer copy may hold state that this rank's twin lacks. A unit in
        pieces is described by this rank's own slot (its pieces, which no other rank needs), or, where this rank
        lost it, by the slot of the replica that sends it (``donors``: by part key)."""
        mine: dict[str, SlotEntry] = {}
        own_pieces: dict[str, SlotEntry] = {}
        given: dict[int, dict[str, SlotEntry]] = {}
        for key, source in plan.sources.items():
            unit = split_part_key(key)[0]
            held = parse_unit(unit) in self._layout.slots
            if source.level == "memory" and source.pieces and held and self._rank not in donors.get(key, {}):
                meta = slot_of_step(by_slot, source.step)
                entries = {k: e for k, e in meta.entries.items() if part_key_of(k) == key}
                own_pieces.update(entries)
                for receiver, donor in donors.get(key, {}).items():
                    if donor == self._rank:
                        given.setdefault(receiver, {}).update(entries)
            elif source.level == "memory" and source.rank == self._rank:
                meta = own_slot(by_slot, source)
                mine.update({k: e for k, e in meta.entries.items() if part_key_of(k) == key})
        parts: list[_Described] = [(mine, given)]
        if dist.is_initialized():
            gathered: list[_Described | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (mine, given))
            parts = [part for part in gathered if part is not None]
        received = [part_given.get(self._rank, {}) for _, part_given in parts]
        described = [*(part for part, _ in parts), *received, own_pieces]
        return {k: (tuple(e.shape), e.torch_dtype) for part in described for k, e in part.items()}

    def restore(
        self,
        plan: RecoveryPlan,
        by_slot: Mapping[int, SlotMeta],
        specs: Mapping[str, TensorSpec],
        donors: Mapping[str, Mapping[int, int]],
        skip: Collection[str] = (),
    ) -> None:
        """Every memory-sourced unit: its owner reads its slot and broadcasts it to the unit's holders
        (:meth:`_holders`), which copy it in; the other ranks take no part. A unit in pieces: every holder copies its
        own pieces in from its own slot; a holder that lost it receives it from a replica (``donors``, by part key:
        :meth:`_restore_piece`).

        One broadcast per unit and slot: both parts of a unit when they come from the same slot (always under
        ``both``), each part apart when they do not. ``specs`` (from :meth:`specs`) names each part's
        tensors and their sizes on every rank alike. Keys in ``skip`` are not copied in (a shared state another
        source provides).
        """
        layout = self._layout
        by_part: dict[str, list[str]] = {}
        for key in specs:
            by_part.setdefault(part_key_of(key), []).append(key)
        copies: dict[tuple[str, Source], list[str]] = {}
        for key, source in sorted(plan.sources.items()):
            if source.level == "memory":
                copies.setdefault((split_part_key(key)[0], source), []).extend(by_part.get(key, []))
        for (unit_key, source), keys in copies.items():
            unit = parse_unit(unit_key)
            if source.pieces:
                if unit in layout.slots:
                    # the parts of one slot's step are held by the same slots (replicas hold alike): one donor map
                    given = {r: d for part in {part_key_of(k) for k in keys} for r, d in donors.get(part, {}).items()}
                    self._restore_piece(keys, by_slot, source.step, specs, skip, given)
                continue
            holders = self._holders(unit, source.rank)
            if self._rank not in holders:
                continue
            local = self._kept_by_source(unit, source.rank, keys)
            sent = [k for k in keys if k not in local]
            sizes = [math.prod(specs[k][0]) * specs[k][1].itemsize for k in sent]
            if source.rank == self._rank:
                tensors = self._store.read(own_slot(by_slot, source), keys)
                pieces = [tensors[k].reshape(-1).view(torch.uint8) for k in sent]
                flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
            else:
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
            if dist.is_initialized() and len(holders) > 1:
                flat = flat.to(collective_device())
                group = None if len(holders) == self._world_size else self._topology.replica_group
                dist.broadcast(flat, src=source.rank, group=group)
                flat = flat.cpu()
            if unit in layout.slots:
                received = {k: piece.view(specs[k][1]).view(specs[k][0]) for k, piece in zip(sent, flat.split(sizes))}
                if source.rank == self._rank:
                    received |= {k: tensors[k] for k in local}
                live = layout.tensors([unit])
                others_state = not all(layout.keeps_state(name) for name in layout.param_names(unit))
                with torch.no_grad():
                    for k, tensor in received.items():
                        if k in skip or (k not in live and others_state and is_state_key(k)):
                            continue  # under ZeRO another rank keeps this unit's optimizer state
                        live[k].copy_(tensor)

    def _kept_by_source(self, unit: Unit, source: int | None, keys: Sequence[str]) -> set[str]:
        """The optimizer state among ``keys`` that only ``source`` keeps: under ZeRO, where ``source`` is the rank that
        keeps the unit's state (the rank that snapshots it whole), the state is restored from its own slot and sent to
        no one. Every holder computes the same set, so each broadcast's size agrees on every rank."""
        owners = self._layout.state_owners
        if owners is None or unit not in owners or owners[unit] != source:
            return set()
        return {k for k in keys if is_state_key(k)}

    def _holders(self, unit: Unit, source: int | None) -> range:
        """The ranks a whole unit's broadcast from ``source`` reaches: an expert's replicas (the ranks at its EP
        position, this rank's ``replica_group``) under expert parallelism, else every rank. Every rank computes the
        same, so the ranks outside take no part and each group's broadcasts meet in the same order. A source outside
        the holders (a slot of a run laid out with another EP degree) broadcasts over every rank, as before."""
        topology = self._topology
        everyone = range(topology.world_size)
        if not isinstance(unit, ExpertUnit):
            return everyone
        replicas = topology.replicas_of(unit.expert, self._layout.num_experts[unit.layer])
        return replicas if source is not None and source in replicas else everyone

    def _restore_piece(
        self,
        keys: Sequence[str],
        by_slot: Mapping[int, SlotMeta],
        step: int,
        specs: Mapping[str, TensorSpec],
        skip: Collection[str],
        donors: Mapping[int, int],
    ) -> None:
        """This rank's piece of a unit in pieces, from its own slot of ``step``, which it also sends to each replica
        that lost it (``donors``: receiver -> sender); or, having lost it, received from its replica. Every rank
        walks the units in the same order, so each send meets its receive."""
        if self._rank in donors:
            sizes = [math.prod(specs[k][0]) * specs[k][1].itemsize for k in keys]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=collective_device())
            dist.recv(flat, src=donors[self._rank])
            tensors = {k: t.cpu().view(specs[k][1]).view(specs[k][0]) for k, t in zip(keys, flat.split(sizes))}
        else:
            tensors = self._store.read(slot_of_step(by_slot, step), list(keys))
            receivers = sorted(r for r, donor in donors.items() if donor == self._rank)
            if receivers:
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).to(collective_device())
                for receiver in receivers:
                    dist.send(flat, dst=receiver)
        self._layout.copy_in({k: t for k, t in tensors.items() if k not in skip})


def slot_of_step(by_slot: Mapping[int, SlotMeta], step: int) -> SlotMeta:
    """This rank's slot of ``step`` (a plan sources a unit in pieces from a step only when every holder has one)."""
    return next(meta for meta in by_slot.values() if meta.step == step)


def own_slot(by_slot: Mapping[int, SlotMeta], source: Source) -> SlotMeta:
    """This rank's slot holding a whole unit's memory ``source`` (the plan names the slot of every such source)."""
    assert source.slot is not None, f"memory source {source} names no slot"
    return by_slot[source.slot]
