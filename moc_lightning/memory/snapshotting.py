"""Level 1: taking a snapshot of the selected units into a free slot, its copy overlapped with the next step.

Timeline of one snapshot step ``t`` (MoC-System Figures 3 and 9): :meth:`SnapshotTaker.take` on the batch end of
``t`` selects the units this rank owns and a free slot, copies the persistent buffers at once (a forward may update
them in place) and leaves the copy of weights and optimizer state (which change only in an optimizer step) and the
slot's commit to the copy thread; :meth:`SnapshotTaker.wait` before the optimizer step of ``t+1`` joins it (the
stall), and starts the snapshot's persist when it is a persist one.

Snapshot ownership is at unit granularity: each unit is copied whole by one rank (dense units spread by the sharding
strategy, each expert by one of its replicas, alternating; under ZeRO, the rank that keeps the unit's optimizer
state), so a lost node loses whole units. Under FSDP2 every holder snapshots its own pieces.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.engine.parts import split_part_key
from moc_lightning.engine.slots import is_buffer_key
from moc_lightning.engine.units import ExpertUnit, Unit, parse_unit
from moc_lightning.memory.encoding import encode_state
from moc_lightning.memory.persist_vote import PersistVote
from moc_lightning.memory.persisting import PersistQueue
from moc_lightning.memory.snapshot import NUM_SLOTS, Fill, SlotMeta, SnapshotStore
from moc_lightning.memory.stats import CheckpointStats, StallPhases
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.tokens import TokenMark
from moc_lightning.runtime.background import background_executor
from moc_lightning.runtime.faults import FaultInjector
from moc_lightning.sharding.ownership import ShardingUnit, Topology, plan_ownership


@dataclass(frozen=True)
class _Committed:
    """What a snapshot's commit on the copy thread hands back to the join."""

    meta: SlotMeta
    copy_seconds: float
    """The part of the copy left to the copy thread."""
    commit_seconds: float
    nbytes: int
    """The slot's tensor bytes: summed there, off the training thread."""


@dataclass(frozen=True)
class _PendingSnapshot:
    """A snapshot taken on the training thread whose commit is running in the background."""

    commit: Future[_Committed]
    persist_units: tuple[Unit, ...] | None
    """What its persist writes whole; ``None``: it is not persisted."""
    persist_parts: tuple[str, ...]
    """The part keys its persist writes besides (:meth:`~moc_lightning.pec.write_plan.WritePlan.partial_parts`)."""
    tokens: TokenMark | None
    """The ledger's mark of its step, being summed over the ranks, that the join records; ``None``: recorded already."""
    taken: StallPhases
    """The training thread's time in :meth:`SnapshotTaker.take` and before it, by phase (the join's wait left out)."""


class SnapshotTaker:
    """Takes snapshots into a :class:`SnapshotStore` and hands persist ones to a :class:`PersistQueue`.

    Public: :meth:`reserve_slots`, :meth:`start_vote`, :meth:`take`, :meth:`wait`.
    """

    def __init__(
        self,
        pec: PECCheckpointer,
        store: SnapshotStore,
        persists: PersistQueue,
        faults: FaultInjector,
        stats: CheckpointStats,
        behind: bool,
        agreement_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``behind``: copy weights and optimizer state on the copy thread, behind the next forward and backward.
        ``agreement_group``: the gloo group the snapshot's own collectives run on, non-blocking
        (:func:`~moc_lightning.runtime.distributed.agreement_group`); ``None`` with one process."""
        self._pec = pec
        self._store = store
        self._persists = persists
        self._faults = faults
        self._stats = stats
        self._behind = behind
        self._group = agreement_group
        self._vote = PersistVote(persists, agreement_group)
        self._copier = background_executor("moc-snapshot")
        self._snapshot: _PendingSnapshot | None = None
        self._owner_cache: dict[tuple[str, ...], dict[str, int]] = {}
        self._reservation: Future[None] | None = None

    def reserve_slots(self) -> None:
        """Size the snapshot slots for the current ``k_snapshot``, on the copy thread, ahead of any snapshot."""
        self._reservation = self._copier.submit(self._reserve, self._pec.snapshot_share_bytes())

    def _reserve(self, nbytes: int) -> None:
        try:
            self._store.reserve(nbytes)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot reserve {NUM_SLOTS} snapshot slots of {nbytes / 1e6:.1f} MB under {self._store.root} "
                f"({err.strerror}); point checkpoint.shm_root at a larger tmpfs or lower checkpoint.k_snapshot",
            ) from err

    def start_vote(self) -> None:
        """Start agreeing, without blocking, whether the next snapshot may persist (:class:`PersistVote`; collective:
        every rank at the same point, as late before the snapshot as it can be and still arrive)."""
        self._vote.start()

    def take(
        self, step: int, trainer_state: Mapping[str, Any] | None, may_persist: bool, trainer_state_seconds: float = 0.0
    ) -> None:
        """Take the snapshot of step ``step`` (see :meth:`TwoLevelCheckpointer.snapshot`)."""
        self.wait()
        taking = time.perf_counter()
        if self._reservation is not None:
            # done long ago unless this is the step that started it; the slots are not shared between threads,
            # and a failed reservation (a full tmpfs) is raised here
            self._reservation.result()
            self._reservation = None
        self._persists.poll()
        pec = self._pec
        rank = pec.topology.rank
        index = pec.snapshots_taken
        due = index % pec.cfg.persist_every_n_snapshots == 0 and may_persist
        voting = time.perf_counter()
        # every rank must agree to persist, or the persist's collectives would not match across ranks
        vote = self._vote.result() if due or pec.selector.needs_stored_steps(False) else None
        persist = due and vote is not None and not vote.persisting
        if due and not persist:
            self._stats.skipped_persists += 1
        # the ledger's mark of this step: the counts' sum arrives while the copy runs, the commit and the join read it
        tokens: TokenMark | None = pec.tokens.start_mark(step, self._group)
        if tokens is not None and pec.selector.ranks_by_tokens:  # it selects from the counts up to this step, now
            pec.tokens.finish_mark(tokens)
            tokens = None
        stored_steps = vote is not None and pec.selector.needs_stored_steps(persist)
        agreed = self._persists.agreed(vote.reaped_everywhere) if vote is not None and stored_steps else None
        voted = time.perf_counter()
        selection = pec.selector.select(index, persist, agreed)
        pec.snapshots_taken += 1
        units = pec.layout.dense_units + tuple(sorted(selection.snapshot_units()))
        parts = pec.plan.partial_parts(units)
        owners: dict[str, int] | None = None
        if pec.plan.piece_holders is not None:  # FSDP2/HSDP: every holder snapshots its own pieces
            mine = [u for u in units if u in pec.layout.slots]
            my_parts = tuple(p for p in parts if parse_unit(split_part_key(p)[0]) in pec.layout.slots)
        else:
            owners = self._owners(units, parts)
            mine = [u for u in units if owners[u.key] == rank]
            my_parts = tuple(p for p in parts if owners[split_part_key(p)[0]] == rank)
        tensors = pec.layout.pieces(mine) | pec.plan.part_tensors(my_parts, local=True)
        extra = {"owners": owners, "lineage": pec.lineage.stamp() if pec.lineage else None}
        slot = self._store.choose_slot(self._persists.slots_in_use())
        persist_units = pec.layout.dense_units + tuple(sorted(selection.persist_units())) if persist else None
        persist_parts = pec.plan.partial_parts(persist_units) if persist_units is not None else ()

        def midway() -> None:
            self._faults.at("snapshot", step)

        start = time.perf_counter()
        later = {key for key in tensors if not is_buffer_key(key)} if self._behind else set()
        fill = self._store.fill(slot, tensors, midway, defer=later)
        filled = time.perf_counter()
        commit = self._copier.submit(
            self._commit, slot, step, tuple(u.key for u in mine), my_parts, fill, extra, trainer_state, tokens, tensors
        )
        handed = time.perf_counter()
        taken = StallPhases(
            trainer_state=trainer_state_seconds,
            agreement=voted - voting,
            preparation=(voting - taking) + (start - voted) + (handed - filled),
            copy=filled - start,
            wait=0.0,
            blocking_vote=bool(vote and vote.blocked),
        )
        self._snapshot = _PendingSnapshot(commit, persist_units, persist_parts, tokens, taken)

    def _commit(
        self, slot: int, step: int, units: tuple[str, ...], parts: tuple[str, ...], fill: Fill,
        extra: dict[str, Any], trainer_state: Mapping[str, Any] | None, tokens: TokenMark | None,
        tensors: Mapping[str, torch.Tensor],
    ) -> _Committed:
        """Complete the slot's copy, then commit it; returns it with the copy's and the commit's own durations. Then lay
        the other slots out for ``tensors``' shapes, which the next snapshots' copies will most likely have.

        The trainer state is serialised here, off the training thread: it is a fresh dict of plain values. So is the
        engine state, with the ledger as the join will leave it once ``tokens``, summed over the ranks meanwhile, are
        recorded: a slot is committed only with the counts every rank agreed on (the sum's error, a lost peer, fails
        the commit).
        """
        start = time.perf_counter()
        fill.complete()
        copied = time.perf_counter()
        extra["engine"] = self._pec.state_dict(tokens)
        extra["trainer"] = encode_state(trainer_state)
        self._faults.at("slot_commit", step)
        meta = self._store.finish(slot, step, units, fill, extra, parts)
        committed = time.perf_counter()
        self._store.prepare(set(range(NUM_SLOTS)) - {slot}, tensors)  # the next snapshots' views, off the thread
        return _Committed(meta, copied - start, committed - copied, sum(e.nbytes for e in meta.entries.values()))

    def wait(self) -> None:
        """Block until the running snapshot is copied and committed, record its step's router counts in the ledger,
        account it, and start its persist if due."""
        pending = self._snapshot
        if pending is None:
            return
        self._snapshot = None  # its error, if any, is raised once, here
        waited = time.perf_counter()
        try:
            committed = pending.commit.result()
        finally:
            if pending.tokens is not None:  # on the training thread, which alone changes the ledger
                self._pec.tokens.finish_mark(pending.tokens)
        wait = time.perf_counter() - waited
        taken = pending.taken
        copy_seconds = taken.copy + committed.copy_seconds
        stats = self._stats
        stats.snapshots += 1
        stats.stall_seconds.append(taken.agreement + taken.preparation + taken.copy + wait)
        stats.stall_phases.append(dataclasses.replace(taken, wait=wait))
        stats.wait_seconds.append(wait)
        stats.copy_seconds.append(copy_seconds)
        stats.snapshot_seconds.append(copy_seconds + committed.commit_seconds)
        stats.snapshot_bytes.append(committed.nbytes)
        if pending.persist_units is not None:
            self._persists.start(committed.meta, pending.persist_units, pending.persist_parts)

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
        pec = self._pec
        sized: list[tuple[Unit, str | None]] = [(u, None) for u in units]
        sized += [(parse_unit(u), part) for u, part in map(split_part_key, parts)]
        state_owners = pec.plan.state_owners
        if state_owners is not None:  # ZeRO: only the state owner holds the unit whole
            return {u.key: state_owners[u.key] for u, _ in sized}
        world, ep = pec.topology.world_size, pec.topology.ep
        sharding_units = []
        for unit, part in sized:
            nbytes = max(1, pec.plan.unit_nbytes(unit, part))
            if isinstance(unit, ExpertUnit):
                replicas = pec.topology.replicas_of(unit.expert, pec.layout.num_experts[unit.layer])
                holder = replicas[(unit.layer + unit.expert) % len(replicas)]
                sharding_units.append(
                    ShardingUnit(unit.key, "expert", 1, nbytes, (holder,), layer=unit.layer, expert=unit.expert)
                )
            else:
                sharding_units.append(ShardingUnit(unit.key, "dense", 1, nbytes, range(world)))
        strategy = pec.cfg.sharding if pec.cfg.sharding in ("equal", "adaptive", "rank0") else "adaptive"
        ownership = plan_ownership(tuple(sharding_units), Topology(world, ep), strategy)
        return {u.key: ownership.shards_of(u.key)[0].rank for u in sharding_units}
