"""Collective agreement: decisions every rank takes together, after the process group exists.

A decision one rank takes alone (a file only it saw, a commit only it ran, a manifest it read a moment
later than the others) is a hang or a mixed state waiting to happen (DESIGN.md, hard part 9). The helpers
here make one rank's view everyone's (:func:`from_coordinator`) or check that every rank's view is the same
(:func:`check_same`), and they raise the same error on every rank, so all ranks take the same path.

A decision the training thread must not wait for is started as a :class:`StartedReduction` (a non-blocking
all-reduce) and read later, where its result is needed: every rank issues it at the same point, and every rank reads
the same reduced values, so the decision is still the same everywhere.

Without a process group (one process) they are the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class AgreementError(RuntimeError):
    """Ranks disagree about something they must agree on; raised on every rank alike."""


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def from_coordinator(compute: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run ``compute`` on the group's first rank and return its result on every rank.

    If it raises there, every rank raises :class:`AgreementError` with the coordinator's message (the
    coordinator chains the original), instead of the others waiting for a broadcast that never comes.
    """
    if _world(group) == 1:
        return compute()
    coordinator = dist.get_global_rank(group, 0) if group is not None else 0
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == coordinator:
        try:
            payload[0] = ("ok", compute())
        except Exception as err:  # shared with every rank below, raised everywhere
            error = err
            payload[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=coordinator, group=group)
    status, value = payload[0]
    if status == "error":
        raise AgreementError(f"rank {coordinator} failed: {value}") from error
    return value


def gather(value: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's ``value``, in rank order (collective)."""
    if _world(group) == 1:
        return [value]
    parts: list[Any] = [None] * _world(group)
    dist.all_gather_object(parts, value, group=group)
    return parts


def check_same(value: Any, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`AgreementError` on every rank unless every rank passed an equal ``value``."""
    values = gather(value, group)
    if any(v != values[0] for v in values):
        shown = ", ".join(f"rank {r}: {v!r:.60}" for r, v in enumerate(values))
        raise AgreementError(f"ranks disagree on {what} ({shown})")


class StartedReduction:
    """An all-reduce of ``values`` in place, started without blocking (``async_op``) and read later.

    Issue it where every rank issues its collectives on ``group`` in the same order (the training thread); read it
    (:meth:`result`) wherever the answer is needed, on any thread. Every rank reads the same reduced values, or the
    same collective's error (a lost peer): a decision taken from them is agreed as if the collective had blocked.
    """

    def __init__(
        self,
        values: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        group: dist.ProcessGroup | None = None,
        blocking: bool = False,
    ) -> None:
        """``blocking``: wait for it now, as a plain collective (a caller that needs the result at once)."""
        self._values = values
        self._work = None
        if _world(group) > 1:
            self._work = dist.all_reduce(values, op=op, group=group, async_op=not blocking)

    def result(self) -> torch.Tensor:
        """The reduced values, once every rank's are in (waits for the collective; raises its error)."""
        if self._work is not None:
            self._work.wait()
        return self._values
