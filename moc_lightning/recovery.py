"""Two-level recovery planning: from what survived, choose the resume step and a source for every unit.

Pure and identical on every rank: its inputs are the slot inventories all ranks exchanged and the manifest.

- The resume step is the newest step at which every dense unit is available, from some rank's snapshot
  slot or from a committed checkpoint (DESIGN.md, hard part 6: dense units all come from one step).
- Every expert comes from its newest surviving version at or before that step; memory wins a tie with
  storage because it is faster to read and holds the same bytes.
- An expert never saved anywhere keeps its initial state (step ``NEVER``) and all its tokens are lost.
- A unit kept in pieces (FSDP2, :mod:`moc_lightning.pieces`) is in memory at a step only when every rank holding a
  piece of it has a slot of that step with it: each of them restores its own piece. Otherwise it comes from storage
  whole (or not at all), never half from memory.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from moc_lightning.ledger import NEVER
from moc_lightning.manifest import Manifest

Level = Literal["memory", "storage", "none"]


@dataclass(frozen=True)
class SlotInventory:
    """One committed snapshot slot of one rank, as announced to the others."""

    rank: int
    slot: int
    step: int
    units: frozenset[str]


@dataclass(frozen=True)
class Source:
    """Where one unit is restored from."""

    level: Level
    step: int
    rank: int | None = None
    """Rank whose slot holds it (memory); ``None`` for a unit in pieces, which every holder takes from its own."""
    slot: int | None = None
    checkpoint: str | None = None
    """Committed checkpoint holding it (storage)."""
    pieces: bool = False
    """In memory in pieces: every holder restores its piece from its own slot of ``step``."""

    def describe(self, my_rank: int) -> str:
        """``memory_local`` / ``memory_peer`` / ``storage`` / ``none`` from ``my_rank``'s point of view."""
        if self.level == "memory":
            return "memory_local" if self.pieces or self.rank == my_rank else "memory_peer"
        return self.level


@dataclass(frozen=True)
class RecoveryPlan:
    resume_step: int
    sources: dict[str, Source]


def plan_recovery(
    dense: Sequence[str],
    experts: Sequence[str],
    slots: Iterable[SlotInventory],
    manifest: Manifest,
    holders: Mapping[str, Collection[int]] | None = None,
) -> RecoveryPlan | None:
    """The resume step and a source for every unit; ``None`` when no step has every dense unit.

    ``holders``: for units kept in pieces, the ranks holding a piece of each (see the module docstring).
    """
    slots = sorted(slots, key=lambda s: (s.step, s.rank, s.slot))
    memory = _whole_in_memory(slots, holders or {})
    candidates = sorted({s.step for s in slots} | {r.step for r in manifest.records}, reverse=True)
    resume = next((step for step in candidates if _dense_complete(step, dense, memory, manifest)), None)
    if resume is None:
        return None
    return RecoveryPlan(resume, {unit: _newest(unit, resume, memory, manifest) for unit in (*dense, *experts)})


def _whole_in_memory(
    slots: list[SlotInventory], holders: Mapping[str, Collection[int]]
) -> dict[str, list[Source]]:
    """Unit -> every version memory holds whole, as its source: a slot holding the unit whole, or, for a unit in
    pieces, a step at which every holder's slot has its piece (one source for all of them)."""
    pieces: dict[tuple[str, int], set[int]] = {}
    versions: dict[str, list[Source]] = {}
    for slot in slots:  # sorted by step, then rank: the first whole version of a step is the lowest rank's
        for unit in slot.units:
            if unit in holders:
                pieces.setdefault((unit, slot.step), set()).add(slot.rank)
            else:
                versions.setdefault(unit, []).append(Source("memory", slot.step, rank=slot.rank, slot=slot.slot))
    for (unit, step), ranks in pieces.items():
        if ranks >= set(holders[unit]):
            versions.setdefault(unit, []).append(Source("memory", step, pieces=True))
    return versions


def _dense_complete(step: int, dense: Sequence[str], memory: Mapping[str, list[Source]], manifest: Manifest) -> bool:
    record = next((r for r in manifest.records if r.step == step), None)
    return all(
        any(s.step == step for s in memory.get(unit, ())) or (record is not None and record.holds(unit))
        for unit in dense
    )


def _newest(unit: str, resume: int, memory: Mapping[str, list[Source]], manifest: Manifest) -> Source:
    versions = [source for source in memory.get(unit, ()) if source.step <= resume]
    record = manifest.newest(unit, at_or_before=resume)
    best_memory = max(versions, key=lambda s: s.step, default=None)  # ties: the first, the lowest rank's
    if best_memory is not None and (record is None or best_memory.step >= record.step):
        return best_memory
    if record is not None:
        return Source("storage", record.step, checkpoint=record.name)
    return Source("none", NEVER)
