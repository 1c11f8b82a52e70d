"""Two-level recovery planning: from what survived, choose the resume step and a source for every unit.

Pure and identical on every rank: its inputs are the slot inventories all ranks exchanged and the manifest.

- The resume step is the newest step at which every dense unit is available, from some rank's snapshot
  slot or from a committed checkpoint (DESIGN.md, hard part 6: dense units all come from one step).
- Every expert comes from its newest surviving version at or before that step; memory wins a tie with
  storage because it is faster to read and holds the same bytes.
- An expert never saved anywhere keeps its initial state (step ``NEVER``) and all its tokens are lost.

Sources are chosen per *part* of a unit (:mod:`moc_lightning.parts`): under ``checkpoint.pec_scope`` other
than ``both`` a slot or checkpoint holds one part of the experts it does not hold whole, so each part of an
expert comes from the newest surviving copy of that part. Under ``both`` both parts of a unit always come
from the same source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from moc_lightning.ledger import NEVER
from moc_lightning.manifest import Manifest
from moc_lightning.parts import PARTS, part_key

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
    """Rank whose slot holds it (memory)."""
    slot: int | None = None
    checkpoint: str | None = None
    """Committed checkpoint holding it (storage)."""

    def describe(self, my_rank: int) -> str:
        """``memory_local`` / ``memory_peer`` / ``storage`` / ``none`` from ``my_rank``'s point of view."""
        if self.level == "memory":
            return "memory_local" if self.rank == my_rank else "memory_peer"
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
    dense: Sequence[str], experts: Sequence[str], slots: Iterable[SlotInventory], manifest: Manifest
) -> RecoveryPlan | None:
    """The resume step and a source for every part of every unit; ``None`` when no step has every dense unit."""
    slots = sorted(slots, key=lambda s: (s.step, s.rank, s.slot))
    candidates = sorted({s.step for s in slots} | {r.step for r in manifest.records}, reverse=True)
    resume = next((step for step in candidates if _dense_complete(step, dense, slots, manifest)), None)
    if resume is None:
        return None
    return RecoveryPlan(
        resume,
        {part_key(unit, part): _newest(unit, part, resume, slots, manifest) for unit in (*dense, *experts) for part in PARTS},
    )


def _dense_complete(step: int, dense: Sequence[str], slots: list[SlotInventory], manifest: Manifest) -> bool:
    in_memory = set().union(*(s.units for s in slots if s.step == step))
    record = next((r for r in manifest.records if r.step == step), None)
    return all(unit in in_memory or (record is not None and record.holds(unit)) for unit in dense)


def _newest(unit: str, part: str, resume: int, slots: list[SlotInventory], manifest: Manifest) -> Source:
    key = part_key(unit, part)
    memory = [s for s in slots if s.step <= resume and (unit in s.units or key in s.parts)]
    record = manifest.newest(unit, at_or_before=resume, part=part)
    best_memory = max(memory, key=lambda s: s.step, default=None)  # ties: lowest rank (slots are sorted)
    if best_memory is not None and (record is None or best_memory.step >= record.step):
        return Source("memory", best_memory.step, rank=best_memory.rank, slot=best_memory.slot)
    if record is not None:
        return Source("storage", record.step, checkpoint=record.name)
    return Source("none", NEVER)
