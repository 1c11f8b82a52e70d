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
   starts now, on another thread, writing from the slot through DCP on a dedicated process group. At most one persist
   is in flight; when the previous one is still running on any rank, all ranks agree to skip this persist and count
   it, by a vote started the step before (:mod:`~moc_lightning.memory.persist_vote`). Neither it nor the sum of the
   router counts (summed while the copy runs, recorded here) blocks the training thread at the snapshot.
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

import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moc_lightning.engine.completeness import RestoreGuard
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.manifest import Manifest
from moc_lightning.memory.final_persist import persist_final
from moc_lightning.memory.persisting import PersistQueue
from moc_lightning.memory.recovering import Recovery, RecoveryReport
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.snapshotting import SnapshotTaker
from moc_lightning.memory.stats import CheckpointStats
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.persist import SaveReport
from moc_lightning.runtime.background import spare_core
from moc_lightning.runtime.distributed import agreement_group
from moc_lightning.runtime.faults import FaultInjector


class TwoLevelCheckpointer:
    """Snapshots into a :class:`SnapshotStore`, persists through a :class:`PECCheckpointer`, recovers from both.

    The manager: its public methods guard (no snapshot or persist while a restore is pending, nothing in flight
    during a recovery) and hand the work to the parts: ``snapshots`` (:class:`SnapshotTaker`), ``persists``
    (:class:`PersistQueue`), :class:`Recovery` and :func:`persist_final`. Public: :meth:`reserve_slots`,
    :meth:`start_vote`, :meth:`snapshot`, :meth:`wait_snapshot`, :meth:`poll_persist`, :meth:`finish`,
    :meth:`persist_final`, :meth:`recover`; ``pec``, ``store``, ``faults``, ``stats``, ``completeness``, ``lineage``,
    ``rank``.
    """

    def __init__(
        self,
        pec: PECCheckpointer,
        snapshots: SnapshotStore,
        faults: FaultInjector | None = None,
        behind: bool | None = None,
    ) -> None:
        """``behind``: copy a snapshot's weights and optimizer state on the copy thread, behind the next forward and
        backward, rather than on the training thread; by default where the node's ranks leave a core free for it
        (:func:`~moc_lightning.runtime.background.spare_core`: without one the copy thread costs more than it hides).

        Collective with a process group: it makes the gloo group the snapshots' own agreements run on
        (:func:`~moc_lightning.runtime.distributed.agreement_group`), so every rank constructs its engine together."""
        self.pec = pec
        self.store = snapshots
        self.faults = faults or FaultInjector(None, pec.topology.rank)
        self.stats = CheckpointStats()
        self.completeness = RestoreGuard()
        """Whether the live state is restored completely: no snapshot or persist is taken while a restore is pending
        (a recovery here, a replay-mode resume in the callback)."""
        self.persists = PersistQueue(pec, snapshots, self.faults, self.stats)
        self.snapshots = SnapshotTaker(
            pec, snapshots, self.persists, self.faults, self.stats, spare_core() if behind is None else behind,
            agreement_group(),
        )
        self._recovery = Recovery(pec, snapshots, self.faults)

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

    def reserve_slots(self) -> None:
        """Size the snapshot slots for the current ``k_snapshot``, on the copy thread, ahead of any snapshot.

        Call it once the optimizer has created its state (after its first step), or the estimate misses the
        optimizer's bytes. A snapshot that still needs more grows its slot then.
        """
        self.snapshots.reserve_slots()

    def start_vote(self) -> None:
        """Start agreeing, without blocking, whether the next snapshot may persist (collective: every rank at the same
        point; the callback does it at the batch end before a snapshot step). Without it the snapshot takes the vote
        itself, blocking, once a persist has started (:mod:`~moc_lightning.memory.persist_vote`)."""
        self.snapshots.start_vote()

    def snapshot(
        self, step: int, trainer_state: Mapping[str, Any] | None = None, may_persist: bool = True,
        trainer_state_seconds: float = 0.0,
    ) -> None:
        """Take the snapshot of step ``step``: copy the buffers now, enqueue the copy of GPU tensors, and leave
        the copy of the other host tensors and the commit to the copy thread; :meth:`wait_snapshot` joins it.
        ``may_persist=False``: never persist this one (the last step, which :meth:`persist_final` writes whole);
        the same on every rank. ``trainer_state_seconds``: how long capturing ``trainer_state`` took the caller on the
        training thread (:attr:`CheckpointStats.stall_phases`)."""
        self.completeness.check(f"the snapshot of step {step}")
        self.snapshots.take(step, trainer_state, may_persist, trainer_state_seconds)

    def wait_snapshot(self) -> None:
        """Block until the running snapshot is copied and committed, and account it."""
        self.snapshots.wait()

    def poll_persist(self) -> None:
        """Account the running persist if it has finished (never blocks); a snapshot does this too."""
        self.persists.poll()

    def finish(self) -> None:
        """Wait for everything in flight (end of training)."""
        self.snapshots.wait()
        self.persists.wait()

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
        report = persist_final(self.pec, self.faults, step, trainer_state)
        note = self.stats.retries_note(self.rank, f"the final persist of step {step} (and any restore or write since "
                                       "the last count)")
        if note is not None:
            print(note)
        if report is not None:
            self.stats.final_persist = report
            self.pec.prune_ledger(in_memory=self.store.steps())
        return report

    def recover(self, manifest: Manifest | None = None) -> RecoveryReport | None:
        """Restore the newest consistent state of ``manifest``'s lineage from memory and storage (collective):
        :meth:`Recovery.recover`, with nothing of this engine in flight and the live state marked incomplete until
        it returns."""
        start = time.perf_counter()
        self.finish()  # a snapshot of this engine still copying would race the restore (every rank alike)
        self.completeness.begin("a two-level recovery")
        report = self._recovery.recover(manifest, start)
        self.completeness.complete()  # restored, or (None) as before the call
        return report


def node_root(shm_root: str, run_id: str, rank: int, ranks_per_node: int | None) -> Path:
    """This rank's node-local directory: ``<shm_root>/<run>/<node>``; simulated nodes are rank blocks."""
    node = f"node{rank // ranks_per_node}" if ranks_per_node else socket.gethostname()
    return Path(shm_root) / run_id / node


def lose_node(path: Path) -> None:
    """What a replacement node sees: no shared memory left from before."""
    shutil.rmtree(path, ignore_errors=True)

