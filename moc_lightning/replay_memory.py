"""How much host memory replay mode's windows take: reported before training, and checked against the
shared-memory root there (issue 14, item 3), as PEC's snapshot slots are.

A window (:class:`~moc_lightning.replay.WindowRecord`) holds, per iteration, the full state of the units active
there and the compute weights of the units still frozen; its buffers are allocated at the first window and
reused. The driver keeps :data:`WINDOWS_KEPT` windows so that the newest complete one stays intact while the next
is captured. Writing a complete window to storage serializes it into one more window-sized buffer for the length
of the write; that transient copy is not counted. Sizes come before the optimizer's first step, so a unit without
optimizer state yet is counted with the state the step will create
(:func:`~moc_lightning.checkpointer.expected_state_bytes`: Adam's two moments, without its per-parameter 4-byte
``step``), within a few bytes per parameter of what the captures copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moc_lightning.checkpointer import expected_state_bytes
from moc_lightning.layout import Layout, UnitBytes
from moc_lightning.replay import offset_bytes, window_schedule
from moc_lightning.units import Unit

WINDOWS_KEPT = 2
"""Windows in memory at once: the newest complete one, and the one being captured."""


def window_sizes(layout: Layout) -> dict[Unit, UnitBytes]:
    """Each unit's bytes with the optimizer state it has, or will have once stepped."""
    sizes = {}
    for unit in layout.units:
        size = layout.unit_bytes(unit)
        if size.optimizer == 0:
            size = dataclasses.replace(size, optimizer=expected_state_bytes(layout, unit))
        sizes[unit] = size
    return sizes


def window_plan(layout: Layout, window: int) -> tuple[dict[Unit, int], dict[Unit, UnitBytes]]:
    """The schedule (each unit's active offset) a window of ``window`` iterations follows, and the sizes it is
    planned with: the same for the report before training and for the captures."""
    sizes = window_sizes(layout)
    return window_schedule(layout.units, window, sizes), sizes


@dataclass(frozen=True)
class WindowMemory:
    """Host memory of replay mode on one rank."""

    per_iteration: tuple[int, ...]
    """Bytes each offset of a window copies: the full state of its active units, the weights and buffers of its
    frozen ones."""
    window: int
    """W, iterations of a window."""
    windows_kept: int = WINDOWS_KEPT
    """Windows held in memory at once."""

    @property
    def window_bytes(self) -> int:
        """One window's buffers: every offset's copy."""
        return sum(self.per_iteration)

    @property
    def total(self) -> int:
        """All windows kept."""
        return self.window_bytes * self.windows_kept

    def describe(self) -> str:
        return (
            f"replay window W={self.window}: {max(self.per_iteration) / 1e6:.1f} MB per iteration at most "
            f"(mean {self.window_bytes / self.window / 1e6:.1f} MB), {self.window_bytes / 1e6:.1f} MB a window, "
            f"{self.total / 1e6:.1f} MB for the {self.windows_kept} windows kept in memory"
        )


def window_memory(layout: Layout, window: int) -> WindowMemory:
    """What replay mode with ``window`` iterations keeps in host memory for ``layout``'s units."""
    schedule, sizes = window_plan(layout, window)
    return WindowMemory(tuple(offset_bytes(sizes, schedule, window)), window)
