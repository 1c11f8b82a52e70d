"""ETTR against the job's mean time between failures (MTBF) for full checkpoints, PEC with Dynamic-K and replay
mode, from the costs ``recipes/bench.py`` measured on this machine (issue 14, item 4), or from the costs of a job of
16,384 ranks that :mod:`moc_lightning.tools.scale_projection` puts together (issue 30, item 4).

MoEvement (NSDI'26) puts MoC at ETTR 0.134 under a fault every 10 minutes; this asks what the methods as built
here would reach at 10 min, 30 min, 2 h and 3.1 h (Llama 3: 419 unexpected interruptions in 54 days). The model,
per method, in seconds of wall-clock time:

- **Busy iteration**: the no-checkpoint iteration plus the method's stall spread over its interval,
  ``iteration + stall / interval`` (the bench's timers: a stall is the training thread's wait, not a difference
  of iteration times).
- **Faults** arrive as a Poisson process over wall-clock time at one per MTBF (the whole job's, not a GPU's);
  each costs ``per_fault`` seconds: a fixed ``restart_seconds`` (rescheduling; not measured here, 0 by default),
  the measured recovery, and the lost work redone at the busy iteration's pace. With
  :func:`~moc_lightning.tools.projection.expected_faults`, ``ETTR = iteration / busy * (1 - per_fault / MTBF)``, and 0
  once a fault costs an MTBF.
- **Full checkpoints** (the bench's ``moc_full``: two-level, every expert): every ``interval`` iterations, the
  interval being Young's optimum ``sqrt(2 * stall * MTBF)`` for that MTBF, but never shorter than the checkpoint's
  background work (``*_background``: its write plan, write, global plan and commit off the training thread), since at
  most one persist is in flight and a checkpoint cannot start before the previous one is done; a fault redoes half
  an interval on average, and loses no tokens. From a bench the background is 0 (no floor): there a persist takes
  tenths of a second (moc_full: 0.23 GB at 0.7-1.1 GB/s), well under Young's interval at the MTBFs projected; a job
  of 16,384 ranks has one.
- **PEC with Dynamic-K** (the same machinery saving K of N experts per MoE layer): stall, background and recovery are
  the ``moc_k1`` and ``moc_full`` figures interpolated linearly in K (eq. 6 is linear in K), the interval is Young's
  for that stall, floored by that background. Each fault also sends every expert back to its newest saved version:
  with sequential selection an expert is on average ``(N/K - 1) / 2`` intervals stale, so the accumulated PLT (eq. 7:
  lost tokens over the run's tokens) is ``faults per iteration * interval * (N/K - 1) / 2``, the same however long the
  run. Dynamic-K doubles K until that stays under the threshold (3.75%) or K = N; the run is costed at that final K
  throughout (Dynamic-K starts lower, so this overstates its cost a little and never its PLT).
- **Replay** (``checkpoint.mode=replay``): a capture every iteration (its stall per iteration, interval 1) and no lost
  tokens: a recovery restores the newest complete window and replays up to W-1 iterations (the bench's recovery
  time includes that replay), then redoes the iterations of the window that was incomplete at the fault,
  ``(W - 1) / 2`` on average.

Every method recovers at the bench's in-process recovery speed (from the shared-memory slots for MoC's PEC, from
the window in storage for replay); node loss, other fault kinds and the cluster's restart are outside the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from moc_lightning.tools.projection import ettr, expected_faults

METHODS = ("full", "pec+dynamic_k", "replay")
LLAMA3_JOB_MTBF_SECONDS = 54 * 24 * 3600 / 419
"""Llama 3's 16,384-GPU job: 419 unexpected interruptions in 54 days, one every ~3.1 h."""
DEFAULT_MTBFS = ("10m", "30m", "2h", "3.1h")


@dataclass(frozen=True)
class CheckpointCosts:
    """What each method costs one process, in seconds: as the bench measured them (:meth:`from_bench`), or a job's
    at scale (:mod:`moc_lightning.tools.scale_projection`, which labels each input measured, estimated or assumed)."""

    iteration_seconds: float
    """Mean iteration without checkpointing (the bench's baseline)."""
    num_experts: int
    """N, experts per MoE layer."""
    full_stall: float
    """Stall of one checkpoint of every expert (``moc_full``)."""
    full_recover: float
    """Recovery of ``moc_full``."""
    k1_stall: float
    """Stall of one PEC checkpoint with K=1 (``moc_k1``)."""
    k1_recover: float
    """Recovery of ``moc_k1``."""
    replay_stall_per_iteration: float
    """Replay mode's cost per iteration (a capture every iteration, a window written every W): its stall, or, when
    larger, the iteration time it added over a no-checkpoint run trained beside it (its copy thread and background
    writes take cores from training on a small host, which no stall shows)."""
    replay_recover: float
    """Replay mode's recovery, its replay included."""
    replay_seconds: float
    """The replay part of ``replay_recover`` (reported, not used apart)."""
    replay_window: int
    """W of the measured replay run."""
    plt_threshold: float = 0.0375
    """Dynamic-K's threshold on accumulated PLT (the paper's 3.75%)."""
    restart_seconds: float = 0.0
    """Fixed cost of a restart before recovery starts (rescheduling, start-up); not measured by the bench."""
    full_background: float = 0.0
    """Work of one ``moc_full`` checkpoint off the training thread (plan, write, global plan, commit): the least
    time between two checkpoints, one persist being in flight at most. 0: no floor (:meth:`from_bench`)."""
    k1_background: float = 0.0
    """The same for PEC with K=1."""

    def __post_init__(self) -> None:
        for name in ("iteration_seconds", "num_experts", "replay_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CheckpointCosts.{name} must be > 0, got {getattr(self, name)}")
        for name in ("full_stall", "full_recover", "k1_stall", "k1_recover", "replay_stall_per_iteration",
                     "replay_recover", "replay_seconds", "restart_seconds", "full_background",
                     "k1_background"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"CheckpointCosts.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.plt_threshold <= 1:
            raise ValueError(f"CheckpointCosts.plt_threshold must be in (0, 1], got {self.plt_threshold}")

    @classmethod
    def from_bench(cls, bench: Mapping[str, Any], **overrides: Any) -> CheckpointCosts:
        """From a ``recipes/bench.py`` result with measured ``moc_full``, ``moc_k1`` and ``moc_replay`` rows."""
        rows = {row["name"]: row for row in bench.get("methods", []) if not row.get("skipped")}
        for name in ("moc_full", "moc_k1", "moc_replay"):
            if name not in rows:
                raise ValueError(f"the bench result has no measured {name} row; run recipes/bench.py with "
                                 "methods including moc_full, moc_k1 and moc_replay")  # fmt: skip
        if "replay_window" not in bench:
            raise ValueError(
                "the bench result does not say moc_replay's window (replay_window): rerun recipes/bench.py"
            )
        full, k1, replay = rows["moc_full"], rows["moc_k1"], rows["moc_replay"]
        return cls(
            iteration_seconds=bench["baseline_iter_ms"] / 1000,
            num_experts=int(bench["model"]["num_experts"]),
            full_stall=full["stall_ms_mean"] / 1000,
            full_recover=full["recover_seconds"],
            k1_stall=k1["stall_ms_mean"] / 1000,
            k1_recover=k1["recover_seconds"],
            replay_stall_per_iteration=max(
                replay["stall_ms_per_iteration"],
                (replay.get("paired_overhead_pct") or 0.0) / 100 * bench["baseline_iter_ms"],
            ) / 1000,
            replay_recover=replay["recover_seconds"],
            replay_seconds=replay["replay_seconds"],
            replay_window=int(bench["replay_window"]),
            **overrides,
        )

    def pec(self, k: int) -> tuple[float, float, float]:
        """(stall per checkpoint, recovery, background) of PEC with K experts per layer, linear in K between K=1 and
        K=N."""
        share = (k - 1) / (self.num_experts - 1) if self.num_experts > 1 else 1.0
        return (self.k1_stall + share * (self.full_stall - self.k1_stall),
                self.k1_recover + share * (self.full_recover - self.k1_recover),
                self.k1_background + share * (self.full_background - self.k1_background))  # fmt: skip


@dataclass(frozen=True)
class MtbfPoint:
    """One method at one MTBF."""

    method: str
    mtbf_seconds: float
    k: int | None
    """Experts per MoE layer saved (N for full checkpoints, Dynamic-K's final K for PEC, ``None`` for replay)."""
    interval: int
    """Iterations between checkpoints (1 for replay: a capture every iteration)."""
    interval_floor: int
    """The least interval the checkpoint's background work allows (1: no floor); ``interval`` is Young's, or this
    where Young's is shorter."""
    stall_per_iteration: float
    """Seconds of stall per iteration."""
    per_fault_seconds: float
    """Restart, recovery and lost work of one fault."""
    plt: float
    """Accumulated proportion of lost tokens over the run (0 for full checkpoints and replay)."""
    ettr: float
    """Effective training time ratio."""


def young_interval(stall: float, iteration_seconds: float, mtbf_seconds: float) -> int:
    """Young's optimal checkpoint interval ``sqrt(2 * stall * MTBF)``, in whole iterations (at least 1)."""
    return max(1, round(math.sqrt(2 * stall * mtbf_seconds) / iteration_seconds))


def background_floor(background: float, iteration_seconds: float) -> int:
    """The fewest iterations between two checkpoints whose background work takes ``background`` seconds: one persist
    in flight at most, so the next checkpoint waits for it (at least 1)."""
    return max(1, math.ceil(background / iteration_seconds))


def accumulated_plt(busy_seconds: float, interval: int, k: int, num_experts: int, mtbf_seconds: float) -> float:
    """PLT accumulated by PEC over a run: ``busy / MTBF`` faults per iteration, each costing every expert's tokens of
    ``(N/K - 1) / 2`` intervals on average (sequential selection)."""
    return busy_seconds / mtbf_seconds * interval * (num_experts / k - 1) / 2


def _point(
    method: str, costs: CheckpointCosts, mtbf: float, k: int | None, interval: tuple[int, int],
    stall_per_iteration: float, recover: float, lost_iterations: float, plt: float,
) -> MtbfPoint:
    busy = costs.iteration_seconds + stall_per_iteration
    per_fault = costs.restart_seconds + recover + lost_iterations * busy
    faults = expected_faults(busy, per_fault, mtbf)  # per iteration of useful work
    overhead = stall_per_iteration + (faults * per_fault if per_fault else 0.0)
    return MtbfPoint(method, mtbf, k, *interval, stall_per_iteration, per_fault, plt,
                     ettr(costs.iteration_seconds, overhead))  # fmt: skip


def _checkpointed(method: str, costs: CheckpointCosts, mtbf: float, k: int) -> MtbfPoint:
    """A method saving K experts per layer every Young's interval, or every floor interval where its background work
    takes longer; a fault redoes half an interval."""
    stall, recover, background = costs.pec(k)
    floor = background_floor(background, costs.iteration_seconds)
    interval = max(young_interval(stall, costs.iteration_seconds, mtbf), floor)
    busy = costs.iteration_seconds + stall / interval
    plt = accumulated_plt(busy, interval, k, costs.num_experts, mtbf)
    return _point(method, costs, mtbf, k, (interval, floor), stall / interval, recover, interval / 2, plt)


def project_full(costs: CheckpointCosts, mtbf_seconds: float) -> MtbfPoint:
    """Every expert every checkpoint (K = N): no lost tokens."""
    return _checkpointed("full", costs, mtbf_seconds, costs.num_experts)


def project_pec_dynamic_k(costs: CheckpointCosts, mtbf_seconds: float) -> MtbfPoint:
    """PEC from K=1, doubled until the accumulated PLT stays under the threshold (or K = N)."""
    k = 1
    point = _checkpointed("pec+dynamic_k", costs, mtbf_seconds, k)
    while point.plt > costs.plt_threshold and k < costs.num_experts:
        k = min(2 * k, costs.num_experts)
        point = _checkpointed("pec+dynamic_k", costs, mtbf_seconds, k)
    return point


def project_replay(costs: CheckpointCosts, mtbf_seconds: float) -> MtbfPoint:
    """A capture every iteration; a fault costs the recovery with its replay, and (W-1)/2 iterations redone."""
    stall = costs.replay_stall_per_iteration
    return _point("replay", costs, mtbf_seconds, None, (1, 1), stall, costs.replay_recover,
                  (costs.replay_window - 1) / 2, 0.0)  # fmt: skip


def project_mtbf(costs: CheckpointCosts, mtbfs: Iterable[float]) -> list[list[MtbfPoint]]:
    """Per MTBF, the three methods in :data:`METHODS` order."""
    return [[project(costs, m) for project in (project_full, project_pec_dynamic_k, project_replay)] for m in mtbfs]


def parse_duration(text: str) -> float:
    """``45s``, ``10m``, ``3.1h`` in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text.strip())
    if match is None:
        raise ValueError(f"mtbf duration {text!r}: use a number with s, m or h (10m, 3.1h)")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]
