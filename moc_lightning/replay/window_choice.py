"""``checkpoint.replay.window=auto``: the replay window W from the measured copy bandwidth and iteration time.

Every iteration replay mode copies the full state of the units active there and the weights of the units still frozen,
under the schedule planned from whole units (:func:`~moc_lightning.replay.memory.window_plan`: the same on every rank);
under FSDP2/HSDP a rank copies its pieces of them (its local shards), and under ZeRO-2 the optimizer state of the units
it owns only, so the copy weighed is of those, as the memory report sizes it
(:func:`~moc_lightning.replay.memory.window_memory`). A larger W spreads the full states thinner, so the largest copy of
an iteration falls, but a resume replays up to W-1 iterations, and the weights logged at the window's first offset are a
floor no W goes below. So W is the smallest window whose largest per-iteration copy takes at most ``COPY_BUDGET`` of an
iteration at the measured copy bandwidth; when no W from 1 to the number of units fits, the one that copies least (the
smallest such W), and the choice says that the budget is not met.

The inputs are measured in the fit's first iterations (:class:`WindowProbe`): an iteration's time from batch
start to batch end (forward, backward, optimizer step), the median of ``MEASURED_ITERATIONS`` after
``WARMUP_ITERATIONS``; and the copy bandwidth into a reused buffer (:func:`~moc_lightning.memory.copy_speed.copy_gbps`,
the snapshot's speed of light) over this rank's pieces of the live state of the units, at most ``MEASURE_BYTES`` of
it. No window is captured before W is chosen: a fault in those first iterations finds nothing newer to replay.

Every rank takes the coordinator's choice (the callback's :func:`~moc_lightning.runtime.agreement.from_coordinator`), made from
the coordinator's own pieces: a window must end at the same step on every rank. Under FSDP2/HSDP that is the largest
copy of any rank: a unit's tensors are sharded along dim 0 in :func:`torch.chunk`'s pieces, the first never smaller than
another. Under ZeRO-2 a rank copies the optimizer state of the units it owns only (the others' owners copy theirs), so
the coordinator weighs its own share, which the partition balances by size over the ranks, though not offset by offset:
another rank's largest copy may exceed it by part of a unit's state.

Weights logged in their compute dtype (bf16 under FSDP2's bf16 mixed precision, :mod:`moc_lightning.engine.compute_dtype`)
count at the bytes they take, the cast copy's output; the cast reads twice that, and on the 2-core test machine a cast
of 128 MB of fp32 into bf16 took 0.75-1.1x the time of its fp32 copy (noisy), so the copy time of those weights may be
up to 2x what their bytes at the measured bandwidth say.

The budget weighs the copy only. The seal of each completed window in shared memory and its storage write run off the
training thread (:mod:`moc_lightning.replay.window_store`); what the training thread waits for them at a hand-over (the
previous window's writes, when slower than a window) is not in it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moc_lightning.engine.layout import Layout, UnitBytes
from moc_lightning.engine.units import Unit
from moc_lightning.memory.copy_speed import GB, copy_gbps
from moc_lightning.replay.core import offset_bytes, window_schedule
from moc_lightning.replay.memory import window_sizes

COPY_BUDGET = 0.05
"""Fraction of an iteration one iteration's copy may take. The capture copies its weights and optimizer state on a
copy thread behind the next forward and backward (:class:`~moc_lightning.replay.driver.WindowCapture`), but on a host
with few cores that thread takes a core from training for as long as it copies, so every byte still costs iteration
time; issue 14 allows replay mode 5% iteration overhead over training without checkpoints."""
WARMUP_ITERATIONS = 1
"""Iterations not timed: the first one allocates the optimizer state and warms caches."""
MEASURED_ITERATIONS = 3
"""Iterations timed after the warm-up; their median is the iteration time."""
MEASURE_BYTES = 256 << 20
"""Bytes of live state the bandwidth is measured on (largest tensors first): enough for a steady copy rate, without
a second full state in host memory for a large model."""


def peak_copy_bytes(
    sizes: Mapping[Unit, UnitBytes], window: int, local: Mapping[Unit, UnitBytes] | None = None
) -> int:
    """The largest copy of one iteration of a window of ``window`` iterations, scheduled from whole units of
    ``sizes``, of this rank's pieces of them sized ``local`` (``sizes`` when the units are not sharded)."""
    schedule = window_schedule(list(sizes), window, sizes)
    return max(offset_bytes(sizes if local is None else local, schedule, window))


@dataclass(frozen=True)
class WindowChoice:
    """W and what it was chosen from."""

    window: int
    """W, from 1 to the number of units."""
    copy_bytes: int
    """The largest copy of one iteration at W (bytes)."""
    copy_bandwidth: float
    """Measured copy bandwidth into a reused buffer (bytes per second)."""
    iteration_seconds: float
    """Measured time of one iteration."""
    budget: float
    """Fraction of an iteration the copy may take."""
    fits: bool
    """Whether the copy at W takes at most ``budget`` of an iteration."""

    @property
    def copy_seconds(self) -> float:
        return self.copy_bytes / self.copy_bandwidth

    def describe(self) -> str:
        """One line: W and its inputs."""
        verdict = "fits" if self.fits else "does not fit (no window does; W copies least)"
        return (
            f"checkpoint.replay.window=auto chose W={self.window}: largest copy of an iteration "
            f"{self.copy_bytes / 1e6:.3f} MB at {self.copy_bandwidth / GB:.2f} GB/s = {self.copy_seconds * 1e3:.3f} ms, "
            f"which {verdict} the budget of {self.budget:.0%} of a measured iteration of "
            f"{self.iteration_seconds * 1e3:.2f} ms"
        )

    def metrics(self) -> dict[str, float]:
        """What a logger records, once."""
        return {
            "moc/replay_window": float(self.window),
            "moc/replay_copy_gbps": self.copy_bandwidth / GB,
            "moc/replay_copy_ms": self.copy_seconds * 1e3,
            "moc/iteration_ms": self.iteration_seconds * 1e3,
        }


def choose_window(
    sizes: Mapping[Unit, UnitBytes],
    copy_bandwidth: float,
    iteration_seconds: float,
    budget: float = COPY_BUDGET,
    local: Mapping[Unit, UnitBytes] | None = None,
) -> WindowChoice:
    """The smallest W in 1 .. len(sizes) whose largest per-iteration copy takes at most ``budget`` of an iteration
    at ``copy_bandwidth`` (bytes per second); when none does, the smallest W of least copy (module docstring).
    The schedule of each W is planned from the whole units' ``sizes``; the copy is of this rank's pieces of them,
    ``local`` (the same units; ``sizes`` when not sharded).

    Scans W upwards and stops at the first that fits, one schedule per W: cheap for the tens of units of the
    reference models; a model of thousands of units that fits no W pays a scan of them all.
    """
    if not sizes:
        raise ValueError("choosing a replay window needs at least one unit")
    if copy_bandwidth <= 0:
        raise ValueError(f"copy bandwidth must be > 0 bytes per second, got {copy_bandwidth}")
    if iteration_seconds <= 0:
        raise ValueError(f"iteration time must be > 0 seconds, got {iteration_seconds}")
    if not 0 < budget <= 1:
        raise ValueError(f"copy budget must be in (0, 1] of an iteration, got {budget}")
    if local is not None and set(local) != set(sizes):
        raise ValueError("the local sizes of a replay window's choice must be of the same units as the whole sizes")

    def choice(window: int, peak: int) -> WindowChoice:
        fits = peak / copy_bandwidth <= budget * iteration_seconds
        return WindowChoice(window, peak, copy_bandwidth, iteration_seconds, budget, fits)

    least: WindowChoice | None = None
    for window in range(1, len(sizes) + 1):
        candidate = choice(window, peak_copy_bytes(sizes, window, local))
        if candidate.fits:
            return candidate
        if least is None or candidate.copy_bytes < least.copy_bytes:
            least = candidate
    assert least is not None, "range(1, len(sizes) + 1) is not empty: a layout has a unit"
    return least


class WindowProbe:
    """Times the fit's first iterations (:meth:`begin`/:meth:`end` around each), then measures the copy bandwidth
    and chooses W (:meth:`choose`)."""

    def __init__(self) -> None:
        self._seconds: list[float] = []
        self._started: float | None = None

    def begin(self) -> None:
        self._started = time.perf_counter()

    def end(self) -> bool:
        """Close the iteration's timing; whether enough iterations are timed to choose."""
        if self._started is not None:
            self._seconds.append(time.perf_counter() - self._started)
            self._started = None
        return len(self._seconds) >= WARMUP_ITERATIONS + MEASURED_ITERATIONS

    def choose(self, layout: Layout) -> WindowChoice:
        """W for ``layout``'s units, sized as the memory report and the captures size them
        (:func:`~moc_lightning.replay.memory.window_sizes`): scheduled from whole units, copying this rank's
        pieces of them."""
        return choose_window(
            window_sizes(layout), self._bandwidth(layout), statistics.median(self._seconds[WARMUP_ITERATIONS:]),
            local=window_sizes(layout, local=True),
        )

    @staticmethod
    def _bandwidth(layout: Layout) -> float:
        """Copy bandwidth over this rank's pieces (a DTensor's local shard, as its captures copy), largest first."""
        tensors: list[torch.Tensor] = []
        total = 0
        for tensor in sorted(layout.pieces(layout.units).values(), key=lambda t: -t.numel() * t.element_size()):
            if tensors and total >= MEASURE_BYTES:
                break
            tensors.append(tensor)
            total += tensor.numel() * tensor.element_size()
        return copy_gbps(tensors) * GB
