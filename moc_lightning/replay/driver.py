"""Replay mode inside Lightning (``checkpoint.mode=replay``): capture a window every iteration of a fit, keep
the newest complete ones in shared memory and in storage, and on resume replay one through the module's own
``training_step``.

What a window holds besides :class:`~moc_lightning.replay.core.WindowRecord`'s tensors, so that a new process can
repeat its iterations exactly: each iteration's batch (the tensors Lightning handed to ``training_step``, kept
as they are: a token batch is tiny beside the weights, and it spares seeking the loader back) and this rank's
RNG streams as the iteration began; the LR schedulers' state and the optimizer's hyperparameters after the
window's first iteration (those its second one used); and the trainer state after its last iteration
(:mod:`moc_lightning.engine.trainer_state`: loops, the train loader's position, RNG), which Lightning resumes from.

Windows are captured straight into two slot files in node-local shared memory, alternately
(:mod:`moc_lightning.replay.window_file`), so the newest complete one stays intact while the next is captured, and the
weights and optimizer state of an iteration are copied while the next forward and backward run
(:class:`WindowCapture`). When a window completes, each rank hands its own (its units, batches and RNG streams; under
DDP every rank keeps the replicated units too, the simplest correct choice; under ZeRO-2 what it holds of them, and
under FSDP2/HSDP its pieces of them, :mod:`moc_lightning.replay.core` says why that suffices) to
:class:`~moc_lightning.replay.window_store.WindowStore`, which seals it in shared memory and writes every
``persist_every_n_windows``-th to storage off the training thread; on resume the ranks agree on the newest window
every one of them has (:mod:`moc_lightning.replay.window_store` says how, and why three storage objects per rank).

A replayed iteration repeats what Lightning's automatic optimization did in it (the module's ``training_step``
called through the strategy, ``on_before_backward``, ``backward``, ``on_after_backward``,
``on_before_optimizer_step``, then ``configure_gradient_clipping`` as configured on the Trainer, the optimizer step
and the step-interval LR schedulers) with the :class:`~moc_lightning.replay.core.Replay` hooks around it; callbacks'
hooks are not called (the iterations ran in the faulty run already), nor is ``self.log`` recorded. Through the
strategy, because under DDP only the wrapped model's forward arms the gradient all-reduce of the backward: the
module's own ``training_step`` would leave each rank with its local gradients, and the ranks would diverge (under
``ModelParallelStrategy`` the strategy calls the module itself: FSDP2's all-gathers and reduce-scatters hang on its
submodules). Every rank replays the same iterations, so the collectives of a step (DDP's all-reduce, FSDP2's
all-gather and reduce-scatter, expert parallelism's all-to-all and gradient reduction, a global-norm clipping) pair
up as they did. With 2 ranks an all-reduce sums in one order only; with more, each element's order follows its place
in DDP's buckets, which a new process builds afresh: the replay first brings them to those the fault-free iterations
used (:func:`_rebuild_ddp_buckets`).

This slice supports every ``trainer.data_parallel`` mode, ``ddp``, ``zero2``, ``fsdp2`` and ``hsdp`` (one process or
several, with or without expert parallelism) at the precisions of :data:`PRECISIONS` under the strategies of
:data:`STRATEGIES` (:func:`check_strategy`). The ranks' schedules must agree on the dense units (:func:`check_same`,
once per run): under ZeRO-2 a unit's holders train it from the same offset on, or a holder training it would receive
its owner's frozen weights. The schedule is planned from whole units' sizes (a DTensor's global size), so it is the
same on every holder of a unit in every mode.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from moc_lightning.engine import trainer_state
from moc_lightning.engine.layout import Layout
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.slots import is_buffer_key
from moc_lightning.engine.units import DenseUnit, parse_unit
from moc_lightning.replay.core import Buffers, Replay, WindowRecord, copy_all
from moc_lightning.replay.memory import window_plan
from moc_lightning.replay.window_file import FULL, WINDOW_SLOTS, Region, read_buffer, read_file
from moc_lightning.runtime.agreement import check_same
from moc_lightning.runtime.background import background_executor
from moc_lightning.runtime.faults import fault_point
from moc_lightning.sharding.zero import ZeroAdamW

PRECISIONS: dict[str, tuple[str, ...]] = {
    "ddp": ("32-true", "bf16-mixed"),
    "zero2": ("32-true", "bf16-mixed", "bf16-true"),
    "fsdp2": ("32-true", "bf16-mixed"),
    "hsdp": ("32-true", "bf16-mixed"),
}
"""``trainer.data_parallel`` modes a replay repeats bitwise, each with the Lightning precisions it was checked at: fp32
weights (the logged compute weights are the fp32 weights), ``bf16-mixed`` (the autocast that the strategy's
``training_step`` enters as Lightning's loop does; under ``fsdp2``/``hsdp`` also the ``MixedPrecisionPolicy`` that
all-gathers the fp32 shards in bf16, whose frozen units are logged in that bf16, :mod:`moc_lightning.engine.compute_dtype`)
and, under ``zero2``, ``bf16-true`` (bf16 weights logged as the forward reads them, the fp32 masters in the owner's
optimizer state). Under ``hsdp`` a piece's replicas capture and replay it alike, as under ``fsdp2``."""

STRATEGIES: dict[str, tuple[type[Strategy], ...]] = {
    "ddp": (DDPStrategy, SingleDeviceStrategy),
    "zero2": (DDPStrategy, SingleDeviceStrategy),
    "fsdp2": (ModelParallelStrategy,),
    "hsdp": (ModelParallelStrategy,),
}
"""The Lightning strategies each mode of :data:`PRECISIONS` is replayed under: the ones that build it
(:func:`moc_lightning.jobs.training.build_trainer`)."""

SUPPORTED = (
    "checkpoint.mode=replay supports, so far, trainer.data_parallel=ddp at precision 32-true or bf16-mixed, "
    "trainer.data_parallel=zero2 at precision 32-true, bf16-mixed or bf16-true (Lightning's DDPStrategy, or one "
    "device) and trainer.data_parallel=fsdp2 or hsdp at precision 32-true or bf16-mixed (Lightning's "
    "ModelParallelStrategy); automatic optimization with one torch.optim optimizer (or zero2's ZeroAdamW), "
    "accumulate_grad_batches=1, LR schedulers stepped every step, and a module that keeps Lightning's optimizer_step, "
    "optimizer_zero_grad and backward; use checkpoint.mode=pec otherwise"
)


def check_supported(precision: str, data_parallel: str = "ddp") -> None:
    """Refuse what this slice of replay mode does not support yet, before training (the recipe and the callback)."""
    if data_parallel not in PRECISIONS:
        raise ValueError(f"checkpoint.mode=replay with trainer.data_parallel={data_parallel}: {SUPPORTED}")
    if str(precision) not in PRECISIONS[data_parallel]:
        raise ValueError(
            f"checkpoint.mode=replay with trainer.precision={precision!r} and trainer.data_parallel={data_parallel}: "
            f"{SUPPORTED}"
        )


def check_strategy(trainer: L.Trainer, module: L.LightningModule) -> None:
    """:func:`check_supported` for a Trainer: its precision, the module's ``data_parallel`` (when it has one; a user's
    module under ``ModelParallelStrategy`` is taken as ``fsdp2``, under any other strategy as ``ddp``) and the
    strategy, one of the mode's :data:`STRATEGIES`: those wrap the model as DDP does, shard it in place (FSDP2's
    hooks live on the module's own submodules) or leave it alone, so :func:`replay_window` drives its step through
    them as Lightning's loop does."""
    default = "fsdp2" if isinstance(trainer.strategy, ModelParallelStrategy) else "ddp"
    data_parallel = getattr(module, "data_parallel", default)
    check_supported(trainer.precision, data_parallel)
    strategy = trainer.strategy
    if type(strategy) not in STRATEGIES[data_parallel]:
        raise ValueError(
            f"checkpoint.mode=replay with trainer.data_parallel={data_parallel} under {type(strategy).__name__}: "
            f"{SUPPORTED}"
        )


def check_trainer(trainer: L.Trainer, module: L.LightningModule) -> None:
    """What a replayed iteration must repeat exactly: Lightning's own optimization loop, one optimizer, schedulers
    stepped once per step (:func:`check_strategy` ran at ``setup``)."""
    problems = []
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
    if not module.automatic_optimization:
        problems.append("manual optimization")
    for hook in ("optimizer_step", "optimizer_zero_grad", "backward"):
        if getattr(type(module), hook) is not getattr(L.LightningModule, hook):
            problems.append(f"{type(module).__name__}.{hook} overridden")
    if len(trainer.optimizers) != 1:
        problems.append(f"{len(trainer.optimizers)} optimizers")
    elif type(trainer.optimizers[0]) is not ZeroAdamW and not type(trainer.optimizers[0]).__module__.startswith(
        "torch.optim"
    ):
        problems.append(f"optimizer {type(trainer.optimizers[0]).__name__} (not a torch.optim one)")
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
            problems.append(f"LR scheduler {type(config.scheduler).__name__} (interval={config.interval}, "
                            f"frequency={config.frequency})")
    if problems:
        raise ValueError(f"checkpoint.mode=replay cannot replay this fit ({'; '.join(problems)}): {SUPPORTED}")


@dataclass
class Iteration:
    """What an iteration began with: the batch ``training_step`` got, its index, this rank's RNG streams."""

    batch: Any
    batch_idx: int
    rng: dict[str, Any]


@dataclass
class WindowLog:
    """A window's captures (:class:`WindowRecord`) and what replaying them through Lightning needs."""

    record: WindowRecord
    start_step: int = 0
    """The global step before the window's first iteration."""
    iterations: list[Iteration] = field(default_factory=list)
    """Per offset, what the iteration began with."""
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    """LR schedulers' ``state_dict`` after the window's first iteration."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's hyperparameters (``lr``, ...) after the window's first iteration."""
    trainer_state: dict[str, Any] | None = None
    """The trainer state after the window's last iteration, which Lightning resumes from."""

    @property
    def end_step(self) -> int:
        return self.start_step + self.record.span

    def tail(self, lineage: Lineage | None) -> dict[str, Any]:
        """Everything of the window but its tensors' bytes (:mod:`moc_lightning.replay.window_file`): each tensor is named by
        its capture buffer, which :meth:`WindowSlot.seal` turns into its place in the file."""
        record = self.record
        return {
            "lineage": lineage.stamp() if lineage is not None else None,
            "window": record.window,
            "schedule": {unit.key: t for unit, t in record.schedule.items()},
            "full": {unit.key: {key: Region((FULL, key)) for key in state} for unit, state in record.full.items()},
            "logged": [{key: Region((t, key)) for key in logged} for t, logged in enumerate(record.logged)],
            **{name: getattr(self, name) for name in ("start_step", "schedulers", "param_groups", "trainer_state")},
            "iterations": [asdict(it) for it in self.iterations],
        }

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple[WindowLog, dict[str, Any] | None]:
        """The window held in ``data`` (a window file's bytes) and the lineage stamp it was written under."""
        return cls._from_payload(read_buffer(data))

    @classmethod
    def from_file(cls, path: Path) -> tuple[WindowLog, dict[str, Any] | None]:
        """:meth:`from_bytes` of a window file, mapped: the tensors are views of its pages, so nothing is read until
        the tensors are."""
        return cls._from_payload(read_file(path))

    @classmethod
    def _from_payload(cls, payload: dict[str, Any]) -> tuple[WindowLog, dict[str, Any] | None]:
        record = WindowRecord({parse_unit(k): t for k, t in payload["schedule"].items()}, payload["window"])
        record.full = {parse_unit(k): state for k, state in payload["full"].items()}
        record.logged = payload["logged"]
        log = cls(
            record, payload["start_step"], [Iteration(**it) for it in payload["iterations"]],
            payload["schedulers"], payload["param_groups"], payload["trainer_state"],
        )
        return log, payload["lineage"]


class WindowCapture:
    """Captures every iteration into the windows ``open_slot`` gives (window ``k`` into slot ``k`` mod
    :data:`~moc_lightning.replay.window_file.WINDOW_SLOTS`) and returns each completed one for its hand-over.

    With ``behind``, an iteration's capture copies the persistent buffers at once, on the training thread (a forward
    may update them), and the weights and optimizer state on a copy thread while the next iteration's forward and
    backward run: nothing changes those before the next optimizer step, and :meth:`join`, called before it, waits for
    the copy (that wait is the capture's stall beyond its hook). So does anything that reads the window: the seal of
    a completed one waits for its last copy (:attr:`pending`). As a CUDA snapshot's side-stream copy overlaps the
    next forward, this one overlaps it on the host; the copy thread keeps to one intra-op thread. It pays only where
    a core is free for it (:func:`~moc_lightning.runtime.background.spare_core`); without ``behind`` the whole capture is
    copied on the training thread.
    """

    def __init__(self, window: int, open_slot: Callable[[int], Buffers], behind: bool) -> None:
        """``open_slot(k)``: the buffers window number ``k`` is captured into, given up by the window they held;
        ``behind``: copy weights and optimizer state on a copy thread, behind the next forward and backward."""
        self.window = window
        self.open_slot = open_slot
        self.behind = behind
        self.logs: dict[int, WindowLog] = {}
        """Per slot, the window captured into it last."""
        self._begun: tuple[int, Iteration] | None = None
        self._copier = background_executor("moc-capture")
        self.pending: Future[float] | None = None
        """The copy in flight (its result: the seconds it took), until :meth:`join`."""
        self.copied_bytes: list[int] = []
        """Bytes each captured iteration copied, in order."""
        self.copy_seconds: list[float] = []
        """Seconds each captured iteration's copy took (on the training thread and the copy thread), in order."""
        self.wait_seconds: list[float] = []
        """Per :meth:`join` that found a copy, how long the training thread waited for it."""

    def begin(self, step: int, batch: Any, batch_idx: int) -> None:
        """At the batch start: the iteration's batch and RNG, before anything in the step draws from it."""
        batch = apply_to_collection(batch, torch.Tensor, lambda t: t.detach().clone())
        self._begun = (step, Iteration(batch, batch_idx, _collect_rng_states(include_cuda=torch.cuda.is_available())))

    def end(self, trainer: L.Trainer, layout: Layout, own_key: str) -> WindowLog | None:
        """At the batch end (after the optimizer step and the schedulers): capture the offset; returns the window
        when this iteration completed it (its last copy may still be in flight: :attr:`pending`). A window whose
        first iteration this process did not see is skipped."""
        self.join()
        if self._begun is None:
            return None
        step, iteration = self._begun
        self._begun = None
        k, t = divmod(step, self.window)
        log = self.logs.get(k % WINDOW_SLOTS)
        if t == 0:
            buffers = self.open_slot(k)
            if log is None:
                schedule, _ = window_plan(layout, self.window)  # the plan the memory report sized
                check_same(
                    {u.key: t for u, t in schedule.items() if isinstance(u, DenseUnit)},
                    "the replay window's offsets of the dense units",
                )
                log = self.logs[k % WINDOW_SLOTS] = WindowLog(WindowRecord(schedule, self.window, buffers))
            log.start_step, log.iterations, log.trainer_state = step, [], None
            log.schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
            groups = trainer.optimizers[0].param_groups
            log.param_groups = [{key: v for key, v in group.items() if key != "params"} for group in groups]
        elif log is None or log.start_step != step - t or log.record.captured != t:
            return None
        start = time.perf_counter()
        copies = log.record.plan(layout, t)
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, target, source in copies:
            (later if self.behind and not is_buffer_key(key) else now).append((target, source))
        copy_all(now)
        if later:
            self.pending = self._copier.submit(_timed_copy, later)
        fault_point("capture", trainer.global_step)
        self.copy_seconds.append(time.perf_counter() - start)
        self.copied_bytes.append(sum(target.numel() * target.element_size() for _, target, _ in copies))
        log.iterations.append(iteration)
        if t < self.window - 1:
            return None
        log.trainer_state = trainer_state.capture(trainer, own_key)
        return log

    def join(self) -> None:
        """Wait for the copy in flight, before anything changes what it copies (the next optimizer step) or reads
        what it wrote; raises what it raised."""
        if self.pending is not None:
            start = time.perf_counter()
            copy, self.pending = self.pending, None
            seconds = copy.result()
            self.wait_seconds.append(time.perf_counter() - start)
            self.copy_seconds[-1] += seconds


def _timed_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    copy_all(pairs)
    return time.perf_counter() - start


WINDOW_PREFIX = "replay_window."
"""Names of the storage objects holding windows begin so (:func:`~moc_lightning.replay.window_store.window_object`)."""


@dataclass
class ReplayReport:
    """What a resume under replay mode did."""

    window_start: int
    """Global step before the replayed window's first iteration."""
    resume_step: int
    """Global step training continues from (the window's end)."""
    replay_iterations: int
    """Iterations recomputed through ``training_step`` (W-1: the first one's state is restored directly)."""
    replay_seconds: float
    """Wall time of the replay's computation: the replayed iterations (under DDP with one more forward and backward,
    :func:`_rebuild_ddp_buckets`), without copying the window's tensors into the live ones (that is in
    :attr:`restore_seconds`)."""
    restored_bytes: int
    """Size of the window read from :attr:`source` (serialized: its tensors, batches, RNG and trainer state)."""
    restore_seconds: float
    """Opening the window from :attr:`source` (mapping a local file, reading a remote object whole), plus copying
    its tensors into the live ones (:attr:`Replay.restore_seconds`: every unit's full state, the frozen units'
    logged weights), which is where a mapped file's bytes are read; issue 14 item 7 bounds this by the speed of
    light of a copy (memory) or a read (storage) of :attr:`restored_bytes`. Opening the rank's other copies, to
    agree on the window, is not in it."""
    plt: float = 0.0
    """Proportion of lost tokens: none, every unit is back at its fault-free state after the window."""
    source: str = "storage"
    """Where the window came from: ``memory`` (node-local shared memory) or ``storage``."""


def replay_window(
    trainer: L.Trainer, module: L.LightningModule, layout: Layout, log: WindowLog, source: str,
    restored_bytes: int, read_seconds: float,
) -> ReplayReport:
    """Bring ``layout``'s model and optimizer to their state after ``log``'s window, by replaying it (module
    docstring); the LR schedulers and the optimizer's hyperparameters end where the window left them.
    ``restored_bytes`` and ``read_seconds``: how big the window read from ``source`` was and how long reading it
    took, for the report's restore figures."""
    optimizer = trainer.optimizers[0]
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    for group, saved in zip(optimizer.param_groups, log.param_groups):
        group.update(saved)
    for scheduler, state in zip(schedulers, log.schedulers):
        scheduler.load_state_dict(state)
    run = Replay(log.record, layout)
    start = time.perf_counter()
    with _logging_off(module), torch.enable_grad():
        _rebuild_ddp_buckets(trainer, run, log)
        for i in run.iterations:
            run.before_forward(i)
            loss = _training_step(trainer, log.iterations[i])
            module.on_before_backward(loss)
            loss.backward()
            module.on_after_backward()
            module.on_before_optimizer_step(optimizer)
            module.configure_gradient_clipping(
                optimizer, gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )
            run.before_optimizer_step(i)
            optimizer.step()
            for scheduler in schedulers:
                scheduler.step()
            fault_point("replay", log.start_step + i + 1)
        run.finish()
    seconds = time.perf_counter() - start
    return ReplayReport(
        log.start_step, log.end_step, len(run.iterations), seconds - run.restore_seconds, restored_bytes,
        read_seconds + run.restore_seconds, source=source,
    )


def _training_step(trainer: L.Trainer, iteration: Iteration) -> torch.Tensor:
    """The loss of ``iteration``'s ``training_step``, from its batch and RNG streams, through the strategy (under DDP
    only the wrapped model's forward arms the backward's gradient all-reduce: module docstring)."""
    _set_rng_states(iteration.rng)
    output = trainer.strategy.training_step(iteration.batch, iteration.batch_idx)
    loss = output["loss"] if isinstance(output, Mapping) else output
    if loss is None:
        raise RuntimeError(
            f"replay recomputes training_step for batch_idx={iteration.batch_idx}, and it returned no loss (a skipped "
            "step); the replay needs the loss of every iteration of the window"
        )
    return loss


def _rebuild_ddp_buckets(trainer: L.Trainer, run: Replay, log: WindowLog) -> None:
    """Bring a fresh DDP to the gradient buckets it reduces in after its first iteration, before the replay's first.

    DDP puts the gradients in buckets by parameter order for its first backward and, after it, rebuilds them in the
    order the gradients became ready (rank 0's; the same in any iteration of a graph that does not change). Over
    more than two ranks an all-reduce sums each element in an order given by its place in its bucket (gloo's ring,
    NCCL's rings and trees), so the same gradients reduced in other buckets differ in the last bits. A replayed
    iteration ran after its process's first one in the fault-free run, but the replay is the first work of a new
    process: its first iteration would be reduced in the first-iteration buckets (measured, 4 ranks at ep=2: every
    dense gradient of the replay's first iteration in some elements, in fp32 as in bf16, and through the global-norm
    clipping every gradient in bf16). So the replay's first iteration is run once before, to no effect but DDP's
    rebuild: its forward and backward on the state the iteration begins with, whose gradients are dropped, and which
    :meth:`Replay.before_forward` puts back (a forward may update buffers); the RNG streams are set again before the
    iteration. A DDP whose ready order is its parameter order, or that never rebuilds (``find_unused_parameters``),
    reduces as before. Costs one forward and backward per recovery, counted in the replay's seconds; without DDP
    nothing runs."""
    if not isinstance(trainer.strategy.model, DistributedDataParallel) or not run.iterations:
        return
    first = run.iterations[0]
    restored = run.restore_seconds
    run.before_forward(first)
    _training_step(trainer, log.iterations[first]).backward()
    run.restore_seconds = restored  # the loop restores the same state again: that copy is the recovery's restore


@contextlib.contextmanager
def _logging_off(module: L.LightningModule) -> Iterator[None]:
    """``self.log``/``log_dict`` do nothing while the replay runs: those iterations logged in the faulty run, and
    Lightning's result collection is not set up for a training step here."""
    def off(*args: Any, **kwargs: Any) -> None:
        """Stands in for both: takes any arguments, logs nothing."""

    module.log = module.log_dict = off  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
