"""How much host memory replay mode's windows take: reported before training, and checked against the
shared-memory root there (issue 14, item 3), as PEC's snapshot slots are.

A window (:class:`~moc_lightning.replay.core.WindowRecord`) holds, per iteration, the full state of the units active
there and the compute weights of the units still frozen, in the dtype the forward reads them in (bf16 under FSDP2's
bf16 mixed precision, :mod:`moc_lightning.engine.compute_dtype`). It is captured straight into one of the rank's
:data:`~moc_lightning.replay.window_file.WINDOW_SLOTS` files in node-local shared memory (the newest complete window, and the
one being captured), allocated before the first capture and reused, so the slots are all the memory the windows take:
none in the process besides. Under FSDP2/HSDP a rank's window holds its pieces of the units (their local shards), and
so is counted here, under the schedule planned from whole units (the same on every rank). A resume maps the window it
replays (from a slot, or a storage object: page cache, not process memory) and drops it after its replay. Sizes come
before the optimizer's first step, so a unit without optimizer state yet is counted with the state the step will
create (:func:`~moc_lightning.pec.checkpointer.expected_state_bytes`: Adam's two moments, without its per-parameter
4-byte ``step``), within a few bytes per parameter of what the captures copy; a slot also holds a small tail
(batches, RNG states, trainer state) that is not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moc_lightning.engine.layout import Layout, UnitBytes
from moc_lightning.engine.units import Unit
from moc_lightning.pec.sizing import expected_state_bytes
from moc_lightning.replay.core import offset_bytes, window_schedule
from moc_lightning.replay.window_file import WINDOW_SLOTS


def window_sizes(layout: Layout, local: bool = False) -> dict[Unit, UnitBytes]:
    """Each unit's bytes with the optimizer state it has, or will have once stepped: whole (what the schedule is
    planned from, the same on every rank) or, ``local``, what this rank's captures copy of it: its pieces under
    FSDP2/HSDP, and under ZeRO-2 no optimizer state unless it is the unit's owner (the only rank that keeps it)."""
    sizes = {}
    for unit in layout.units:
        size = layout.unit_bytes(unit, local=local)
        if size.optimizer == 0 and (not local or all(map(layout.keeps_state, layout.param_names(unit)))):
            size = dataclasses.replace(size, optimizer=expected_state_bytes(layout, unit, local=local))
        sizes[unit] = size
    return sizes


def window_plan(layout: Layout, window: int) -> tuple[dict[Unit, int], dict[Unit, UnitBytes]]:
    """The schedule (each unit's active offset) a window of ``window`` iterations follows, and the sizes it is
    planned with: the same for the report before training, the choice of W and the captures."""
    sizes = window_sizes(layout)
    return window_schedule(list(sizes), window, sizes), sizes


@dataclass(frozen=True)
class WindowMemory:
    """Host memory of replay mode on one rank."""

    per_iteration: tuple[int, ...]
    """Bytes each offset of a window copies: the full state of its active units, the weights and buffers of its
    frozen ones."""
    window: int
    """W, iterations of a window."""
    slots: int = WINDOW_SLOTS
    """Window slots in shared memory."""

    @property
    def window_bytes(self) -> int:
        """One window's buffers: every offset's copy."""
        return sum(self.per_iteration)

    @property
    def in_shared_memory(self) -> int:
        """The slots in the node's shared memory (what the shared-memory root must hold for this rank): all the host
        memory of the windows."""
        return self.window_bytes * self.slots

    def describe(self) -> str:
        return (
            f"replay window W={self.window}: {max(self.per_iteration) / 1e6:.1f} MB per iteration at most "
            f"(mean {self.window_bytes / self.window / 1e6:.1f} MB), {self.window_bytes / 1e6:.1f} MB a window; "
            f"{self.slots} window slots in shared memory, {self.in_shared_memory / 1e6:.1f} MB in all"
        )


def window_memory(layout: Layout, window: int) -> WindowMemory:
    """What replay mode with ``window`` iterations keeps in host memory for ``layout``'s units: this rank's pieces
    of them (a DTensor's local shard) under the schedule :func:`window_plan` plans from whole units."""
    schedule, _ = window_plan(layout, window)
    return WindowMemory(tuple(offset_bytes(window_sizes(layout, local=True), schedule, window)), window)
