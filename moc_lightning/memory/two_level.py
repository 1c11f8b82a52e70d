"""Two-level checkpointing: frequent in-memory snapshots, rarer persists, and two-level recovery.

Timeline of one snapshot step ``t`` (MoC-System Figures 3 and 9):

1. ``snapshot(t)`` on the train-batch end of step ``t``: select the units this rank owns and a free slot, and
   leave their copy and the slot's commit (trainer state, ``meta.json``) to a background copy thread, so that
   the copy overlaps the next forward/backward: GPU tensors are enqueued on a side stream, host tensors are
   copied by that thread (``_foreach_copy_`` runs without the GIL). Only persistent buffers are copied at once,
   on the training thread: a forward may update them in place (norm statistics, a load-balancing bias), while
   weights and optimizer state change only in an optimizer step, and neither ZeRO-2 (which broadcasts the new
   weights inside its step) nor FSDP2 (which all-gathers the shards into storage of its own) writes them
   before. On a CPU the background copy competes with the next forward for the cores: the copy itself is
   slower there than on the training thread, but the training thread no longer waits for it (the quick
   benchmark under ``fsdp2`` on 2 ranks: see ``docs/bench.md``).
2. ``wait_snapshot()`` before the optimizer step of ``t+1`` (the join): training waits here only if the snapshot
   is not copied and committed yet (with the batch-end work, the *stall*); nothing may write to the copied
   tensors before it (recovery, a persist and ``finish`` also wait for it), and an error of the copy or the
   commit is raised here, on the training thread. When the snapshot is a persist one, its persist
   starts now, on another thread, writing from the slot through DCP on a dedicated process group. At most one persist is in flight;
   when the previous one is still running, all ranks agree to skip this persist and count it.
3. ``recover()`` at start-up: ranks exchange their slot inventories, plan the resume step and a source for
   every unit (:mod:`moc_lightning.memory.recovery`), and restore from the local slot, a peer's slot (broadcast
   over the process group) or storage.

Snapshot ownership is at unit granularity: each unit is copied whole by one rank (dense units spread by
the sharding strategy, each expert by one of its replicas, alternating; under ZeRO, the rank that keeps the
unit's optimizer state, the only one that can), so a lost node loses whole units and every other unit can
still come from memory. Under FSDP2 no rank holds a unit whole: every holder snapshots its own pieces
(:mod:`moc_lightning.engine.pieces`), and a unit comes back from memory only if every holder's piece survived.

Under ``checkpoint.pec_scope`` other than ``both`` (:mod:`moc_lightning.engine.parts`) a snapshot and its persist also
hold the non-PEC part of every expert they do not take whole, copied by the rank that would copy the expert
whole (under FSDP2, by every holder of it, its pieces of that part); recovery takes each part of each unit from its
newest surviving copy.
"""

from __future__ import annotations

import base64
import io
import math
import shutil
import socket
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.engine.completeness import RestoreGuard, state_digest
from moc_lightning.engine.layout import Layout, TensorSpec, is_buffer_key
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.parts import PARTS, always_saved, part_key, part_key_of, split_part_key
from moc_lightning.engine.units import ExpertUnit, Unit, parse_unit
from moc_lightning.memory.recovery import RecoveryPlan, SlotInventory, Source, piece_donors, plan_recovery
from moc_lightning.memory.snapshot import NUM_SLOTS, Fill, SlotEntry, SlotMeta, SnapshotStore
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.persist import SaveReport
from moc_lightning.pec.stored import UnreadableCheckpoint
from moc_lightning.runtime.agreement import from_coordinator, gather
from moc_lightning.runtime.background import background_executor, spare_core
from moc_lightning.runtime.distributed import collective_device
from moc_lightning.runtime.faults import FaultInjector
from moc_lightning.sharding.ownership import ShardingUnit, Topology, plan_ownership
from moc_lightning.storage import find_cause


@dataclass
class CheckpointStats:
    """What the two levels did, for logs and benchmarks."""

    snapshots: int = 0
    persists: int = 0
    skipped_persists: int = 0
    failed_persists: int = 0
    copy_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the copy into its slot (host buffers on the training thread, the rest on the copy thread)."""
    snapshot_seconds: list[float] = field(default_factory=list)
    """Per snapshot, from the start of its copy to its slot's commit (trainer state and metadata written)."""
    stall_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the training thread's time on it: taking it at the batch end, then waiting for its commit
    before the next optimizer step."""
    wait_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the wait for its commit alone."""
    snapshot_bytes: list[int] = field(default_factory=list)
    persist_reports: list[SaveReport] = field(default_factory=list)
    """The periodic persists (``persists`` counts them)."""
    final_persist: SaveReport | None = None
    """The persist of every unit when ``fit`` ended (``persist_on_fit_end``), kept apart from the periodic ones."""


@dataclass(frozen=True)
class _PendingSnapshot:
    """A snapshot taken on the training thread whose commit is running in the background."""

    commit: Future[tuple[SlotMeta, float]]
    persist_units: tuple[Unit, ...] | None
    """What its persist writes whole; ``None``: it is not persisted."""
    persist_parts: tuple[str, ...]
    """The part keys its persist writes besides (:meth:`~moc_lightning.pec.write_plan.WritePlan.partial_parts`)."""
    taking_seconds: float
    """The training thread's time in :meth:`TwoLevelCheckpointer.snapshot`."""
    copy_seconds: float
    """Of which the copy into the slot done there (the buffers; under CUDA, enqueuing the copy)."""


@dataclass(frozen=True)
class RecoveryReport:
    """A two-level recovery as this rank saw it."""

    resume_step: int
    plt: float | None
    """PLT of this fault (eq. 7); ``None`` when it is unknown (no router counts: see :mod:`moc_lightning.engine.routing`)."""
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


def encode_state(state: Any) -> str:
    """A picklable object as text for a slot's JSON metadata."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_state(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


class TwoLevelCheckpointer:
    """Snapshots into a :class:`SnapshotStore`, persists through a :class:`PECCheckpointer`, recovers from both."""

    def __init__(
        self,
        pec: PECCheckpointer,
        snapshots: SnapshotStore,
        faults: FaultInjector | None = None,
        behind: bool | None = None,
    ) -> None:
        """``behind``: copy a snapshot's weights and optimizer state on the copy thread, behind the next forward and
        backward, rather than on the training thread; by default where the node's ranks leave a core free for it
        (:func:`~moc_lightning.runtime.background.spare_core`: without one the copy thread costs more than it hides)."""
        self.pec = pec
        self.behind = spare_core() if behind is None else behind
        self.store = snapshots
        self.faults = faults or FaultInjector(None, pec.topology.rank)
        self.stats = CheckpointStats()
        self.completeness = RestoreGuard()
        """Whether the live state is restored completely: no snapshot or persist is taken while a restore is pending
        (a recovery here, a replay-mode resume in the callback)."""
        self._copier = background_executor("moc-snapshot")
        self._persister = background_executor("moc-persist")
        self._snapshot: _PendingSnapshot | None = None
        self._persist: Future[SaveReport] | None = None
        self._persisting_slot: int | None = None
        self._recovery_slot: int | None = None
        self._owner_cache: dict[tuple[str, ...], dict[str, int]] = {}
        self._reservation: Future[None] | None = None
        self._outcomes: list[SaveReport | None] = []
        """Every periodic persist's outcome in order (``None``: failed), as this rank reaped them; every rank
        sees the same outcomes (a persist is all-or-nothing), though not at the same moment."""

    @property
    def lineage(self) -> Lineage | None:
        """The lineage snapshots and persists are stamped with (set when the run starts or recovers)."""
        return self.pec.lineage

    @lineage.setter
    def lineage(self, lineage: Lineage) -> None:
        self.pec.lineage = lineage

    @property
    def rank(self) -> int:
        return self.pec.topology.rank

    # --------------------------------------------------------------- snapshot
    def reserve_slots(self) -> None:
        """Size the snapshot slots for the current ``k_snapshot``, on the copy thread, ahead of any snapshot.

        Call it once the optimizer has created its state (after its first step), or the estimate misses the
        optimizer's bytes. A snapshot that still needs more grows its slot then.
        """
        self._reservation = self._copier.submit(self._reserve, self.pec.snapshot_share_bytes())

    def _reserve(self, nbytes: int) -> None:
        try:
            self.store.reserve(nbytes)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot reserve {NUM_SLOTS} snapshot slots of {nbytes / 1e6:.1f} MB under {self.store.root} "
                f"({err.strerror}); point checkpoint.shm_root at a larger tmpfs or lower checkpoint.k_snapshot",
            ) from err

    def snapshot(self, step: int, trainer_state: Mapping[str, Any] | None = None, may_persist: bool = True) -> None:
        """Take the snapshot of step ``step``: copy the buffers now, enqueue the copy of GPU tensors, and leave
        the copy of the other host tensors and the commit to the copy thread; :meth:`wait_snapshot` joins it.
        ``may_persist=False``: never persist this one (the last step, which :meth:`persist_final` writes whole);
        the same on every rank."""
        self.completeness.check(f"the snapshot of step {step}")
        self.wait_snapshot()
        taking = time.perf_counter()
        if self._reservation is not None:
            # done long ago unless this is the step that started it; the slots are not shared between threads,
            # and a failed reservation (a full tmpfs) is raised here
            self._reservation.result()
            self._reservation = None
        self._reap_persist()
        pec = self.pec
        # every rank must agree to persist, or the persist's collectives would not match across ranks
        persisting = int(self._persist is not None and not self._persist.done())
        (ranks_persisting,) = pec.tokens.mark_step(step, also_sum=[persisting])
        index = pec.snapshots_taken
        due = index % pec.cfg.persist_every_n_snapshots == 0 and may_persist
        persist = due and ranks_persisting == 0
        if due and not persist:
            self.stats.skipped_persists += 1
        selection = pec.selector.select(index, persist, self._agreed_persists() if pec.selector.needs_stored_steps(persist) else None)
        pec.snapshots_taken += 1
        units = pec.layout.dense_units + tuple(sorted(selection.snapshot_units()))
        parts = pec.plan.partial_parts(units)
        if pec.plan.piece_holders is not None:  # FSDP2/HSDP: every holder snapshots its own pieces
            owners = None
            mine = [u for u in units if u in pec.layout.slots]
            my_parts = tuple(p for p in parts if parse_unit(split_part_key(p)[0]) in pec.layout.slots)
        else:
            owners = self._owners(units, parts)
            mine = [u for u in units if owners[u.key] == self.rank]
            my_parts = tuple(p for p in parts if owners[split_part_key(p)[0]] == self.rank)
        tensors = pec.layout.pieces(mine) | pec.plan.part_tensors(my_parts, local=True)
        extra = {"engine": pec.state_dict(), "owners": owners, "lineage": self.lineage.stamp() if self.lineage else None}
        slot = self.store.choose_slot({s for s in (self._persisting_slot, self._recovery_slot) if s is not None})
        persist_units = (*pec.layout.dense_units, *sorted(selection.persist_units())) if persist else None
        persist_parts = pec.plan.partial_parts(persist_units) if persist_units is not None else ()

        def midway() -> None:
            self.faults.at("snapshot", step)

        start = time.perf_counter()
        later = {key for key in tensors if not is_buffer_key(key)} if self.behind else set()
        fill = self.store.fill(slot, tensors, midway, defer=later)
        filled = time.perf_counter()
        commit = self._copier.submit(
            self._commit_snapshot, slot, step, tuple(u.key for u in mine), my_parts, fill, extra, trainer_state
        )
        self._snapshot = _PendingSnapshot(commit, persist_units, persist_parts, filled - taking, filled - start)

    def _commit_snapshot(
        self, slot: int, step: int, units: tuple[str, ...], parts: tuple[str, ...], fill: Fill,
        extra: dict[str, Any], trainer_state: Mapping[str, Any] | None,
    ) -> tuple[SlotMeta, float, float]:
        """Complete the slot's copy, then commit it; returns it, the copy's and the commit's own durations.

        The trainer state is serialised here, off the training thread: it is a fresh dict of plain values.
        """
        start = time.perf_counter()
        fill.complete()
        copied = time.perf_counter()
        extra["trainer"] = encode_state(trainer_state)
        self.faults.at("slot_commit", step)
        meta = self.store.finish(slot, step, units, fill, extra, parts)
        return meta, copied - start, time.perf_counter() - copied

    def wait_snapshot(self) -> None:
        """Block until the running snapshot is copied and committed, and account it."""
        pending = self._snapshot
        if pending is None:
            return
        waited = time.perf_counter()
        meta, background_copy_seconds, commit_seconds = pending.commit.result()
        wait = time.perf_counter() - waited
        self._snapshot = None
        copy_seconds = pending.copy_seconds + background_copy_seconds
        self.stats.snapshots += 1
        self.stats.stall_seconds.append(pending.taking_seconds + wait)
        self.stats.wait_seconds.append(wait)
        self.stats.copy_seconds.append(copy_seconds)
        self.stats.snapshot_seconds.append(copy_seconds + commit_seconds)
        self.stats.snapshot_bytes.append(sum(e.nbytes for e in meta.entries.values()))
        if pending.persist_units is not None:
            self._start_persist(meta, pending.persist_units, pending.persist_parts)

    def _agreed_persists(self) -> list[SaveReport]:
        """The successful persists every rank has reaped (collective): a view of storage all ranks share,
        where the manifest itself may be mid-commit on the coordinator while others read it."""
        count = torch.tensor([len(self._outcomes)])
        if dist.is_initialized():
            count = count.to(collective_device())
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return [r for r in self._outcomes[: int(count.item())] if r is not None]

    def _owners(self, units: Sequence[Unit], parts: Sequence[str] = ()) -> dict[str, int]:
        """Which rank snapshots each unit (whole) and the units of ``parts`` (that part): pure, so every rank
        computes the same map. An expert's copier is the same whether it is taken whole or as a part.

        Cached per unit set: the sequential selection repeats every ceil(N/K) snapshots.
        """
        key = (*(u.key for u in units), *parts)
        if key not in self._owner_cache:
            self._owner_cache[key] = self._plan_owners(units, parts)
        return self._owner_cache[key]

    def _plan_owners(self, units: Sequence[Unit], parts: Sequence[str]) -> dict[str, int]:
        pec = self.pec
        sized = [(u, None) for u in units] + [(parse_unit(u), part) for u, part in map(split_part_key, parts)]
        if pec.plan.state_owners is not None:  # ZeRO: only the state owner holds the unit whole
            return {u.key: pec.plan.state_owners[u.key] for u, _ in sized}
        world, ep = pec.topology.world_size, pec.topology.ep
        sharding_units = []
        for unit, part in sized:
            nbytes = max(1, pec.plan.unit_nbytes(unit, part))
            if isinstance(unit, ExpertUnit):
                per_rank = pec.layout.num_experts[unit.layer] // ep
                replicas = range(unit.expert // per_rank, world, ep)
                holder = replicas[(unit.layer + unit.expert) % len(replicas)]
                sharding_units.append(
                    ShardingUnit(unit.key, "expert", 1, nbytes, (holder,), layer=unit.layer, expert=unit.expert)
                )
            else:
                sharding_units.append(ShardingUnit(unit.key, "dense", 1, nbytes, range(world)))
        strategy = pec.cfg.sharding if pec.cfg.sharding in ("equal", "adaptive", "rank0") else "adaptive"
        ownership = plan_ownership(tuple(sharding_units), Topology(world, ep), strategy)
        return {u.key: ownership.shards_of(u.key)[0].rank for u in sharding_units}

    # ---------------------------------------------------------------- persist
    def _start_persist(self, meta: SlotMeta, units: tuple[Unit, ...], parts: tuple[str, ...]) -> None:
        # The ranks agreed the previous persist was done, but it may have finished after the last reap:
        # account it now, or its result (and its slot becoming the recovery buffer) would be lost.
        self._reap_persist()
        self._persisting_slot = meta.slot
        self._persist = self._persister.submit(self._persist_slot, meta, units, parts)

    def _persist_slot(self, meta: SlotMeta, units: tuple[Unit, ...], parts: tuple[str, ...]) -> SaveReport:
        wanted = {u.key for u in units}
        keys = [k for k in meta.entries if parse_unit(k).key in wanted or part_key_of(k) in parts]
        return self.pec.persist(
            meta.step,
            units,
            parts=parts,
            from_slot=self.store.read(meta, keys),
            engine_state=meta.extra["engine"],
            trainer_state=meta.extra["trainer"],
            before_commit=lambda: self.faults.at("persist", meta.step),
        )

    def poll_persist(self) -> None:
        """Account the running persist if it has finished (never blocks); a snapshot does this too."""
        self._reap_persist()

    def _reap_persist(self) -> None:
        """Account a finished persist; a failed one is counted and logged, and training goes on."""
        if self._persist is None or not self._persist.done():
            return
        error = self._persist.exception()
        self._outcomes.append(self._persist.result() if error is None else None)
        if error is None:
            self.stats.persists += 1
            self.stats.persist_reports.append(self._persist.result())
            self._recovery_slot = self._persisting_slot
            self.pec.prune_ledger(in_memory=self.store.steps())
        else:
            self.stats.failed_persists += 1
            if isinstance(error, PersistFailed):  # agreed by every rank: nothing committed, the group is usable
                print(f"[moc_lightning] rank {self.rank}: {error}; training goes on and the next persist tries again")
            else:
                cause = find_cause(error, OSError) or error
                print(f"[moc_lightning] rank {self.rank}: persist raised {type(cause).__name__}: {cause} outside its "
                      "agreed phases (a peer lost?); training goes on")
        self._persist = None
        self._persisting_slot = None

    def finish(self) -> None:
        """Wait for everything in flight (end of training)."""
        self.wait_snapshot()
        if self._persist is not None:
            self._persist.exception()
        self._reap_persist()

    def persist_final(self, step: int, trainer_state: Mapping[str, Any] | None) -> SaveReport | None:
        """Persist every unit at ``step`` from the live tensors (collective); call after :meth:`finish`.

        However training ended (``max_steps``, ``max_epochs``, early stopping, a user's stop), the last step
        ends up in one complete checkpoint: a partial persist of the same step is superseded (written apart,
        then replaced in the manifest). Returns ``None`` when a complete checkpoint of ``step`` holding the live
        state is committed already: its record's digests (:attr:`CheckpointRecord.digests`, one per rank) equal
        the live state's. One that records none, or others (written from another state), is superseded too. The
        decision is the coordinator's reading of the manifest, shared with every rank, against every rank's digest.
        Refused while a restore is pending (:class:`~moc_lightning.engine.completeness.IncompleteRestore`).
        """
        self.completeness.check(f"the final persist of step {step}")
        pec = self.pec
        experts = tuple(ExpertUnit(layer, e) for layer, n in enumerate(pec.layout.num_experts) for e in range(n))
        units = pec.layout.dense_units + experts
        newest = from_coordinator(lambda: pec.read_manifest().latest)
        if newest is not None and newest.step > step:
            return None
        digests = tuple(gather(state_digest(pec.layout.pieces(pec.layout.units)), pec.process_group))
        supersede = newest is not None and newest.step == step
        if supersede and all(newest.holds(u.key) for u in units):
            if newest.digests == digests:
                return None
            if self.rank == 0:
                print(f"[moc_lightning] the complete checkpoint of step {step} ({newest.name}) does not hold the live "
                      f"state ({'its digests differ' if newest.digests else 'it records no digest'}); persisting it "
                      "again from the live state")
        pec.tokens.mark_step(step)
        report = pec.persist(
            step, units, trainer_state=encode_state(trainer_state), supersede=supersede, digests=digests,
            before_commit=lambda: self.faults.at("final_persist", step),
        )
        self.stats.final_persist = report
        pec.prune_ledger(in_memory=self.store.steps())
        return report

    # --------------------------------------------------------------- recovery
    def recover(self, manifest: Manifest | None = None) -> RecoveryReport | None:
        """Restore the newest consistent state of ``manifest``'s lineage from memory and storage (collective).

        ``manifest`` must be the same on every rank (by default the coordinator's reading, shared). Only slots
        of its lineage's current timeline are considered; an engine used on its own, whose storage names no
        lineage, considers only slots that name none either. A stored checkpoint that fails verification is
        dropped from the manifest, everything the failed attempt loaded is rolled back, and the recovery is
        planned again without it (every rank sees the same failure, so every rank takes the same path).
        Returns ``None`` when no consistent state survives: the model is then as it was before the call and
        every slot is discarded. With a lineage, the lineage gains a segment (its timeline forks here),
        committed in the manifest before training goes on.
        """
        start = time.perf_counter()
        self.finish()  # a snapshot of this engine still copying would race the restore (every rank alike)
        self.completeness.begin("a two-level recovery")
        if manifest is None:
            manifest = from_coordinator(self.pec.read_manifest)
        lineage = manifest.lineage
        if lineage is None and self.lineage is not None:
            raise ValueError(f"the manifest under {self.pec.storage.url} names no lineage; it cannot be resumed")
        metas = []
        for meta in self.store.committed():
            stamp = meta.extra.get("lineage")
            if (stamp is None) if lineage is None else lineage.admits(stamp, meta.step):
                metas.append(meta)
            else:  # another run's, another model's, or a timeline this lineage has left
                self.store.invalidate(meta.slot)
        inventory = _all_gather(
            [SlotInventory(self.rank, m.slot, m.step, frozenset(m.units), frozenset(m.parts)) for m in metas]
        )
        baseline = self.pec.layout.rollback_point()
        while True:
            try:
                report = self._recover_with(manifest, metas, inventory, start)
                break
            except UnreadableCheckpoint as bad:
                self.pec.layout.roll_back(baseline)
                manifest = self.pec.persister.forget(manifest, bad)
        if report is None:
            self.store.clear()
        if lineage is not None:
            resumed = lineage.resumed_at(report.resume_step if report is not None else 0)
            self.pec.persister.commit_lineage(manifest.with_lineage(resumed))
            self.lineage = resumed
        self.pec.selector.base_on(manifest)
        self.completeness.complete()  # restored, or (None) as before the call
        return report

    def _recover_with(
        self, manifest: Manifest, metas: list[SlotMeta], inventory: list[SlotInventory], start: float
    ) -> RecoveryReport | None:
        pec = self.pec
        experts = [ExpertUnit(layer, e).key for layer, n in enumerate(pec.layout.num_experts) for e in range(n)]
        plan = plan_recovery([u.key for u in pec.layout.dense_units], experts, inventory, manifest, pec.plan.piece_holders)
        if plan is None:
            return None
        by_slot = {m.slot: m for m in metas}
        engine_state, trainer_state, trainer_state_rank = self._states_at(plan, by_slot, manifest)
        pec.load_state_dict(engine_state)
        stored = {key: manifest.by_name(src.checkpoint) for key, src in plan.sources.items() if src.level == "storage"}
        donors = {  # parts in pieces that a holder lost: part key -> {holder without it: the replica sending it}
            key: given
            for key, source in plan.sources.items()
            if source.pieces
            and (given := piece_donors(key, source.step, inventory, pec.plan.piece_holders[split_part_key(key)[0]]))
        }
        in_memory = self._memory_specs(plan, by_slot, donors)
        restored = [key for key, src in plan.sources.items() if src.level != "none"]
        pec.loader.prepare_for_load(restored, {**pec.loader.stored_specs(stored), **in_memory})
        stale = _stale_shared_state(pec.layout, restored, plan)
        self._restore_from_memory(plan, by_slot, in_memory, donors, stale)
        self.faults.at("recovery", plan.resume_step)
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
            described = self.pec.loader.read_description(manifest.at_step(plan.resume_step))
            engine, shared = described["engine"], described.get("trainer")
        else:
            payload = [local.extra if local is not None else None]
            if dist.is_initialized():
                dist.broadcast_object_list(payload, src=holder)
            engine, shared = payload[0]["engine"], payload[0]["trainer"]
        own = local.extra["trainer"] if local is not None else None
        persisted = next((r for r in manifest.records if r.step == plan.resume_step), None)
        if persisted is not None and _any_rank(own is None):
            from_storage = self.pec.loader.read_rank_state(persisted)  # collective
            own = own if own is not None else from_storage
        if own is not None:
            return engine, _decode_optional(own), self.rank
        stand_in = holder if holder is not None else 0
        print(f"[moc_lightning] rank {self.rank}: its own training state of step {plan.resume_step} is lost (its "
              f"node's snapshot is gone and the step was not persisted for it); using rank {stand_in}'s loops, "
              "data position and callback state, with RNG streams derived from this rank and the step")
        return engine, _decode_optional(shared), stand_in

    def _memory_specs(
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
            held = parse_unit(unit) in self.pec.layout.slots
            if source.level == "memory" and source.pieces and held and self.rank not in donors.get(key, {}):
                meta = _slot_of_step(by_slot, source.step)
                entries = {k: e for k, e in meta.entries.items() if part_key_of(k) == key}
                own_pieces.update(entries)
                for receiver, donor in donors.get(key, {}).items():
                    if donor == self.rank:
                        given.setdefault(receiver, {}).update(entries)
            elif source.level == "memory" and source.rank == self.rank:
                meta = by_slot[source.slot]
                mine.update({k: e for k, e in meta.entries.items() if part_key_of(k) == key})
        parts = [(mine, given)]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (mine, given))
        received = [part_given.get(self.rank, {}) for _, part_given in parts]
        described = [*(part for part, _ in parts), *received, own_pieces]
        return {k: (tuple(e.shape), e.torch_dtype) for part in described for k, e in part.items()}

    def _restore_from_memory(
        self,
        plan: RecoveryPlan,
        by_slot: Mapping[int, SlotMeta],
        specs: Mapping[str, TensorSpec],
        donors: Mapping[str, Mapping[int, int]],
        skip: Collection[str] = (),
    ) -> None:
        """Every memory-sourced unit: its owner reads its slot and broadcasts; every holder copies it in. A unit in
        pieces: every holder copies its own pieces in from its own slot; a holder that lost it receives it from a
        replica (``donors``, by part key: :meth:`_restore_piece`).

        One broadcast per unit and slot: both parts of a unit when they come from the same slot (always under
        ``both``), each part apart when they do not. ``specs`` (from :meth:`_memory_specs`) names each part's
        tensors and their sizes on every rank alike. Keys in ``skip`` are not copied in (a shared state another
        source provides).
        """
        layout = self.pec.layout
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
            sizes = [math.prod(specs[k][0]) * specs[k][1].itemsize for k in keys]
            if source.rank == self.rank:
                tensors = self.store.read(by_slot[source.slot], keys)
                pieces = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
                flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
            else:
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
            if dist.is_initialized() and self.pec.topology.world_size > 1:
                flat = flat.to(collective_device())
                dist.broadcast(flat, src=source.rank)
                flat = flat.cpu()
            if unit in layout.slots:
                live = layout.tensors([unit])
                others_state = not all(layout.keeps_state(name) for name in layout.param_names(unit))
                with torch.no_grad():
                    for k, piece in zip(keys, flat.split(sizes)):
                        shape, dtype = specs[k]
                        if k in skip or (k not in live and others_state and "/optim/" in k):
                            continue  # under ZeRO another rank keeps this unit's optimizer state
                        live[k].copy_(piece.view(dtype).view(shape))

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
        if self.rank in donors:
            sizes = [math.prod(specs[k][0]) * specs[k][1].itemsize for k in keys]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=collective_device())
            dist.recv(flat, src=donors[self.rank])
            tensors = {k: t.cpu().view(specs[k][1]).view(specs[k][0]) for k, t in zip(keys, flat.split(sizes))}
        else:
            tensors = self.store.read(_slot_of_step(by_slot, step), keys)
            receivers = sorted(r for r, donor in donors.items() if donor == self.rank)
            if receivers:
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).to(collective_device())
                for receiver in receivers:
                    dist.send(flat, dst=receiver)
        self.pec.layout.copy_in({k: t for k, t in tensors.items() if k not in skip})

    def _describe_sources(
        self, plan: RecoveryPlan, donors: Mapping[str, Mapping[int, int]]
    ) -> dict[str, dict[str, Any]]:
        """The report's ``sources`` (see :attr:`RecoveryReport.sources`): per unit under ``both``, with its
        experts' parts under the other scopes, and with the parts of any unit whose parts came from different
        sources (a lineage written under another scope). A piece this rank received from a replica is
        ``memory_peer`` from that replica's rank (``donors``: by part key)."""
        def describe(source: Source, key: str) -> dict[str, Any]:
            sender = donors.get(key, {}).get(self.rank)
            if source.pieces and sender is not None:
                return {"level": "memory_peer", "step": source.step, "rank": sender}
            return {"level": source.describe(self.rank), "step": source.step, "rank": source.rank}

        by_part = always_saved(self.pec.cfg.pec_scope) is not None
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
                self.store.invalidate(meta.slot)
        if dist.is_initialized():
            dist.barrier()


def _slot_of_step(by_slot: Mapping[int, SlotMeta], step: int) -> SlotMeta:
    """This rank's slot of ``step`` (a plan sources a unit in pieces from a step only when every holder has one)."""
    return next(meta for meta in by_slot.values() if meta.step == step)


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


def _all_gather(items: list[SlotInventory]) -> list[SlotInventory]:
    if not dist.is_initialized():
        return items
    parts: list[list[SlotInventory] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


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


def _decode_optional(text: str | None) -> dict | None:
    return decode_state(text) if text else None


def node_root(shm_root: str, run_id: str, rank: int, ranks_per_node: int | None) -> Path:
    """This rank's node-local directory: ``<shm_root>/<run>/<node>``; simulated nodes are rank blocks."""
    node = f"node{rank // ranks_per_node}" if ranks_per_node else socket.gethostname()
    return Path(shm_root) / run_id / node


def lose_node(path: Path) -> None:
    """What a replacement node sees: no shared memory left from before."""
    shutil.rmtree(path, ignore_errors=True)

