"""Replay mode's core: sparse captures over a window, and the sparse-to-dense replay that turns them back into
the exact fault-free state (MoEvement's conversion, over our units).

PEC gives up tokens: a recovery sends the experts it did not save back to older versions. Replay mode gives
up none. A **window** of W iterations activates every unit exactly once; each iteration copies the *full*
state of its active units and only the *compute weights* of the units not yet active in the window (the
frozen ones), so no iteration copies a full checkpoint, yet the window holds enough to recompute one.

Conventions (``t`` and ``i`` are offsets in the window, ``t_u`` the offset a unit is active at, see
:func:`window_schedule`):

- **Capture at t** runs after iteration t's optimizer step and before iteration t+1's forward (the snapshot
  point of every other mode). It copies the full state (weights, optimizer state including Adam's ``step``,
  persistent buffers) of the units with ``t_u == t``, and the weights and buffers of the units with
  ``t_u > t``: exactly what iteration t+1's forward reads, in the dtype it reads them in
  (:mod:`moc_lightning.engine.compute_dtype`: bf16 where FSDP2's mixed precision all-gathers the weights in bf16, their own
  dtype elsewhere). Buffers count as compute weights because a forward may read them (a router's load-balancing bias)
  and update them (norm statistics).
- **Replay at i**, for i = 1 .. W-1, recomputes iteration i. Units with ``t_u < i`` hold their true state
  after iteration i-1 (restored at ``t_u``, trained since) and train normally. Units with ``t_u >= i`` are
  frozen: they get the weights captured at i-1 (those iteration i read), run forward and backward so
  gradients reach the units that train, and are not stepped. Iteration 0 is never replayed: every unit is
  frozen there, and its captured state after iteration 0 is restored directly. A unit active at t_u is
  restored right after replay iteration t_u, so after the replay of W-1 every unit is at its state after
  iteration W-1, bitwise, as long as each replayed iteration repeats the fault-free one (same batch, same
  RNG state, same gradient clipping: the caller's business).
- **Not stepping a frozen unit**: its parameters' gradients are dropped (``None``) right before the
  optimizer step, so torch's optimizers skip them: no ``step`` counted, no weight decay, no moments touched.
  Exactness does not rest on this (a unit is restored whole right after ``t_u``, which overwrites whatever
  its frozen iterations did to it); it spares the step's work on the frozen units, half the state on
  average. It happens after anything the training loop does to all gradients, since clipping by global
  norm must see the frozen units' gradients as the fault-free iteration did. A stacked parameter ``[E, ...]``
  whose experts are only partly frozen cannot drop one slice's gradient; it is stepped whole, and its frozen
  slices are overwritten (by the next captured weights, then by their full state) before anything reads them.
- **Under ZeRO-2** (:mod:`moc_lightning.sharding.zero`) only a unit's *owner* keeps its optimizer state, so a rank's
  captures hold what it has (:meth:`Layout.tensors`): the full state on the owner, weights and buffers on the
  other holders, which is all a holder needs, since the owner steps the unit and broadcasts its weights. The
  owner's step broadcasts every weight it owns, frozen ones too: those are the weights of i-1 that every holder
  copied in before the forward, unchanged, and whatever a step leaves in a frozen unit is overwritten before a
  forward reads it, as above. What must hold is that the holders of a unit agree on ``t_u``: a holder training
  the unit while its owner still holds it frozen would receive the owner's unstepped weights. The schedule is a
  function of unit sizes, which :meth:`~moc_lightning.sharding.zero.ZeroAdamW.state_nbytes` gives every holder equally
  (the driver checks the ranks agree).
- **Under FSDP2 and HSDP** (:mod:`moc_lightning.engine.pieces`) every rank holds a piece (the local shard) of every unit's
  weights and of its optimizer state, so a rank's captures and restores are of its pieces (:meth:`Layout.pieces`,
  :meth:`Layout.model_pieces`, :meth:`Layout.copy_in`): the logged weights written into a frozen unit's shards before a
  forward are what FSDP2's all-gather hands every rank (logged in bf16 under its bf16 mixed precision, they go back into
  the fp32 shards as ``float(bf16(w))``, which the all-gather casts to the same ``bf16(w)``), and a trained unit's shard
  is stepped by its rank alone (HSDP's replicas alike, on the same gradient). A frozen unit's gradient, reduce-scattered
  by the backward as the fault-free iteration did, is dropped from its sharded parameter as under DDP. The schedule is
  planned from whole units' sizes (a DTensor's global size), so every holder of a unit follows the same ``t_u``.
- **A per-expert buffer of experts that every rank holds whole** (a stacked ``experts`` module's beside stacked DTensor
  experts, or a layer's buffer that ``checkpoint.expert_buffers`` names, under EP) gets a rank's own experts' entries
  from its restores and captures; the ranks share the entries after every restore and every copy of logged weights
  (:meth:`Layout.share_expert_entries`), so each rank's forward reads the whole buffer as the fault-free iteration
  did. A routing buffer (torchtitan's ``expert_bias``) is its router's, a dense unit every rank restores whole.
- Gradients are set to ``None`` before each replayed iteration and after the replay, as
  ``zero_grad(set_to_none=True)`` does: the fault-free training loop must do the same, or a parameter
  without gradient in some iteration (an expert that got no token) would be stepped on a zero gradient in
  one run and skipped in the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moc_lightning.engine.layout import Layout, UnitBytes
from moc_lightning.engine.slots import is_state_key
from moc_lightning.engine.units import ExpertUnit, Unit
from moc_lightning.replay.window_file import FULL, BufferKey


def window_schedule(
    units: Sequence[Unit], window: int, sizes: Mapping[Unit, UnitBytes] | None = None
) -> dict[Unit, int]:
    """The offset ``t_u`` in ``[0, window)`` at which each unit is active (captured with its full state).

    The experts of each MoE layer are spread evenly over the window (K = N/W of them an iteration, rounded
    down or up), as PEC's rotation takes K per layer. The dense units differ in size by orders of magnitude (an
    embedding against a norm), and what an offset copies depends on where every unit sits: a unit active at
    ``t_u`` costs its full state there and its weights at every earlier offset. So they are placed largest
    first where the largest copy of any offset (:func:`capture_bytes`) grows least: the copy of one iteration
    is what training may wait for. Among equal peaks, where the window copies least in all (a late offset
    costs weights logged at every earlier one), then on the offset holding least. Without ``sizes`` every
    unit counts one and nothing is logged, which spreads the dense units evenly by count.
    """
    if window < 1:
        raise ValueError(f"replay window must be >= 1 iteration, got {window}")

    def cost(unit: Unit) -> tuple[int, int]:
        """(full state, weights logged while frozen)."""
        if sizes is None:
            return 1, 0
        return sizes[unit].total, sizes[unit].logged

    schedule: dict[Unit, int] = {}
    experts: dict[int, list[ExpertUnit]] = {}
    for unit in sorted(units):
        if isinstance(unit, ExpertUnit):
            experts.setdefault(unit.layer, []).append(unit)
    for layer in experts.values():
        schedule.update({unit: j * window // len(layer) for j, unit in enumerate(layer)})
    load = [0] * window

    def placed(unit: Unit, t: int) -> list[int]:
        full, logged = cost(unit)
        return [x + (full if i == t else logged if i < t else 0) for i, x in enumerate(load)]

    for unit, t in schedule.items():
        load = placed(unit, t)
    for unit in sorted((u for u in units if not isinstance(u, ExpertUnit)), key=lambda u: (-cost(u)[0], u)):
        schedule[unit] = min(range(window), key=lambda t: (max(placed(unit, t)), sum(placed(unit, t)), load[t], t))
        load = placed(unit, schedule[unit])
    return schedule


def capture_bytes(layout: Layout, schedule: Mapping[Unit, int], window: int) -> list[int]:
    """Bytes each offset of the window copies: the full state of its active units, the weights (in their compute
    dtype, :attr:`UnitBytes.logged`) and buffers of its frozen ones (read from the live tensors, so optimizer state
    counts once it exists)."""
    return offset_bytes({unit: layout.unit_bytes(unit) for unit in schedule}, schedule, window)


def offset_bytes(sizes: Mapping[Unit, UnitBytes], schedule: Mapping[Unit, int], window: int) -> list[int]:
    """:func:`capture_bytes` from given unit sizes (pure: the window's choice weighs windows not captured yet)."""
    return [
        sum(s.total if schedule[u] == t else s.logged for u, s in sizes.items() if schedule[u] >= t)
        for t in range(window)
    ]


class Buffers(Protocol):
    """Where a window's captures are copied: a buffer per :data:`~moc_lightning.replay.window_file.BufferKey`, reused from
    window to window."""

    def buffer(self, key: BufferKey, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The buffer of ``key``, shaped as ``like`` and of ``dtype`` (``like``'s by default; a frozen unit's weights
        are logged in their compute dtype), made anew when the shape or dtype changed."""
        ...


@dataclass
class ProcessBuffers:
    """Buffers in this process's memory (a window replayed where it was captured). Under Lightning a window is
    captured into a :class:`~moc_lightning.replay.window_file.WindowSlot` in shared memory instead."""

    device: torch.device | str = "cpu"
    _buffers: dict[BufferKey, torch.Tensor] = field(default_factory=dict, repr=False)

    def buffer(self, key: BufferKey, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = like.dtype if dtype is None else dtype
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != dtype:
            buffer = self._buffers[key] = torch.empty(like.shape, dtype=dtype, device=self.device)
        return buffer


@dataclass
class WindowRecord:
    """What one window captured: each unit's full state at its ``t_u``, and the compute weights of the frozen
    units at each offset. The copies go into ``buffers``, allocated at the first window and reused in the next ones
    (a fresh allocation is several times slower than a copy)."""

    schedule: Mapping[Unit, int]
    """``t_u`` of every unit (:func:`window_schedule`)."""
    window: int | None = None
    """W; defaults to the last offset of ``schedule`` plus one."""
    buffers: Buffers = field(default_factory=ProcessBuffers)
    """Where the copies live: host memory, as snapshots do."""
    full: dict[Unit, dict[str, torch.Tensor]] = field(default_factory=dict, init=False)
    """Full state (:meth:`Layout.tensors` keys; this rank's pieces of it) of each unit captured so far in this
    window."""
    logged: list[dict[str, torch.Tensor]] = field(default_factory=list, init=False)
    """Per offset, the weights and buffers (:meth:`Layout.model_tensors` keys; this rank's pieces of them) of the
    units frozen there, each in the dtype a forward reads it in (:meth:`Layout.compute_dtype`: bf16 for a weight
    FSDP2's mixed precision all-gathers in bf16, half the bytes of its fp32 shard, and exact, see
    :mod:`moc_lightning.engine.compute_dtype`)."""

    def __post_init__(self) -> None:
        if not self.schedule:
            raise ValueError("a replay window needs a schedule with at least one unit")
        last = max(self.schedule.values())
        self.window = last + 1 if self.window is None else self.window
        if min(self.schedule.values()) < 0 or last >= self.window:
            raise ValueError(f"schedule offsets must lie in [0, window={self.window}); got up to {last}")

    @property
    def span(self) -> int:
        """W, the iterations of the window: :attr:`window`, typed for its readers now that ``__post_init__`` has
        filled it in."""
        assert self.window is not None  # __post_init__ sets it
        return self.window

    @property
    def captured(self) -> int:
        """Offsets captured so far in this window."""
        return len(self.logged)

    @property
    def complete(self) -> bool:
        return self.captured == self.window

    def capture(self, layout: Layout, t: int) -> int:
        """Capture offset ``t`` from ``layout``'s live tensors (see the module docstring for when); returns the
        bytes copied. Offset 0 starts a new window, dropping the previous one's contents (not its buffers)."""
        copies = self.plan(layout, t)
        copy_all([(target, source) for _, target, source in copies])
        return sum(target.numel() * target.element_size() for _, target, _ in copies)

    def plan(self, layout: Layout, t: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """What capturing offset ``t`` copies, ``(key, buffer, live tensor)``, with the buffers in place in
        :attr:`full` and :attr:`logged`: :meth:`capture` copies them now; a caller may copy them later, as long as
        nothing changes the live tensors before (:class:`~moc_lightning.replay.driver.WindowCapture`)."""
        if t == 0:
            self.full.clear()
            self.logged.clear()
        if t != self.captured:
            raise ValueError(f"replay captures go 0, 1, ..., {self.span - 1} in order; got offset {t} after "
                             f"{self.captured} captured")
        copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for unit in (u for u, tu in self.schedule.items() if tu == t):
            state = layout.pieces([unit])  # read live: a unit's optimizer state appears at its first token
            self.full[unit] = {key: self.buffers.buffer((FULL, key), tensor) for key, tensor in state.items()}
            copies += [(key, self.full[unit][key], tensor) for key, tensor in state.items()]
        frozen = layout.model_pieces([u for u, tu in self.schedule.items() if tu > t])
        self.logged.append(
            {key: self.buffers.buffer((t, key), like, layout.compute_dtype(key, like)) for key, like in frozen.items()}
        )
        copies += [(key, self.logged[t][key], tensor) for key, tensor in frozen.items()]
        return copies


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its target: one call for all rather than a dispatch per tensor (an offset may have none)."""
    if pairs:
        targets, sources = zip(*pairs)
        torch._foreach_copy_(list(targets), list(sources))


def restore_units(layout: Layout, states: Mapping[Unit, Mapping[str, torch.Tensor]]) -> None:
    """Put the live weights, optimizer state and buffers of each unit of ``states`` at its state (one of
    :attr:`WindowRecord.full`): one pass over the live tensors and one copy call for the optimizer state it creates
    and one for the rest, since a restore puts hundreds of units in place.

    A unit's optimizer state is recreated when the live one has other entries (a fresh optimizer has none;
    an expert that had no token when captured must have none), from the captured tensors
    (:meth:`Layout.restore_optimizer_state`: allocated and copied once), and only then: recreating a stacked
    parameter's state zeroes its other experts' slices, which may already be restored.
    """
    live = layout.state_keys(states)
    stale = [unit for unit, state in states.items() if {key for key in state if is_state_key(key)} != live[unit]]
    created = {key: tensor for unit in stale for key, tensor in states[unit].items() if is_state_key(key)}
    if stale:
        layout.restore_optimizer_state(stale, created)
    layout.copy_in({key: tensor for state in states.values() for key, tensor in state.items() if key not in created})


class Replay:
    """The replay of one complete window into ``layout``, as steps a training loop calls around its own:
    :meth:`before_forward`, the loop's forward and backward, :meth:`before_optimizer_step`, the optimizer
    step; after the last iteration, :meth:`finish`. :func:`replay` is that loop for a plain ``step_fn``."""

    def __init__(self, record: WindowRecord, layout: Layout) -> None:
        if not record.complete:
            raise ValueError(f"only a complete window can be replayed: {record.captured} of {record.window} "
                             "iterations captured")
        if layout.optimizer is None:
            raise ValueError("replay steps the optimizer: build the layout with it")
        self.optimizer: torch.optim.Optimizer = layout.optimizer
        """The layout's optimizer (a frozen layout's, so always this one), which the replay steps."""
        if set(record.schedule) != set(layout.units):
            differ = sorted(set(record.schedule) ^ set(layout.units))
            raise ValueError(f"the window's units differ from the layout's: {[u.key for u in differ[:5]]}")
        self.record = record
        self.layout = layout
        self.restore_seconds = 0.0
        """Time spent so far copying the window's tensors into the live ones (units' full states, and the logged
        weights the frozen units compute with): a recovery's restore, every byte of the window's tensors copied once,
        apart from the replay's computation (issue 14 item 7 bounds the restore by a copy's speed of light)."""
        self._owners: dict[str, list[Unit]] = {}
        for unit, slots in layout.slots.items():
            for slot in slots:
                if not slot.buffer:
                    self._owners.setdefault(slot.param, []).append(unit)

    @property
    def iterations(self) -> range:
        """Offsets to recompute: iteration 0 has nothing to train (see the module docstring)."""
        return range(1, self.record.span)

    def before_forward(self, i: int) -> None:
        """Restore the units active at i-1, give the frozen ones the weights iteration i read, clear gradients."""
        self._restore(self._active(i - 1))
        start = time.perf_counter()
        self.layout.copy_in(self.record.logged[i - 1])
        self.layout.share_expert_entries()
        self.restore_seconds += time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)

    def before_optimizer_step(self, i: int) -> None:
        """Drop the gradients of parameters whose units are all frozen at i, so the optimizer skips them."""
        for name, owners in self._owners.items():
            if all(self.record.schedule[u] >= i for u in owners):
                self.layout.params[name].grad = None

    def finish(self) -> None:
        """Restore the units active at the window's last iteration: every unit is now at its state after it."""
        self._restore(self._active(self.record.span - 1))
        self.layout.share_expert_entries()
        self.optimizer.zero_grad(set_to_none=True)

    def _active(self, t: int) -> list[Unit]:
        return [u for u, tu in self.record.schedule.items() if tu == t]

    def _restore(self, units: Iterable[Unit]) -> None:
        start = time.perf_counter()
        restore_units(self.layout, {unit: self.record.full[unit] for unit in units})
        self.restore_seconds += time.perf_counter() - start


def replay(record: WindowRecord, layout: Layout, step_fn: Callable[[int], None]) -> int:
    """Recompute a complete window so that ``layout``'s model and optimizer, whatever their state, end at the
    fault-free state after the window's last iteration. ``step_fn(i)`` runs the forward and backward of
    offset ``i`` on its recorded batch and RNG state (and whatever the loop does to gradients before the
    step). Returns the number of iterations replayed."""
    run = Replay(record, layout)
    for i in run.iterations:
        run.before_forward(i)
        step_fn(i)
        run.before_optimizer_step(i)
        run.optimizer.step()
    run.finish()
    return len(run.iterations)
