"""Whether a snapshot may start a persist: agreed by every rank, without the training thread waiting for the others.

At most one persist is in flight (its slot is one of the triple buffer's, its collectives run on the persist group),
so a persist-due snapshot persists only if no rank still has the previous one running, and every rank must take the
same decision, or the persist's collectives would not match across ranks. That needs every rank's state: one
all-reduce. Taken at the snapshot, it is a collective on the training thread that waits for the slowest rank and
whose latency grows with the world size.

So the vote is started ahead, without blocking (:meth:`PersistVote.start`; the callback starts it at the batch end
before a snapshot step), and read at the snapshot (:meth:`PersistVote.result`), a forward, backward and optimizer
step later, when it has long arrived. A vote counts only if no persist started after it was sampled (persist starts
are agreed, so every rank knows alike whether its vote is that recent): a persist that had finished on every rank
then has finished at the snapshot too, since none started in between; one still running then skips this persist,
as it would have at the snapshot. Where no vote is that recent (snapshots at every step, whose previous persist
started after the batch end before; the engine driven without the callback), the vote is taken at the snapshot,
blocking, as it always was. Before the first persist none can be running, and no vote is needed.

The same all-reduce carries the number of persists every rank has accounted (the least of their counts), for the
selections that read where units are stored (:meth:`~moc_lightning.memory.persisting.PersistQueue.agreed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moc_lightning.memory.persisting import PersistQueue
from moc_lightning.runtime.agreement import StartedReduction


@dataclass(frozen=True)
class Vote:
    """What every rank agreed on for one snapshot."""

    persisting: bool
    """Whether some rank's persist may still be running (a persist now would be a second one in flight)."""
    reaped_everywhere: int
    """How many persists every rank has accounted."""
    blocked: bool
    """Whether the training thread waited for the other ranks: no vote started ahead was recent enough."""


@dataclass(frozen=True)
class _Started:
    """A vote under way and how many persists had started when it was sampled."""

    reduction: StartedReduction
    after_starts: int


class PersistVote:
    """Votes on whether any rank has a persist in flight, started ahead and read at a snapshot.

    Public: :meth:`start`, :meth:`result`.
    """

    def __init__(self, persists: PersistQueue, group: dist.ProcessGroup | None) -> None:
        """``group``: a gloo group (:func:`~moc_lightning.runtime.distributed.agreement_group`) that only the training
        thread issues collectives on; ``None`` with one process."""
        self._persists = persists
        self._group = group
        self._started: _Started | None = None

    def start(self) -> None:
        """Start the vote of the next snapshot without blocking (collective: every rank at the same point). Does
        nothing while no persist has started, since none can be running."""
        if self._persists.started > 0:
            self._started = self._sample()

    def result(self) -> Vote:
        """The vote of the snapshot taken now: the one started ahead if no persist started since, else one taken now,
        blocking (collective then)."""
        started, self._started = self._started, None
        if self._persists.started == 0:
            return Vote(persisting=False, reaped_everywhere=0, blocked=False)
        blocked = started is None or started.after_starts != self._persists.started
        if started is None or blocked:
            started = self._sample(blocking=True)
        running, minus_reaped = started.reduction.result().tolist()
        return Vote(persisting=running > 0, reaped_everywhere=-minus_reaped, blocked=blocked)

    def _sample(self, blocking: bool = False) -> _Started:
        """This rank's persist now (finished ones accounted first), in an all-reduce started on every rank: the
        largest of the running flags and of the negated accounted counts. ``blocking``: waited for at once."""
        persists = self._persists
        persists.poll()
        values = torch.tensor([int(persists.running()), -persists.reaped()], dtype=torch.int64)
        return _Started(StartedReduction(values, dist.ReduceOp.MAX, self._group, blocking), persists.started)
