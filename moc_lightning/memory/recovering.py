"""Two-level recovery: every rank exchanges what its slots hold, the plan takes every unit from its newest surviving
copy (its own slot, a peer's slot, storage), and the restore runs collectively, then accounts the lost tokens.

The plan itself is pure (:mod:`moc_lightning.memory.recovery`); memory-sourced units are copied in by
:mod:`moc_lightning.memory.restoring`, stored ones by the PEC engine's loader. A stored checkpoint that fails
verification is dropped and the recovery planned again, alike on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.engine.parts import PARTS, always_saved, part_key, part_key_of, split_part_key
from moc_lightning.engine.units import ExpertUnit, parse_unit
from moc_lightning.memory.encoding import decode_state
from moc_lightning.memory.recovery import RecoveryPlan, SlotInventory, Source, piece_donors, plan_recovery
from moc_lightning.memory.restoring import MemoryRestore
from moc_lightning.memory.snapshot import SlotMeta, SnapshotStore
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.stored import UnreadableCheckpoint
from moc_lightning.runtime.agreement import from_coordinator
from moc_lightning.runtime.distributed import collective_device
from moc_lightning.runtime.faults import FaultInjector


@dataclass(frozen=True)
class RecoveryReport:
    """A two-level recovery as this rank saw it."""

    resume_step: int
    plt: float | None
    """PLT of this fault (eq. 7); ``None`` when it is unknown (no router counts: see
    :mod:`moc_lightning.engine.routing`)."""
    sources: dict[str, dict[str, Any]]
    """Unit key -> ``{"level": memory_local|memory_peer|storage|none, "step": int, "rank": slot owner or None}``.
    Under a ``pec_scope`` other than ``both`` an expert's entry also has ``"parts"``: ``{"weights": {...},
    "optimizer": {...}}`` in the same form, and its own level, step and rank are those of its stalest part
    (the step its lost tokens are counted from)."""
    recover_seconds: float
    k_changed: bool
    trainer_state: dict[str, Any] | None
    """The Lightning state (loops, schedulers, RNG, data position, ...) captured with the resume step's
    snapshot or persist, this rank's own unless :attr:`trainer_state_rank` says otherwise."""
    trainer_state_rank: int | None = None
    """Whose trainer state that is: this rank, or the rank whose state stands in for a lost one."""

    def to_json(self) -> dict[str, Any]:
        return {
            "resume_step": self.resume_step,
            "plt": self.plt,
            "sources": self.sources,
            "recover_seconds": self.recover_seconds,
            "k_changed": self.k_changed,
        }


class Recovery:
    """Restores the newest consistent state of a lineage from memory and storage, on every rank alike.

    Public: :meth:`recover`.
    """

    def __init__(self, pec: PECCheckpointer, store: SnapshotStore, faults: FaultInjector) -> None:
        self._pec = pec
        self._store = store
        self._faults = faults
        self._rank = pec.topology.rank

    def recover(self, manifest: Manifest | None, start: float) -> RecoveryReport | None:
        """Restore the newest consistent state of ``manifest``'s lineage from memory and storage (collective).

        ``manifest`` must be the same on every rank (by default the coordinator's reading, shared). Only slots
        of its lineage's current timeline are considered; an engine used on its own, whose storage names no
        lineage, considers only slots that name none either. A stored checkpoint that fails verification is
        dropped from the manifest, everything the failed attempt loaded is rolled back, and the recovery is
        planned again without it (every rank sees the same failure, so every rank takes the same path).
        Returns ``None`` when no consistent state survives: the model is then as it was before the call and
        every slot is discarded. With a lineage, the lineage gains a segment (its timeline forks here),
        committed in the manifest before training goes on. ``start``: when the recovery began (its clock).
        """
        if manifest is None:
            manifest = from_coordinator(self._pec.read_manifest)
        lineage = manifest.lineage
        if lineage is None and self._pec.lineage is not None:
            raise ValueError(f"the manifest under {self._pec.storage.url} names no lineage; it cannot be resumed")
        metas = []
        for meta in self._store.committed():
            stamp = meta.extra.get("lineage")
            if (stamp is None) if lineage is None else lineage.admits(stamp, meta.step):
                metas.append(meta)
            else:  # another run's, another model's, or a timeline this lineage has left
                self._store.invalidate(meta.slot)
        inventory = _all_gather(
            [SlotInventory(self._rank, m.slot, m.step, frozenset(m.units), frozenset(m.parts)) for m in metas]
        )
        baseline = self._pec.layout.rollback_point()
        while True:
            try:
                report = self._recover_with(manifest, metas, inventory, start)
                break
            except UnreadableCheckpoint as bad:
                self._pec.layout.roll_back(baseline)
                manifest = self._pec.persister.forget(manifest, bad)
        if report is None:
            self._store.clear()
        if lineage is not None:
            resumed = lineage.resumed_at(report.resume_step if report is not None else 0)
            self._pec.persister.commit_lineage(manifest.with_lineage(resumed))
            self._pec.lineage = resumed
        self._pec.selector.base_on(manifest)
        return report

    def _recover_with(
        self, manifest: Manifest, metas: list[SlotMeta], inventory: list[SlotInventory], start: float
    ) -> RecoveryReport | None:
        pec = self._pec
        experts = [ExpertUnit(layer, e).key for layer, n in enumerate(pec.layout.num_experts) for e in range(n)]
        holders = pec.plan.piece_holders
        plan = plan_recovery([u.key for u in pec.layout.dense_units], experts, inventory, manifest, holders)
        if plan is None:
            return None
        by_slot = {m.slot: m for m in metas}
        engine_state, trainer_state, trainer_state_rank = self._states_at(plan, by_slot, manifest)
        pec.load_state_dict(engine_state)
        stored = {key: _stored_in(manifest, src) for key, src in plan.sources.items() if src.level == "storage"}
        donors = {  # parts in pieces that a holder lost: part key -> {holder without it: the replica sending it}
            key: given
            for key, source in plan.sources.items()
            if source.pieces
            and holders is not None
            and (given := piece_donors(key, source.step, inventory, holders[split_part_key(key)[0]]))
        }
        memory = MemoryRestore(pec.layout, self._store, pec.topology)
        in_memory = memory.specs(plan, by_slot, donors)
        restored = [key for key, src in plan.sources.items() if src.level != "none"]
        pec.loader.prepare_for_load(restored, {**pec.loader.stored_specs(stored), **in_memory})
        stale = _stale_shared_state(pec.layout, restored, plan)
        memory.restore(plan, by_slot, in_memory, donors, stale)
        self._faults.at("recovery", plan.resume_step)
        pec.loader.load_from_storage(stored, stale)
        pec.layout.share_expert_entries(pec.process_group)
        steps = {key: src.step for key, src in plan.sources.items()}
        load = pec.loader.account_recovery(plan.resume_step, pec.loader.stalest_parts(steps))
        self._drop_slots_after(plan.resume_step, metas)
        return RecoveryReport(
            resume_step=plan.resume_step,
            plt=load.plt,
            sources=self._describe_sources(plan, donors),
            recover_seconds=time.perf_counter() - start,
            k_changed=load.k_changed,
            trainer_state=trainer_state,
            trainer_state_rank=trainer_state_rank,
        )

    def _states_at(
        self, plan: RecoveryPlan, by_slot: Mapping[int, SlotMeta], manifest: Manifest
    ) -> tuple[dict, dict | None, int | None]:
        """Engine state of the resume step (one for all ranks), and this rank's own trainer state of it.

        The trainer state is per rank (RNG streams, the data position): from this rank's slot of the resume
        step, else from its item in the persist of that step. A rank with neither (its node was lost and the
        step was not persisted) takes the lowest rank's and says so; returns whose state it got.
        """
        local = next((m for m in by_slot.values() if m.step == plan.resume_step), None)
        holder = _lowest_rank_with(local is not None)
        if holder is None:
            described = self._pec.loader.read_description(manifest.at_step(plan.resume_step))
            engine, shared = described["engine"], described.get("trainer")
        else:
            payload = [local.extra if local is not None else None]
            if dist.is_initialized():
                dist.broadcast_object_list(payload, src=holder)
            held = payload[0]
            assert held is not None, f"rank {holder} holds the resume step's slot"
            engine, shared = held["engine"], held["trainer"]
        own = local.extra["trainer"] if local is not None else None
        persisted = next((r for r in manifest.records if r.step == plan.resume_step), None)
        if persisted is not None and _any_rank(own is None):
            from_storage = self._pec.loader.read_rank_state(persisted)  # collective
            own = own if own is not None else from_storage
        if own is not None:
            what = f"rank {self._rank}'s trainer state of step {plan.resume_step}"
            return engine, _decode_optional(own, what), self._rank
        stand_in = holder if holder is not None else 0
        print(f"[moc_lightning] rank {self._rank}: its own training state of step {plan.resume_step} is lost (its "
              f"node's snapshot is gone and the step was not persisted for it); using rank {stand_in}'s loops, "
              "data position and callback state, with RNG streams derived from this rank and the step")
        return engine, _decode_optional(shared, f"rank {stand_in}'s trainer state of step {plan.resume_step}"), stand_in

    def _describe_sources(
        self, plan: RecoveryPlan, donors: Mapping[str, Mapping[int, int]]
    ) -> dict[str, dict[str, Any]]:
        """The report's ``sources`` (see :attr:`RecoveryReport.sources`): per unit under ``both``, with its
        experts' parts under the other scopes, and with the parts of any unit whose parts came from different
        sources (a lineage written under another scope). A piece this rank received from a replica is
        ``memory_peer`` from that replica's rank (``donors``: by part key)."""
        def describe(source: Source, key: str) -> dict[str, Any]:
            sender = donors.get(key, {}).get(self._rank)
            if source.pieces and sender is not None:
                return {"level": "memory_peer", "step": source.step, "rank": sender}
            return {"level": source.describe(self._rank), "step": source.step, "rank": source.rank}

        by_part = always_saved(self._pec.cfg.pec_scope) is not None
        described = {}
        for unit in dict.fromkeys(split_part_key(key)[0] for key in plan.sources):
            parts = {part: plan.sources[part_key(unit, part)] for part in PARTS}
            if len(set(parts.values())) == 1 and not (by_part and unit.startswith("expert/")):
                described[unit] = describe(parts["weights"], part_key(unit, "weights"))
                continue
            stalest = min(parts, key=lambda part: parts[part].step)
            described[unit] = {
                **describe(parts[stalest], part_key(unit, stalest)),
                "parts": {part: describe(s, part_key(unit, part)) for part, s in parts.items()},
            }
        return described

    def _drop_slots_after(self, step: int, metas: Sequence[SlotMeta]) -> None:
        """Snapshots newer than the resume step belong to a timeline that no longer exists."""
        for meta in metas:
            if meta.step > step:
                self._store.invalidate(meta.slot)
        if dist.is_initialized():
            dist.barrier()


def _stale_shared_state(layout: Layout, restored: Sequence[str], plan: RecoveryPlan) -> set[str]:
    """Keys of a state the experts of a stacked parameter share (Adam's scalar ``step``) in every expert but
    the one restored from the newest step: the shared tensor takes the newest source's value, as the optimizer
    that kept stepping the whole parameter had it, whatever order the sources are copied in."""
    newest: dict[tuple[str, str], tuple[int, str]] = {}
    units = {parse_unit(key) for key in restored if split_part_key(key)[1] == "optimizer"}
    shared = layout.shared_state_keys(u for u in units if u in layout.slots)
    for key, owner in shared.items():
        candidate = (plan.sources[part_key_of(key)].step, key)
        newest[owner] = max(newest.get(owner, candidate), candidate)
    return set(shared) - {key for _, key in newest.values()}


def _stored_in(manifest: Manifest, source: Source) -> CheckpointRecord:
    """The committed checkpoint a storage ``source`` names (the plan names one for every such source)."""
    assert source.checkpoint is not None, f"storage source {source} names no checkpoint"
    return manifest.by_name(source.checkpoint)


def _all_gather(items: list[SlotInventory]) -> list[SlotInventory]:
    if not dist.is_initialized():
        return items
    parts: list[list[SlotInventory] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts if part is not None for item in part]


def _lowest_rank_with(has: bool) -> int | None:
    """The lowest rank for which ``has`` holds (collective), or ``None`` if no rank has it."""
    if not dist.is_initialized():
        return 0 if has else None
    mark = torch.tensor([dist.get_rank() if has else dist.get_world_size()], device=collective_device())
    dist.all_reduce(mark, op=dist.ReduceOp.MIN)
    return int(mark.item()) if int(mark.item()) < dist.get_world_size() else None


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (collective)."""
    if not dist.is_initialized():
        return flag
    mark = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(mark, op=dist.ReduceOp.MAX)
    return bool(mark.item())


def _decode_optional(text: str | None, what: str) -> dict | None:
    return decode_state(text, what) if text else None
