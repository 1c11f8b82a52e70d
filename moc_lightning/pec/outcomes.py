"""Collective outcomes on the persist group: every rank learns every rank's failure of a phase, and fails alike.

A persist, a manifest commit and a load are all-or-nothing across ranks (DESIGN.md, hard part 9): a rank that
decided alone would hang its peers or leave a mixed state. These helpers share one phase's outcome with one small
all-gather, and name the persist group's coordinator (its rank 0, the one that writes the manifest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moc_lightning.storage import find_cause


class AgreedFailure(RuntimeError):
    """An operation on the persist group that failed on some rank, raised alike on every rank.

    ``failures`` maps each failing rank to what failed there (``"<where>: <Type>: <message>"``); the
    message names the lowest failing rank, so every rank's message is the same.
    """

    def __init__(self, what: str, failures: Mapping[int, str], outcome: str) -> None:
        rank, detail = min(failures.items())
        super().__init__(f"{what} failed on rank {rank} ({detail}); {outcome}")
        self.failures = dict(failures)


class PersistFailed(AgreedFailure):
    """A persist that failed on some rank: nothing of it is committed, and every rank raises this."""

    def __init__(self, name: str, failures: Mapping[int, str]) -> None:
        super().__init__(f"persist of {name}", failures, "nothing was committed")
        self.name = name


@dataclass(frozen=True)
class Failure:
    """One rank's failure of a phase: the rank it happened on, one line saying what, and (locally) the error."""

    rank: int
    text: str
    error: BaseException | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, where: str, err: BaseException, rank: int) -> Failure:
        """``err`` raised at ``where`` on ``rank``: DCP reports every rank's failure on every rank, so the
        rank that really failed is taken from it; the OS error behind it (a full disk) is named if any."""
        dcp_failure = find_cause(err, CheckpointException)
        cause: BaseException = err
        if dcp_failure is not None and dcp_failure.failures:
            rank, (cause, _) = min(dcp_failure.failures.items())
        cause = find_cause(cause, OSError) or cause
        return cls(rank, f"{where}: {type(cause).__name__}: {cause}"[:500], err)


def gather_failures(failure: Failure | None, group: dist.ProcessGroup | None) -> dict[int, str]:
    """Every rank's failure (failing rank -> what failed), gathered from all ranks of ``group`` (collective)."""
    mine = None if failure is None else (failure.rank, failure.text)
    outcomes: list[tuple[int, str] | None] = [mine]
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size(group)
        dist.all_gather_object(outcomes, mine, group=group)
    return dict(sorted(o for o in outcomes if o is not None))


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def is_coordinator(group: dist.ProcessGroup | None) -> bool:
    """Whether this process is ``group``'s rank 0, the one that commits (always, without a process group)."""
    return not dist.is_initialized() or dist.get_rank(group) == 0


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``group`` (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier(group=group)
