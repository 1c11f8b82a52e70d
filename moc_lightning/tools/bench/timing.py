"""Timers around the work a method does (:func:`timed`), the callbacks that clock steps and align ranks, and the
rows of figures a method's run yields."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning as L
import torch.distributed as dist

if TYPE_CHECKING:  # the bounds measure through fitting, which imports this module
    from moc_lightning.tools.bench.bounds import Bounds


def timed(
    obj: Any, name: str, sink: list[tuple[int, float]], step: Callable[[], int],
    only: Callable[..., bool] = lambda *args, **kwargs: True,
) -> None:
    """Replace ``obj.name`` by a wrapper that appends ``(step(), seconds)`` of every call (for which ``only`` of
    its arguments holds) to ``sink``.

    Patching the instance (not the class) times exactly the object a Trainer calls, whichever thread it
    runs on, without changing what it does.
    """
    inner = getattr(obj, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        at = step()
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if only(*args, **kwargs):
                sink.append((at, time.perf_counter() - start))

    setattr(obj, name, wrapper)


class StepClock(L.Callback):
    """Start time of every training iteration, wall clock and this process's CPU time (every thread's: training's
    and the checkpointing threads'); with ``stop_after_first``, training stops after one."""

    def __init__(self, stop_after_first: bool = False) -> None:
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.stop_after_first = stop_after_first

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stop_after_first:
            trainer.should_stop = True

    def iteration_seconds(self, skip: int) -> list[float]:
        """Start-to-start durations: each includes whatever checkpointing blocked that iteration."""
        return [b - a for a, b in zip(self.starts, self.starts[1:])][skip:]

    def cpu_seconds(self, skip: int) -> list[float]:
        """Start-to-start CPU time of the process: each includes what checkpointing threads used meanwhile."""
        return [b - a for a, b in zip(self.cpu_starts, self.cpu_starts[1:])][skip:]


class AlignRanks(L.Callback):
    """A barrier at the end of every training iteration, before any checkpoint callback runs (several processes only).

    Ranks drift apart within an iteration (one is preempted, or its share took longer); synchronous training waits
    the lag out at its next collective. Without the barrier, the first blocking collective of a checkpoint (DCP's
    planning; MoC's vote where it is taken at the snapshot) is where it is waited out, and the stall timed around the
    checkpoint callback would charge training's own lag to the checkpoint: on the loaded 2-core machine 0-90 ms under
    ``fsdp2``, more than MoC's own work. Every run, the baseline included, gets the same barrier, so iteration times stay comparable.
    """

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


@dataclass
class Probe:
    """What one method's run recorded: ``(global_step, seconds)`` of each timed call."""

    blocking: list[tuple[int, float]] = field(default_factory=list)
    """The checkpoint callback's hook on the training thread."""
    joins: list[tuple[int, float]] = field(default_factory=list)
    """The checkpoint callback's hook before each optimizer step (MoC: the join of the copy thread's work)."""
    snapshot: list[tuple[int, float]] = field(default_factory=list)
    """Copies of the state into memory, where the method makes one."""
    persist: list[tuple[int, float]] = field(default_factory=list)
    """Writes to storage."""


@dataclass
class Row:
    """One method's line of the result; ``docs/bench.md`` documents every field. ``None``: no such phase."""

    name: str
    skipped: str | None = None
    checkpoints: int | None = None
    stall_ms_mean: float | None = None
    stall_ms_p95: float | None = None
    stall_ms_per_iteration: float | None = None
    iter_ms_mean: float | None = None
    iter_ms_median: float | None = None
    overhead_pct: float | None = None
    paired_baseline_iter_ms: float | None = None
    paired_overhead_pct: float | None = None
    cpu_overhead_pct: float | None = None
    paired_cpu_overhead_pct: float | None = None
    stall_overhead_pct: float | None = None
    bytes_per_iteration: float | None = None
    bytes_per_checkpoint: int | None = None
    tensor_bytes_per_checkpoint: int | None = None
    expected_bytes: float | None = None
    snapshot_gbps: float | None = None
    persist_gbps: float | None = None
    snapshot_pct_of_light: float | None = None
    persist_pct_of_light: float | None = None
    snapshot_light_gbps: float | None = None
    snapshot_light_ms: float | None = None
    snapshot_bytes_mean: float | None = None
    stall_breakdown_ms: dict[str, float] | None = None
    blocking_votes: int | None = None
    recover_seconds: float | None = None
    replay_seconds: float | None = None
    restore_memory_seconds: float | None = None
    restore_memory_bytes: int | None = None
    restore_memory_light_ratio: float | None = None
    read_gbps: float | None = None
    recover_storage_seconds: float | None = None
    replay_storage_seconds: float | None = None
    restore_storage_seconds: float | None = None
    restore_storage_bytes: int | None = None
    restore_storage_light_ratio: float | None = None
    notes: str = ""


@dataclass(frozen=True)
class Baseline:
    """What every method is measured against, from the same process."""

    iteration_s: float
    """Mean iteration time without checkpointing."""
    cpu_s: float
    """Mean CPU time of the process per iteration without checkpointing."""
    state_bytes: int
    """Weights and optimizer state."""
    bounds: Bounds
    """Speed of light of a snapshot (copy into a reused, preallocated buffer) and of a persist (sequential write +
    fsync to the checkpoint directory's storage): trials at the start and after each method's run, the best kept."""
