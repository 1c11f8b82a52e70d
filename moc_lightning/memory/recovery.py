"""Two-level recovery planning: from what survived, choose the resume step and a source for every unit.

Pure and identical on every rank: its inputs are the slot inventories all ranks exchanged and the manifest.

- The resume step is the newest step at which every dense unit is available, from some rank's snapshot
  slot or from a committed checkpoint (DESIGN.md, hard part 6: dense units all come from one step).
- Every expert comes from its newest surviving version at or before that step; memory wins a tie with
  storage because it is faster to read and holds the same bytes.
- An expert never saved anywhere keeps its initial state (step ``NEVER``) and all its tokens are lost.

Sources are chosen per *part* of a unit (:mod:`moc_lightning.engine.parts`): under ``checkpoint.pec_scope`` other
than ``both`` a slot or checkpoint holds one part of the experts it does not hold whole, so each part of an
expert comes from the newest surviving copy of that part. Under ``both`` both parts of a unit always come
from the same source.

A unit kept in pieces (FSDP2/HSDP, :mod:`moc_lightning.engine.pieces`) is in memory at a step only when every piece of it
survived in some slot of that step: under FSDP2 each piece has one holder, so every holder's slot; under HSDP a
piece's replicas stand in for each other, so one replica's slot per piece. Each holder restores its own piece from
its own slot, or, when its slot is gone, receives it from the lowest replica that has it (:func:`piece_donors`).
Otherwise the unit comes from storage whole (or not at all), never half from memory.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.parts import PARTS, part_key, split_part_key

Level = Literal["memory", "storage", "none"]


@dataclass(frozen=True)
class SlotInventory:
    """One committed snapshot slot of one rank, as announced to the others."""

    rank: int
    slot: int
    step: int
    units: frozenset[str]
    parts: frozenset[str] = frozenset()
    """Part keys of the units it holds one part of."""


@dataclass(frozen=True)
class Source:
    """Where one unit is restored from."""

    level: Level
    step: int
    rank: int | None = None
    """Rank whose slot holds it (memory); ``None`` for a unit in pieces, which every holder takes from its own slot
    (or from a replica's: :func:`piece_donors`)."""
    slot: int | None = None
    checkpoint: str | None = None
    """Committed checkpoint holding it (storage)."""
    pieces: bool = False
    """In memory in pieces: every holder restores its piece from its own slot of ``step``, or, having lost it, from
    a replica's (:func:`piece_donors`)."""

    def describe(self, my_rank: int) -> str:
        """``memory_local`` / ``memory_peer`` / ``storage`` / ``none`` from ``my_rank``'s point of view."""
        if self.level == "memory":
            return "memory_local" if self.pieces or self.rank == my_rank else "memory_peer"
        return self.level


@dataclass(frozen=True)
class RecoveryPlan:
    resume_step: int
    sources: dict[str, Source]
    """Part key (``expert/L0/E3/weights``) -> where that part of that unit is restored from."""

    def unit_source(self, unit: str) -> Source:
        """Where ``unit`` is restored from, when both its parts come from one source (always under ``both``)."""
        weights, optimizer = (self.sources[part_key(unit, part)] for part in PARTS)
        if weights != optimizer:
            raise ValueError(f"the parts of {unit} come from different sources: {weights} and {optimizer}")
        return weights


def plan_recovery(
    dense: Sequence[str],
    experts: Sequence[str],
    slots: Iterable[SlotInventory],
    manifest: Manifest,
    holders: Mapping[str, Collection[Collection[int]]] | None = None,
) -> RecoveryPlan | None:
    """The resume step and a source for every part of every unit; ``None`` when no step has every dense unit.

    ``holders``: for units kept in pieces, each piece's holders (its replicas; see the module docstring).
    """
    slots = sorted(slots, key=lambda s: (s.step, s.rank, s.slot))
    memory = _whole_in_memory(slots, holders or {})
    candidates = sorted({s.step for s in slots} | {r.step for r in manifest.records}, reverse=True)
    resume = next((step for step in candidates if _dense_complete(step, dense, memory, manifest)), None)
    if resume is None:
        return None
    return RecoveryPlan(
        resume,
        {part_key(unit, part): _newest(unit, part, resume, memory, manifest) for unit in (*dense, *experts) for part in PARTS},
    )


def _whole_in_memory(
    slots: list[SlotInventory], holders: Mapping[str, Collection[Collection[int]]]
) -> dict[str, list[Source]]:
    """Part key -> every version memory holds of that part, as its source: a slot holding the unit whole or that
    part of it, or, for a unit in pieces, a step at which some slot holds every piece (one source for all)."""
    pieces: dict[tuple[str, int], set[int]] = {}
    versions: dict[str, list[Source]] = {}
    for slot in slots:  # sorted by step, then rank: the first version of a step is the lowest rank's
        held = [part_key(unit, part) for unit in slot.units for part in PARTS] + sorted(slot.parts)
        for key in held:
            if split_part_key(key)[0] in holders:
                pieces.setdefault((key, slot.step), set()).add(slot.rank)
            else:
                versions.setdefault(key, []).append(Source("memory", slot.step, rank=slot.rank, slot=slot.slot))
    for (key, step), ranks in pieces.items():
        if all(ranks.intersection(replicas) for replicas in holders[split_part_key(key)[0]]):
            versions.setdefault(key, []).append(Source("memory", step, pieces=True))
    return versions


def piece_donors(
    key: str, step: int, slots: Iterable[SlotInventory], holders: Collection[Collection[int]]
) -> dict[int, int]:
    """For a part of a unit in memory in pieces at ``step`` (``key``: its part key; ``holders``: each piece's
    replicas): each holder whose slot of that step lacks that part -> the lowest replica of its piece whose slot has
    it (the unit whole, or that part of it), which sends it the piece."""
    unit = split_part_key(key)[0]
    having = {slot.rank for slot in slots if slot.step == step and (unit in slot.units or key in slot.parts)}
    donors = {}
    for replicas in holders:
        donor = min(having.intersection(replicas))
        donors.update({rank: donor for rank in replicas if rank not in having})
    return donors


def _dense_complete(step: int, dense: Sequence[str], memory: Mapping[str, list[Source]], manifest: Manifest) -> bool:
    """Every part of every dense unit at ``step``, in memory or in the checkpoint of that step."""
    record = next((r for r in manifest.records if r.step == step), None)
    return all(
        any(s.step == step for s in memory.get(part_key(unit, part), ()))
        or (record is not None and record.holds(unit))
        for unit in dense
        for part in PARTS
    )


def _newest(unit: str, part: str, resume: int, memory: Mapping[str, list[Source]], manifest: Manifest) -> Source:
    versions = [source for source in memory.get(part_key(unit, part), ()) if source.step <= resume]
    record = manifest.newest(unit, at_or_before=resume, part=part)
    best_memory = max(versions, key=lambda s: s.step, default=None)  # ties: the first, the lowest rank's
    if best_memory is not None and (record is None or best_memory.step >= record.step):
        return best_memory
    if record is not None:
        return Source("storage", record.step, checkpoint=record.name)
    return Source("none", NEVER)
