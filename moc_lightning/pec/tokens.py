"""Token accounting: the router counts of every step, reduced over ranks into the ledger at each checkpoint, the
PLT of a recovery (eq. 7) and Dynamic-K's answer to it.

Kept apart from saving and loading because it is the one part of the engine that runs every training step (the
counts) and the one whose state (ledger, K) travels inside every checkpoint's engine state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.ledger import DynamicK, FaultReport, TokenLedger
from moc_lightning.engine.routing import RouterCounts
from moc_lightning.runtime.distributed import collective_device


class TokenAccounting:
    """Router counts -> :class:`TokenLedger` marks -> PLT of a recovery -> :class:`DynamicK`.

    Public: :meth:`record`, :meth:`mark_step`, :meth:`prune`, :meth:`recover`, :meth:`state_dict`,
    :meth:`load_state_dict`; the ``ledger`` and ``dynamic_k`` they keep.
    """

    def __init__(self, cfg: CheckpointConfig, num_experts: Sequence[int], rank: int) -> None:
        """``rank``: this process's global rank (rank 0 says which K a restored state leaves in force)."""
        self.ledger = TokenLedger(num_experts)
        self.dynamic_k = DynamicK(cfg.k_snapshot, cfg.k_persist, min(num_experts), cfg.dynamic_k.plt_threshold)
        self._cfg = cfg
        self._rank = rank
        self._pending = [torch.zeros(n, dtype=torch.int64) for n in num_experts]
        self._pending_assigned = [0] * len(num_experts)
        self._k_choice_said: str | None = None

    def record(self, moe_layers: Sequence[RouterCounts]) -> None:
        """Add the router counts of the last step (this rank's tokens); reduced over ranks at checkpoint time."""
        for i, layer in enumerate(moe_layers):
            self._pending[i] += layer.tokens_per_expert.to("cpu", torch.int64)
            self._pending_assigned[i] += layer.tokens_assigned

    def mark_step(self, step: int, also_sum: Sequence[int] = ()) -> list[int]:
        """Reduce the router counts recorded since the last mark over all ranks (collective: every rank, on the
        training thread) and mark ``step`` in the ledger, as the step a checkpoint is taken at.

        ``also_sum``: integers of the caller's to sum over the ranks in the same all-reduce (one collective where
        a snapshot would need two; each waits for the slowest rank); returns their sums."""
        sums = self._sync_tokens(also_sum)
        self.ledger.mark(step)
        return sums

    def _sync_tokens(self, also_sum: Sequence[int]) -> list[int]:
        flat = torch.cat([
            *self._pending,
            torch.tensor(self._pending_assigned, dtype=torch.int64),
            torch.tensor(list(also_sum), dtype=torch.int64),
        ])
        if dist.is_initialized():
            # default group, on the training thread (persists use their own gloo group)
            flat = flat.to(collective_device())
            dist.all_reduce(flat)
            flat = flat.cpu()
        sizes = [len(p) for p in self._pending] + [len(self._pending_assigned), len(also_sum)]
        *counts, assigned, sums = flat.split(sizes)
        for i, c in enumerate(counts):
            self.ledger.record(i, c, int(assigned[i]))
        self._pending = [torch.zeros_like(p) for p in self._pending]
        self._pending_assigned = [0] * len(self._pending_assigned)
        return [int(v) for v in sums]

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

    def state_dict(self) -> dict[str, Any]:
        """The ledger and K, JSON-able (part of the engine state saved with every checkpoint)."""
        return {"ledger": self.ledger.state_dict(), "dynamic_k": self.dynamic_k.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the ledger and K of an engine state; K follows :meth:`DynamicK.load_state_dict` (and says so)."""
        self.ledger.load_state_dict(state["ledger"])
        self.dynamic_k.load_state_dict(state["dynamic_k"])
        choice = self.dynamic_k.describe_choice(state["dynamic_k"])
        if choice is not None and self._rank == 0 and choice != self._k_choice_said:
            print(f"[moc_lightning] {choice}")
            self._k_choice_said = choice
