"""Token ledger: router counts per expert, the Proportion of Lost Tokens (eq. 7) and Dynamic-K.

The ledger keeps, per MoE layer, the cumulative tokens each expert processed (after capacity drops) and
the cumulative tokens assigned to the layer (tokens x top_k, before drops: eq. 7's ``T_i * TopK_i``). At
every checkpoint step it marks the cumulative counts, so that after a fault the tokens an expert processed
between the step its restored version was saved (``t_e``) and the resume step ``s`` are
``cum(s)[e] - cum(t_e)[e]``: its lost tokens.

A restored expert's state *is* its old version at the resume step, so after a recovery the mark of that
version is moved to ``cum(s)``: a second fault that restores the same version again only loses what the
expert processed after ``s`` (the earlier loss was already counted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NEVER = -1
"""Step of an expert that was never saved: restored from its initial state, with zero tokens behind it."""

DEFAULT_PLT_THRESHOLD = 0.0375
"""PLT above which the paper sees accuracy degrade (section 3.1.2)."""


def check_k(k_snapshot: int, k_persist: int, num_experts: int) -> None:
    """Reject PEC sizes that cannot be selected: ``1 <= k_persist <= k_snapshot <= N``."""
    if not 1 <= k_snapshot <= num_experts:
        raise ValueError(f"k_snapshot must be in [1, {num_experts}] (experts per MoE layer), got {k_snapshot}")
    if not 1 <= k_persist <= k_snapshot:
        raise ValueError(f"k_persist must be in [1, k_snapshot={k_snapshot}], got {k_persist}")


def proportion_lost(lost: Sequence[int], assigned: Sequence[int]) -> float:
    """Eq. 7: mean over MoE layers of lost tokens / (T_i * TopK_i); a layer with no tokens yet loses none."""
    if len(lost) != len(assigned) or not lost:
        raise ValueError(f"need lost and assigned counts for the same MoE layers, got {len(lost)} and {len(assigned)}")
    return sum(lo / a if a else 0.0 for lo, a in zip(lost, assigned)) / len(lost)


@dataclass(frozen=True)
class FaultReport:
    """Accounting of one recovery."""

    resume_step: int
    lost: tuple[torch.Tensor, ...]
    """Per MoE layer, lost tokens of each expert (``[N]`` int64)."""
    assigned: tuple[int, ...]
    """Per MoE layer, cumulative tokens x top_k up to the resume step."""

    @property
    def lost_per_layer(self) -> tuple[int, ...]:
        return tuple(int(t.sum()) for t in self.lost)

    @property
    def plt(self) -> float:
        """PLT of this fault alone."""
        return proportion_lost(self.lost_per_layer, self.assigned)


@dataclass(frozen=True)
class _Counts:
    """Cumulative counts: every MoE layer's tokens of each expert, flat, and each layer's tokens x top_k. One tensor
    each, so that a checkpoint's record and mark take a tensor operation each, however many layers there are."""

    flat: torch.Tensor
    assigned: torch.Tensor
    processed: tuple[torch.Tensor, ...]
    """Each layer's view of :attr:`flat`."""

    @staticmethod
    def of(flat: torch.Tensor, assigned: torch.Tensor, num_experts: Sequence[int]) -> _Counts:
        return _Counts(flat, assigned, flat.split(list(num_experts)))

    def clone(self) -> _Counts:
        return _Counts.of(self.flat.clone(), self.assigned.clone(), [len(p) for p in self.processed])


class TokenLedger:
    """Cumulative router counts, their marks at checkpoint steps, and the PLT accumulated over faults."""

    def __init__(self, num_experts: Sequence[int]) -> None:
        self.num_experts = tuple(num_experts)
        zeros = _Counts.of(
            torch.zeros(sum(self.num_experts), dtype=torch.int64),
            torch.zeros(len(self.num_experts), dtype=torch.int64),
            self.num_experts,
        )
        self._now = zeros
        self._marks: dict[int, _Counts] = {NEVER: zeros.clone()}
        self._lost_total = [0] * len(self.num_experts)
        self._plt_denominator = [0] * len(self.num_experts)

    def record(self, layer: int, counts: torch.Tensor, assigned: int) -> None:
        """Add one step of MoE layer ``layer``: tokens each expert processed, and tokens x top_k assigned."""
        if counts.shape != (self.num_experts[layer],):
            raise ValueError(
                f"counts of MoE layer {layer} must have shape [{self.num_experts[layer]}], got {list(counts.shape)}"
            )
        self._now.processed[layer].add_(counts.detach().to("cpu", torch.int64))
        self._now.assigned[layer] += int(assigned)

    def record_all(self, counts: torch.Tensor, assigned: torch.Tensor) -> None:
        """:meth:`record` of every MoE layer at once: ``counts`` flat (layer 0's experts, then layer 1's, ...) and
        ``assigned`` one per layer."""
        if counts.shape != self._now.flat.shape or assigned.shape != self._now.assigned.shape:
            raise ValueError(
                f"counts of every MoE layer must have shape [{self._now.flat.numel()}] and assigned "
                f"[{len(self.num_experts)}], got {list(counts.shape)} and {list(assigned.shape)}"
            )
        self._now.flat.add_(counts.detach().to("cpu", torch.int64))
        self._now.assigned.add_(assigned.detach().to("cpu", torch.int64))

    def mark(self, step: int) -> None:
        """Remember the cumulative counts at checkpoint step ``step``."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self._marks[step] = self._now.clone()

    @property
    def marked_steps(self) -> tuple[int, ...]:
        return tuple(sorted(self._marks))

    def prune(self, oldest_needed: int) -> None:
        """Forget marks before ``oldest_needed``: the oldest step any expert can still be restored from.

        The ``NEVER`` mark (all zeros) stays: an expert with no surviving version is restored from scratch.
        """
        self._marks = {s: c for s, c in self._marks.items() if s >= oldest_needed or s == NEVER}

    def tokens_since(self, steps: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
        """Per MoE layer, tokens each expert processed since ``steps[layer][expert]`` (its newest saved step).

        This is what load-aware selection ranks by.
        """
        return self._since(self._now, steps)

    def recover(self, resume_step: int, restored_from: Sequence[Sequence[int]]) -> FaultReport:
        """Account a recovery to ``resume_step`` where expert ``e`` of layer ``i`` comes from ``restored_from[i][e]``.

        Rolls the counts back to the resume step (the steps after it are trained again) and forgets the
        marks after it.
        """
        at_resume = self._mark(resume_step)
        late = [(i, e, t) for i, ts in enumerate(restored_from) for e, t in enumerate(ts) if t > resume_step]
        if late:
            raise ValueError(
                f"experts restored from steps after resume step {resume_step}: (layer, expert, step) {late[:5]}"
            )
        lost = self._since(at_resume, restored_from)
        report = FaultReport(resume_step, lost, tuple(int(a) for a in at_resume.assigned))
        self._lost_total = [total + lo for total, lo in zip(self._lost_total, report.lost_per_layer)]
        self._plt_denominator = list(report.assigned)
        for layer, steps in enumerate(restored_from):
            for e, t in enumerate(steps):
                self._marks[t].processed[layer][e] = at_resume.processed[layer][e]
        self._now = at_resume.clone()
        self._marks = {s: c for s, c in self._marks.items() if s <= resume_step}
        return report

    @property
    def accumulated_plt(self) -> float:
        """Eq. 7 over all faults so far: lost tokens summed over faults / T_i*TopK_i at the latest resume."""
        return proportion_lost(self._lost_total, self._plt_denominator)

    def _mark(self, step: int) -> _Counts:
        if step not in self._marks:
            raise KeyError(f"no ledger mark at step {step}; marked steps: {list(self.marked_steps)} (pruned too far?)")
        return self._marks[step]

    def _since(self, now: _Counts, steps: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
        if len(steps) != len(self.num_experts) or any(len(s) != n for s, n in zip(steps, self.num_experts)):
            raise ValueError(f"need one step per expert of every MoE layer, shaped {list(self.num_experts)}")
        return tuple(
            now.processed[i] - torch.stack([self._mark(int(t)).processed[i][e] for e, t in enumerate(ts)])
            for i, ts in enumerate(steps)
        )

    def state_dict(self) -> dict[str, Any]:
        return self._state(self._now, self._marks)

    def state_dict_after(self, counts: torch.Tensor, assigned: torch.Tensor, step: int) -> dict[str, Any]:
        """:meth:`state_dict` as it will be once ``counts`` and ``assigned`` (one step's or interval's, as
        :meth:`record_all` takes them) are recorded and ``step`` is marked, leaving this ledger as it is (read off the
        thread that changes it)."""
        now = _Counts.of(self._now.flat + counts.to(torch.int64), self._now.assigned + assigned.to(torch.int64),
                         self.num_experts)
        return self._state(now, {**self._marks, step: now})

    def _state(self, now: _Counts, marks: Mapping[int, _Counts]) -> dict[str, Any]:
        return {
            "num_experts": list(self.num_experts),
            "now": _counts_state(now),
            "marks": {s: _counts_state(c) for s, c in marks.items()},
            "lost_total": list(self._lost_total),
            "plt_denominator": list(self._plt_denominator),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if tuple(state["num_experts"]) != self.num_experts:
            raise ValueError(
                f"ledger state is for num_experts={state['num_experts']}, this ledger has {list(self.num_experts)}"
            )
        self._now = _counts_from(state["now"])
        self._marks = {int(s): _counts_from(c) for s, c in state["marks"].items()}
        self._lost_total = [int(x) for x in state["lost_total"]]
        self._plt_denominator = [int(x) for x in state["plt_denominator"]]


def _counts_state(counts: _Counts) -> dict[str, Any]:
    """Plain lists, so the state fits a JSON manifest as well as a torch checkpoint."""
    return {"processed": [t.tolist() for t in counts.processed], "assigned": counts.assigned.tolist()}


def _counts_from(state: Mapping[str, Any]) -> _Counts:
    processed = state["processed"]
    return _Counts.of(
        torch.tensor([count for layer in processed for count in layer], dtype=torch.int64),
        torch.tensor(state["assigned"], dtype=torch.int64),
        [len(layer) for layer in processed],
    )


@dataclass
class DynamicK:
    """Dynamic-K (section 5.3): after a recovery, double K before the accumulated PLT can pass the threshold.

    The paper doubles K once the PLT accumulated under the current K passes its limit; applied literally
    that reacts one fault too late, since the fault that crosses the limit has already been paid. Here
    the limit is projected: the next fault is assumed to cost what this one did, scaled by ``K / K'`` for
    a larger ``K'`` (each doubling halves the experts left behind). K doubles until the accumulated PLT
    plus that projection fits under the threshold, or until every expert is saved (``K = N``). Both levels
    double (capped at N), so ``k_persist <= k_snapshot`` still holds.
    """

    k_snapshot: int
    k_persist: int
    num_experts: int
    threshold: float = DEFAULT_PLT_THRESHOLD
    raised: bool = False
    """Whether Dynamic-K has raised K in this run's lineage (restored state keeps its K only then)."""

    def __post_init__(self) -> None:
        check_k(self.k_snapshot, self.k_persist, self.num_experts)
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"plt_threshold must be in (0, 1), got {self.threshold}")
        self.configured = (self.k_snapshot, self.k_persist)
        """The K the user set for this process; it wins over a restored K that Dynamic-K did not raise."""

    def after_recovery(self, report: FaultReport, accumulated_plt: float) -> bool:
        """Adjust K after the recovery ``report``, with ``accumulated_plt`` over all faults so far.

        Returns whether K changed.
        """
        projected = report.plt
        changed = False
        while self.k_persist < self.num_experts and accumulated_plt + projected > self.threshold:
            self.k_snapshot = min(2 * self.k_snapshot, self.num_experts)
            self.k_persist = min(2 * self.k_persist, self.num_experts)
            projected /= 2
            changed = True
        self.raised = self.raised or changed
        return changed

    def state_dict(self) -> dict[str, Any]:
        return {"k_snapshot": self.k_snapshot, "k_persist": self.k_persist, "raised": self.raised}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take K from a restored run: the configured K wins, unless Dynamic-K had raised K above it.

        A user who restarts with another ``k_snapshot``/``k_persist`` means it; a K that Dynamic-K raised
        after faults is kept (never lowered by a restart), and raised further if the user asks for more.
        """
        restored = (int(state["k_snapshot"]), int(state["k_persist"]))
        check_k(*restored, self.num_experts)
        self.raised = bool(state.get("raised", False))
        chosen = tuple(max(c, r) for c, r in zip(self.configured, restored)) if self.raised else self.configured
        self.k_snapshot, self.k_persist = chosen

    def describe_choice(self, state: Mapping[str, Any]) -> str | None:
        """One line saying which K won when a restored state differs from the configured K; ``None`` if equal."""
        restored = (int(state["k_snapshot"]), int(state["k_persist"]))
        if restored == self.configured:
            return None
        why = "Dynamic-K had raised it" if self.raised else "the configured K wins unless Dynamic-K raised K"
        return (
            f"k_snapshot/k_persist: restored {restored[0]}/{restored[1]}, configured {self.configured[0]}/"
            f"{self.configured[1]}; using {self.k_snapshot}/{self.k_persist} ({why})"
        )
