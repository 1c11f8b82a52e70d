"""Token accounting: the router counts of every step, reduced over ranks into the ledger at each checkpoint, the
PLT of a recovery (eq. 7) and Dynamic-K's answer to it.

Kept apart from saving and loading because it is the one part of the engine that runs every training step (the
counts) and the one whose state (ledger, K) travels inside every checkpoint's engine state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.ledger import DynamicK, FaultReport, TokenLedger
from moc_lightning.engine.routing import RouterCounts
from moc_lightning.runtime.agreement import StartedReduction
from moc_lightning.runtime.distributed import collective_device


@dataclass(frozen=True)
class TokenMark:
    """The ledger's mark of a checkpoint step under way: the router counts recorded before it, being summed over the
    ranks (:meth:`TokenAccounting.start_mark`)."""

    step: int
    """The checkpoint step the counts are marked at."""
    reduction: StartedReduction
    """Every MoE layer's counts of each expert, then each layer's tokens x top_k, flat, summed over the ranks."""
    layers: int
    """How many MoE layers: the last :attr:`layers` of :attr:`reduction`'s values are their tokens x top_k."""

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens each expert processed on all ranks, flat (every MoE layer's experts in turn), and each layer's
        tokens x top_k assigned, as :meth:`TokenLedger.record_all` takes them (waits for the sum)."""
        values = self.reduction.result().cpu()
        return values[: -self.layers], values[-self.layers :]


class TokenAccounting:
    """Router counts -> :class:`TokenLedger` marks -> PLT of a recovery -> :class:`DynamicK`.

    Public: :meth:`record`, :meth:`start_mark`, :meth:`finish_mark`, :meth:`mark_step`, :meth:`prune`,
    :meth:`recover`, :meth:`state_dict`, :meth:`load_state_dict`; the ``ledger`` and ``dynamic_k`` they keep.
    """

    def __init__(self, cfg: CheckpointConfig, num_experts: Sequence[int], rank: int) -> None:
        """``rank``: this process's global rank (rank 0 says which K a restored state leaves in force)."""
        self.ledger = TokenLedger(num_experts)
        self.dynamic_k = DynamicK(cfg.k_snapshot, cfg.k_persist, min(num_experts), cfg.dynamic_k.plt_threshold)
        self._cfg = cfg
        self._rank = rank
        self._num_experts = list(num_experts)
        self._pending = torch.zeros(sum(num_experts), dtype=torch.int64)
        """Since the last mark, every MoE layer's counts of each expert, flat: a mark on the training thread copies
        one tensor, whatever the number of layers. On the device the counts come from (:meth:`record`)."""
        self._pending_counts = self._pending.split(self._num_experts)
        """Each layer's view of :attr:`_pending`, which :meth:`record` adds to."""
        self._pending_assigned = [0] * len(num_experts)
        self._k_choice_said: str | None = None

    def record(self, moe_layers: Sequence[RouterCounts]) -> None:
        """Add the router counts of the last step (this rank's tokens); reduced over ranks at checkpoint time.

        Counts on a GPU are added there: a copy to the host every step would wait for the step's kernels (one wait
        per MoE layer), where a mark copies the sum once per checkpoint."""
        for i, layer in enumerate(moe_layers):
            counts = layer.tokens_per_expert
            if counts.device.type != "cpu" and counts.device != self._pending.device:  # the first step on a GPU
                self._pending = self._pending.to(counts.device)
                self._pending_counts = self._pending.split(self._num_experts)
            self._pending_counts[i].add_(counts.to(self._pending.device, torch.int64))
            self._pending_assigned[i] += layer.tokens_assigned

    def start_mark(self, step: int, group: dist.ProcessGroup | None = None) -> TokenMark:
        """Start summing the router counts recorded since the last mark over all ranks, for the mark of checkpoint
        ``step``, without blocking (collective: every rank, at the same point); :meth:`finish_mark` records it.

        ``group``: a gloo group (:func:`~moc_lightning.runtime.distributed.agreement_group`) whose result may be read
        on another thread; ``None``: the default group (a CUDA tensor under NCCL)."""
        counts = self._pending.to(collective_device() if group is None else "cpu")
        flat = torch.cat([counts, torch.tensor(self._pending_assigned, dtype=torch.int64, device=counts.device)])
        self._pending.zero_()
        self._pending_assigned = [0] * len(self._pending_assigned)
        return TokenMark(step, StartedReduction(flat, group=group), len(self._pending_assigned))

    def finish_mark(self, mark: TokenMark) -> None:
        """Record ``mark``'s summed counts in the ledger and mark its step (waits for the sum if it is not done)."""
        self.ledger.record_all(*mark.counts())
        self.ledger.mark(mark.step)

    def mark_step(self, step: int) -> None:
        """Sum the router counts recorded since the last mark over all ranks and mark ``step`` in the ledger, as the
        step a checkpoint is taken at (collective, blocking: :meth:`start_mark` then :meth:`finish_mark`)."""
        self.finish_mark(self.start_mark(step))

    def prune(self, kept_steps: Sequence[int]) -> None:
        """Forget token marks older than every step in ``kept_steps`` (stored versions and snapshots)."""
        if kept_steps:
            self.ledger.prune(min(kept_steps))

    def recover(self, resume_step: int, restored_from: list[list[int]]) -> tuple[FaultReport, bool]:
        """PLT of the recovery to ``resume_step`` (eq. 7; ``restored_from``: per MoE layer, the step each expert
        came from), then Dynamic-K; returns the fault and whether K changed."""
        fault = self.ledger.recover(resume_step, restored_from)
        k_changed = self._cfg.dynamic_k.enabled and self.dynamic_k.after_recovery(fault, self.ledger.accumulated_plt)
        return fault, k_changed

    def state_dict(self, pending: TokenMark | None = None) -> dict[str, Any]:
        """The ledger and K, JSON-able (part of the engine state saved with every checkpoint). ``pending``: as it will
        be once that mark is finished (:meth:`finish_mark`), without changing the ledger: a snapshot's commit reads it
        on the copy thread while the training thread owns the ledger."""
        ledger = self.ledger.state_dict() if pending is None else self.ledger.state_dict_after(*pending.counts(),
                                                                                              pending.step)
        return {"ledger": ledger, "dynamic_k": self.dynamic_k.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the ledger and K of an engine state; K follows :meth:`DynamicK.load_state_dict` (and says so)."""
        self.ledger.load_state_dict(state["ledger"])
        self.dynamic_k.load_state_dict(state["dynamic_k"])
        choice = self.dynamic_k.describe_choice(state["dynamic_k"])
        if choice is not None and self._rank == 0 and choice != self._k_choice_said:
            print(f"[moc_lightning] {choice}")
            self._k_choice_said = choice
