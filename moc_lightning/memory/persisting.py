"""The persist in flight: level 2 runs on its own thread, writing a committed snapshot slot through the PEC engine.

At most one persist is in flight. Its slot is kept from reuse while it runs and becomes the recovery buffer when it
succeeds (the triple buffer of MoC-System: snapshot, persist, recovery). Every persist's outcome is kept in order,
so that the ranks can agree on the persists all of them have seen succeed (the view of storage selection needs
while the coordinator may be committing the next one).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

from moc_lightning.engine.parts import part_key_of
from moc_lightning.engine.units import Unit, parse_unit
from moc_lightning.memory.snapshot import SlotMeta, SnapshotStore
from moc_lightning.memory.stats import CheckpointStats
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.persist import SaveReport
from moc_lightning.runtime.background import background_executor
from moc_lightning.runtime.faults import FaultInjector
from moc_lightning.storage import find_cause


class PersistQueue:
    """Runs persists of snapshot slots in the background, one at a time, and accounts them.

    Public: :meth:`start`, :meth:`poll`, :meth:`wait`, :meth:`running`, :meth:`reaped`, :meth:`agreed`,
    :meth:`slots_in_use`; ``in_flight`` (the running persist's future, ``None`` when none is) and ``started``.
    """

    def __init__(
        self, pec: PECCheckpointer, store: SnapshotStore, faults: FaultInjector, stats: CheckpointStats
    ) -> None:
        self._pec = pec
        self._store = store
        self._faults = faults
        self._stats = stats
        self._executor = background_executor("moc-persist")
        self.in_flight: Future[SaveReport] | None = None
        self.started = 0
        """Persists started so far: the same count on every rank, since every rank starts the persists they agreed
        on."""
        self._persisting_slot: int | None = None
        self._recovery_slot: int | None = None
        self._stored_steps: list[int] | None = None
        """The stored versions' steps, read on the persist thread once the persist in flight committed; ``None``: not
        read (a failed persist, or a manifest that could not be read there)."""
        self._outcomes: list[SaveReport | None] = []
        """Every periodic persist's outcome in order (``None``: failed), as this rank reaped them; every rank
        sees the same outcomes (a persist is all-or-nothing), though not at the same moment."""

    def start(self, meta: SlotMeta, units: tuple[Unit, ...], parts: tuple[str, ...]) -> None:
        """Persist ``units`` whole and ``parts`` from the committed slot ``meta`` on the persist thread."""
        # The ranks agreed the previous persist was done, but it may have finished after the last poll:
        # account it now, or its result (and its slot becoming the recovery buffer) would be lost.
        self.poll()
        self._persisting_slot = meta.slot
        self._stored_steps = None
        self.in_flight = self._executor.submit(self._persist_slot, meta, units, parts)
        self.started += 1

    def running(self) -> bool:
        """Whether a persist is in flight and not finished (this rank's view; the ranks sum it before deciding)."""
        return self.in_flight is not None and not self.in_flight.done()

    def slots_in_use(self) -> set[int]:
        """The slots a new snapshot must not take: the one being persisted and the recovery buffer."""
        return {s for s in (self._persisting_slot, self._recovery_slot) if s is not None}

    def poll(self) -> None:
        """Account a finished persist (never blocks); a failed one is counted and logged, and training goes on."""
        if self.in_flight is None or not self.in_flight.done():
            return
        error = self.in_flight.exception()
        self._outcomes.append(self.in_flight.result() if error is None else None)
        rank = self._pec.topology.rank
        if error is None:
            self._stats.persists += 1
            self._stats.persist_reports.append(self.in_flight.result())
            self._recovery_slot = self._persisting_slot
            self._pec.prune_ledger(in_memory=self._store.steps(), stored=self._stored_steps)
        else:
            self._stats.failed_persists += 1
            if isinstance(error, PersistFailed):  # agreed by every rank: nothing committed, the group is usable
                print(f"[moc_lightning] rank {rank}: {error}; training goes on and the next persist tries again")
            else:
                cause = find_cause(error, OSError) or error
                print(f"[moc_lightning] rank {rank}: persist raised {type(cause).__name__}: {cause} outside its "
                      "agreed phases (a peer lost?); training goes on")
        note = self._stats.retries_note(rank, "the persist just ended (and any restore or write since the last count)")
        if note is not None:
            print(note)
        self.in_flight = None
        self._persisting_slot = None

    def wait(self) -> None:
        """Wait for the persist in flight, if any, and account it."""
        if self.in_flight is not None:
            self.in_flight.exception()
        self.poll()

    def reaped(self) -> int:
        """How many persists this rank has accounted (:meth:`poll`), successful or not."""
        return len(self._outcomes)

    def agreed(self, reaped_everywhere: int) -> list[SaveReport]:
        """The successful persists among the first ``reaped_everywhere``, the number every rank has reaped (the least of
        their :meth:`reaped`, agreed by a :class:`~moc_lightning.memory.persist_vote.PersistVote`): a view of storage
        all ranks share, where the manifest itself may be mid-commit on the coordinator while others read it."""
        return [r for r in self._outcomes[:reaped_everywhere] if r is not None]

    def _persist_slot(self, meta: SlotMeta, units: tuple[Unit, ...], parts: tuple[str, ...]) -> SaveReport:
        """Persist, then read the stored steps for :meth:`poll`'s pruning of the ledger here, off the training thread
        (a manifest read: 1.1 ms a persist under cProfile on the reference machine). A failed read leaves it to
        :meth:`poll`: an outcome of the persist that every rank must see alike cannot hinge on one rank's read."""
        report = self._write_slot(meta, units, parts)
        with contextlib.suppress(Exception):
            self._stored_steps = self._pec.stored_steps()
        return report

    def _write_slot(self, meta: SlotMeta, units: tuple[Unit, ...], parts: tuple[str, ...]) -> SaveReport:
        wanted = {u.key for u in units}
        keys = [k for k in meta.entries if parse_unit(k).key in wanted or part_key_of(k) in parts]
        return self._pec.persist(
            meta.step,
            units,
            parts=parts,
            from_slot=self._store.read(meta, keys),
            engine_state=meta.extra["engine"],
            trainer_state=meta.extra["trainer"],
            before_commit=lambda: self._faults.at("persist", meta.step),
        )
