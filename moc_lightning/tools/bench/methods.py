"""The checkpointing methods compared: Lightning's own (sync and async), DCP ``async_save``, nvidia-resiliency-ext's
local checkpointing, MoC in PEC and replay mode; each wires itself into a fit and says how to resume."""

from __future__ import annotations

import abc
import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from moc_lightning.config import CheckpointConfig, ReplayConfig, StorageConfig
from moc_lightning.engine.layout import Layout, build_layout
from moc_lightning.engine.pieces import piece
from moc_lightning.engine.size_model import bytes_written, size_model
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.replay.driver import WINDOW_PREFIX, ReplayReport, WindowCapture
from moc_lightning.replay.window_file import read_file
from moc_lightning.replay.window_store import STORAGE_COPIES, memory_head, window_object
from moc_lightning.storage.read_speed import evict, read_gbps
from moc_lightning.tools.bench.config import PAPER_K, BenchConfig, MethodUnavailable, scaled_k
from moc_lightning.tools.bench.fitting import (
    no_setup,
    recover_seconds,
    release_memory,
    restore_figures,
    slowest,
    this_rank,
)
from moc_lightning.tools.bench.timing import Baseline, Probe, Row, timed

try:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback import (
        HierarchicalCheckpointIO,
        LocalCheckpointCallback,
    )
except ImportError as error:  # an optional dependency: its row is skipped with this reason
    NVRX_MISSING: str | None = f"nvidia-resiliency-ext does not import ({error}); pip install nvidia-resiliency-ext"
else:
    NVRX_MISSING = None

    class HostTensorAwareStateDict(BasicTensorAwareStateDict):
        """nvrx's basic tensor-aware state dict without its CUDA-only assertions.

        Tensors are never moved back to a device on load: Lightning copies loaded weights into the live
        parameters, and the optimizer casts its state to each parameter's device.
        """

        def __init__(self, state_dict: dict[str, Any]) -> None:
            self.state_dict = state_dict
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            """Leave tensors where they were loaded."""

    class LightningHierarchicalCheckpointIO(HierarchicalCheckpointIO):
        """The two conversions nvrx leaves abstract: Lightning's checkpoint dict is the tensor-aware state."""

        def to_tensor_aware_state_dict(self, checkpoint: dict[str, Any]) -> HostTensorAwareStateDict:
            return HostTensorAwareStateDict(checkpoint)

        def from_tensor_aware_state_dict(
            self, tensor_aware_checkpoint: HostTensorAwareStateDict, **kwargs: Any
        ) -> dict[str, Any]:
            return tensor_aware_checkpoint.state_dict


class Method(abc.ABC):
    """One checkpointing method: what it adds to a Trainer, how a fresh run resumes, and what it wrote."""

    paired = False
    """Whether a no-checkpoint run is trained right before this method's, for an overhead measured side by side
    (the run's baseline, at its start, may have run on a machine loaded otherwise)."""

    def __init__(self, name: str, root: Path, every: int) -> None:
        self.name = name
        self.root = root
        self.every = every
        self.probe = Probe()
        self.notes = ""

    @abc.abstractmethod
    def callbacks(self) -> list[L.Callback]:
        """Callbacks of the training run."""

    def session(self) -> contextlib.AbstractContextManager[None]:
        """Process-wide set-up the method needs around its runs."""
        return contextlib.nullcontext()

    def attach(self, trainer: L.Trainer) -> None:
        """Install checkpoint IO plugins and timers once the Trainer exists."""

    @abc.abstractmethod
    def resume(self) -> tuple[list[L.Callback], Callable[[L.Trainer], None], str | None]:
        """Callbacks, Trainer set-up and ``ckpt_path`` of a fresh run that restores the newest checkpoint."""

    @abc.abstractmethod
    def checkpoints(self) -> list[Path]:
        """Each checkpoint on disk: a file, or a DCP directory."""

    def stalls(self) -> list[float]:
        """Seconds the training thread was blocked at each checkpoint step."""
        return [s for step, s in self.probe.blocking if step > 0 and step % self.every == 0]

    def expected_bytes(self, trainer: L.Trainer) -> float:
        """Eq. 5: a full-state method checkpoints every parameter with its optimizer state."""
        return size_model(layout_of(trainer)).c_full()

    def snapshot_bytes(self, trainer: L.Trainer) -> list[int]:
        """Bytes of each timed copy into memory: full-state methods copy all of the state."""
        return [model_state_bytes(trainer)] * len(self.probe.snapshot)

    def snapshot_bytes_mean(self) -> float | None:
        """Mean bytes of one snapshot's copy on this rank, from the latest run's engine; ``None`` where the method
        keeps no count of its own (:meth:`snapshot_bytes` then reads the trainer)."""
        return None

    def snapshot_seconds(self) -> list[float]:
        """Duration of each timed copy into memory."""
        return [s for _, s in self.probe.snapshot]

    def persist_seconds(self) -> list[float]:
        """Duration of each write to storage."""
        return [s for _, s in self.probe.persist]

    def stall_phases(self) -> list[tuple[float, ...]] | None:
        """Per snapshot, its stall by phase (:data:`~moc_lightning.tools.bench.config.STALL_PHASES`), summing to its
        :meth:`stalls` entry; ``None``: not broken down (the method's hook is one piece of work)."""
        return None

    def copied_tensors(self) -> list[torch.Tensor] | None:
        """The tensors one snapshot copies, for the speed of light of exactly its bytes; ``None``: the whole state
        (or no snapshot at all)."""
        return None

    def blocking_votes(self) -> int | None:
        """Snapshots whose persist vote the training thread waited for (MoC); ``None``: no such vote."""
        return None

    def recover(self, cfg: BenchConfig, row: Row, base: Baseline) -> None:
        """Resume a fresh run from the newest checkpoint and fill ``row``'s recovery figures."""
        row.recover_seconds = recover_seconds(cfg, self)

    def release(self) -> None:
        """Drop references to the measured run, so that its model is freed before the recovery run builds one."""


class LightningMethod(Method):
    """``ModelCheckpoint`` every N steps: ``torch.save`` inline, or on ``AsyncCheckpointIO``'s thread."""

    def __init__(self, name: str, root: Path, every: int, asynchronous: bool) -> None:
        super().__init__(name, root, every)
        self.asynchronous = asynchronous
        self.checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)
        if asynchronous:
            self.notes = "snapshot: AsyncCheckpointIO clones every tensor on the training thread"

    def callbacks(self) -> list[L.Callback]:
        return [self.checkpoint]

    def attach(self, trainer: L.Trainer) -> None:
        step = _step_of(trainer)
        writer = TorchCheckpointIO()
        timed(writer, "save_checkpoint", self.probe.persist, step)
        io: CheckpointIO = writer
        if self.asynchronous:
            io = AsyncCheckpointIO(writer)
            timed(io, "save_checkpoint", self.probe.snapshot, step)
        trainer.strategy.checkpoint_io = io
        timed(self.checkpoint, "on_train_batch_end", self.probe.blocking, step)

    def resume(self) -> tuple[list[L.Callback], Callable[[L.Trainer], None], str | None]:
        return [], no_setup, self.checkpoint.best_model_path

    def checkpoints(self) -> list[Path]:
        return sorted((self.root / "ckpt").glob("*.ckpt"))


class DCPAsync(L.Callback):
    """torchtitan's checkpointing: DCP ``async_save`` in thread mode, after waiting for the previous save.

    As torchtitan does, the save's collectives run on a gloo group of their own: on the training's group they
    would interleave with the gradient all-reduces of the steps the save overlaps, from another thread.
    """

    def __init__(self, root: Path, every: int, probe: Probe) -> None:
        self.root = root
        self.every = every
        self.probe = probe
        self.future: Any = None
        self.group: dist.ProcessGroup | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_initialized() and self.group is None:
            self.group = dist.new_group(backend="gloo")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        start = time.perf_counter()
        self.wait()
        staging = time.perf_counter()
        model, optim = get_state_dict(pl_module, trainer.optimizers)
        self.future = dcp.async_save(
            {"model": model, "optim": optim},
            checkpoint_id=self.root / f"step_{step:09d}",
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            process_group=self.group,
        )
        returned = time.perf_counter()
        self.future.add_done_callback(lambda _: self.probe.persist.append((step, time.perf_counter() - returned)))
        self.probe.snapshot.append((step, returned - staging))
        self.probe.blocking.append((step, returned - start))

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wait()


class DCPRestore(L.Callback):
    """Loads a DCP checkpoint into the model and the optimizer before the first step.

    ``partitioned``: each rank keeps the optimizer state of its own parameters only (ZeRO), so its optimizer
    template, and what it loads, lacks the others'; the model is still loaded strictly.
    """

    def __init__(self, checkpoint: Path, partitioned: bool) -> None:
        self.checkpoint = checkpoint
        self.partitioned = partitioned

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model, optim = get_state_dict(pl_module, trainer.optimizers)  # templates, optimizer state initialised
        state: dict[str, Any] = {"model": model, "optim": optim}
        dcp.load(state, checkpoint_id=self.checkpoint)
        set_model_state_dict(pl_module, state["model"])
        options = StateDictOptions(strict=not self.partitioned)
        set_optimizer_state_dict(pl_module, trainer.optimizers, state["optim"], options=options)


class DCPMethod(Method):
    """Full model + optimizer state through ``torch.distributed.checkpoint.async_save``."""

    def __init__(self, name: str, root: Path, every: int, partitioned: bool) -> None:
        super().__init__(name, root, every)
        self.partitioned = partitioned
        self.callback = DCPAsync(root / "ckpt", every, self.probe)
        self.notes = "snapshot: async_save's blocking staging copy; recovery restores model+optimizer, not loops"

    def callbacks(self) -> list[L.Callback]:
        return [self.callback]

    def resume(self) -> tuple[list[L.Callback], Callable[[L.Trainer], None], str | None]:
        return [DCPRestore(max((self.root / "ckpt").glob("step_*")), self.partitioned)], no_setup, None

    def checkpoints(self) -> list[Path]:
        return sorted((self.root / "ckpt").glob("step_*"))


class MoCMethod(Method):
    """``MoCCheckpoint``: snapshots into shared-memory slots, every snapshot persisted with PEC."""

    def __init__(self, name: str, root: Path, every: int, shm_root: Path, **options: Any) -> None:
        """``options``: further ``CheckpointConfig`` fields (K, the mode)."""
        super().__init__(name, root, every)
        self.config = CheckpointConfig(
            every_n_train_steps=every,
            persist_every_n_snapshots=1,
            storage=StorageConfig(url=(root / "ckpt").as_uri()),
            shm_root=str(shm_root),
            persist_on_fit_end=False,  # like the other methods: periodic checkpoints only, no save_last
            complete_first_persist=False,  # PEC's steady state (eq. 6); the one complete persist: docs/user-guide.md
            **options,
        )
        self.checkpoint: MoCCheckpoint | None = MoCCheckpoint(copy.deepcopy(self.config))
        """The measured run's callback, until :meth:`release`."""
        self.resumed: MoCCheckpoint | None = None
        """The recovery run's callback."""
        self._copied: list[torch.Tensor] = []
        """The live tensors the measured run's latest snapshot copied, until :meth:`release`."""
        self.notes = f"k_snapshot={self.config.k_snapshot}, k_persist={self.config.k_persist}"

    def _measured(self) -> MoCCheckpoint:
        """The measured run's callback: its figures are read before :meth:`release` drops it."""
        if self.checkpoint is None:
            raise RuntimeError(f"{self.name}: the measured run's MoCCheckpoint is read after release() dropped it")
        return self.checkpoint

    def _engine(self) -> TwoLevelCheckpointer:
        """The measured run's engine, which its callback built when the fit started."""
        engine = self._measured().engine
        if engine is None:
            raise RuntimeError(f"{self.name}: MoCCheckpoint builds its engine when a fit starts; the run has not")
        return engine

    def _resumed(self) -> MoCCheckpoint:
        """The recovery run's callback, which :meth:`resume` made."""
        if self.resumed is None:
            raise RuntimeError(f"{self.name}: no recovery run yet (resume() makes its MoCCheckpoint)")
        return self.resumed

    def callbacks(self) -> list[L.Callback]:
        return [self._measured()]

    def attach(self, trainer: L.Trainer) -> None:
        """Time the batch-end hook (it selects and, for host tensors, copies) and the join before each optimizer step,
        and keep the tensors of the latest snapshot's copy once the engine exists."""
        checkpoint, step = self._measured(), _step_of(trainer)
        timed(checkpoint, "on_train_batch_end", self.probe.blocking, step)
        timed(checkpoint, "on_before_optimizer_step", self.probe.joins, step)
        on_train_start = checkpoint.on_train_start

        def keep_copied(*args: Any, **kwargs: Any) -> None:
            store = self._engine().store
            fill = store.fill

            def recording_fill(slot: int, tensors: Any, *more: Any, **options: Any) -> Any:
                self._copied = list(tensors.values())
                return fill(slot, tensors, *more, **options)

            setattr(store, "fill", recording_fill)  # on this instance only, as timed() wraps a method
            on_train_start(*args, **kwargs)

        setattr(checkpoint, "on_train_start", keep_copied)

    def resume(self) -> tuple[list[L.Callback], Callable[[L.Trainer], None], str | None]:
        self.resumed = MoCCheckpoint(copy.deepcopy(self.config))
        return [self.resumed], no_setup, self.resumed.resume_target()

    def stalls(self) -> list[float]:
        """The batch-end hook (trainer state, agreement, selection and copy), plus the hook before the next optimizer
        step (the join, waiting for the commit, and the snapshot's metrics); the last snapshot, after which no step
        runs, is joined when fit ends: its wait."""
        return [sum(phases) for phases in self._phases()]

    def stall_phases(self) -> list[tuple[float, ...]] | None:
        return self._phases()

    def _phases(self) -> list[tuple[float, ...]]:
        """Per snapshot, the engine's phases of its stall (:class:`~moc_lightning.memory.stats.StallPhases`) and the
        rest of the two hooks (``hook``), in the order of :data:`~moc_lightning.tools.bench.config.STALL_PHASES`."""
        joins = dict(self.probe.joins)
        hooks = [(step, s) for step, s in self.probe.blocking if step > 0 and step % self.every == 0]
        rows: list[tuple[float, ...]] = []
        for (step, hook), phases in zip(hooks, self._engine().stats.stall_phases, strict=True):
            stall = hook + joins.get(step, phases.wait)
            timed_parts = (phases.trainer_state, phases.agreement, phases.preparation, phases.copy, phases.wait)
            rows.append((*timed_parts, stall - sum(timed_parts)))
        return rows

    def copied_tensors(self) -> list[torch.Tensor] | None:
        return self._copied

    def blocking_votes(self) -> int | None:
        return sum(phases.blocking_vote for phases in self._engine().stats.stall_phases)

    def checkpoints(self) -> list[Path]:
        return sorted((self.root / "ckpt").glob("step_*"))

    def expected_bytes(self, trainer: L.Trainer) -> float:
        """Eq. 6 with this run's K (eq. 5 when K = N)."""
        pec = self._engine().pec
        return pec.size_model().c_pec(pec.dynamic_k.k_persist)

    def snapshot_bytes(self, trainer: L.Trainer) -> list[int]:
        return self._engine().stats.snapshot_bytes

    def snapshot_bytes_mean(self) -> float | None:
        copied = self._engine().stats.snapshot_bytes
        return sum(copied) / len(copied) if copied else None

    def snapshot_seconds(self) -> list[float]:
        """Each copy into a slot, like the other methods' copies into memory (the commit of the slot's metadata
        that follows on the background thread is not part of it)."""
        return self._engine().stats.copy_seconds

    def persist_seconds(self) -> list[float]:
        """Each persist from the start of its DCP save to its commit in the manifest."""
        return [r.seconds for r in self._engine().stats.persist_reports]

    def release(self) -> None:
        """The engine's layout views the trained model's weights and optimizer state."""
        self.checkpoint = None
        self._copied = []


class ReplayMethod(MoCMethod):
    """``MoCCheckpoint`` with ``checkpoint.mode=replay``: every iteration captures a window offset (the full state of
    its active units, the weights of the frozen ones) into a window slot in shared memory, copied while the next
    forward and backward run; each complete window is handed to a background thread that seals it and writes every
    ``persist_every``-th to storage; a recovery restores the newest window and replays up to W-1 iterations before
    the first step.

    Its stall is every iteration's batch-end hook (the capture's hand-off, and every W iterations the hand-over,
    which waits for the previous window's writes if they are still running) plus the wait for the copy before the
    next optimizer step, as the issue measures it (a snapshot every iteration); its "snapshot" is a capture, its
    "persist" a window's storage write (in the background), its
    "checkpoint" on disk the newest window object (rank 0's objects alternate), and its eq. 5/6 bytes are a
    window's tensor bytes (every unit's full state once, plus the logged weights).
    """

    paired = True

    def __init__(self, name: str, root: Path, every: int, shm_root: Path, window: int, persist_every: int) -> None:
        super().__init__(
            name, root, every, shm_root, mode="replay",
            replay=ReplayConfig(window=window, persist_every_n_windows=persist_every),
            remove_snapshots_on_fit_end=False,  # the first recovery, like a crashed process's, finds the copy in memory
        )
        self.window = window
        self.notes = (
            f"replay window W={window}: a capture every iteration into shared memory, overlapping the next forward and "
            f"backward; every {'' if persist_every == 1 else f'{persist_every}th '}window written to storage by a "
            "background thread"
        )

    def attach(self, trainer: L.Trainer) -> None:
        super().attach(trainer)
        checkpoint = self._measured()
        timed_start = self._time_window_writes(checkpoint.on_train_start, trainer)
        setattr(checkpoint, "on_train_start", timed_start)  # on this instance only, as timed() wraps a method

    def _time_window_writes(self, on_train_start: Callable[..., None], trainer: L.Trainer) -> Callable[..., None]:
        """Time the window writes once the callback's engine (and its storage) exists."""

        def wrapper(*args: Any, **kwargs: Any) -> None:
            storage = self._engine().pec.storage
            timed(storage, "put_file", self.probe.persist, _step_of(trainer),
                  only=lambda name, source: name.startswith(WINDOW_PREFIX))  # a copy of the window's file in memory
            on_train_start(*args, **kwargs)

        return wrapper

    def _capture(self) -> WindowCapture:
        """The measured run's window captures, which its callback makes from the first iteration (W is given)."""
        capture = self._measured().capture
        if capture is None:
            raise RuntimeError(f"{self.name}: the measured run made no window captures")
        return capture

    def stalls(self) -> list[float]:
        """Every iteration's hook (the capture's buffers and its hand-off to the copy thread, and every W iterations
        the window's hand-over), plus waiting for that copy before the next optimizer step."""
        waits = self._capture().wait_seconds
        waits = waits + [0.0] * (len(self.probe.blocking) - len(waits))  # no wait (yet) after the last hooks: 0
        return [hook + wait for (_, hook), wait in zip(self.probe.blocking, waits, strict=True)]

    def checkpoints(self) -> list[Path]:
        """The newest window this process wrote (one of the objects rank 0 alternates)."""
        written = [p for p in (self.root / "ckpt" / window_object(0, i) for i in range(STORAGE_COPIES)) if p.exists()]
        return [max(written, key=lambda p: p.stat().st_mtime_ns)] if written else []

    def expected_bytes(self, trainer: L.Trainer) -> float:
        """A window's tensor bytes: what its W captures copied."""
        return float(sum(self._capture().copied_bytes[-self.window:]))

    def snapshot_bytes(self, trainer: L.Trainer) -> list[int]:
        return self._capture().copied_bytes

    def stall_phases(self) -> None:
        """A capture's hook is not broken down (its phases are a PEC snapshot's)."""
        return None

    def copied_tensors(self) -> None:
        """A capture copies other tensors at every iteration; its restores are measured against the state's copy."""
        return None

    def snapshot_seconds(self) -> list[float]:
        return self._capture().copy_seconds

    def persist_seconds(self) -> list[float]:
        return [s for _, s in self.probe.persist]

    def recover(self, cfg: BenchConfig, row: Row, base: Baseline) -> None:
        """Two recoveries, each with its restore (opening the window, copying its tensors into the live ones) apart
        from its replay, against the speed of light of moving the restored bytes (issue 14 item 7): a crashed
        process on a healthy node (the window from shared memory, against ``copy_gbps``), then a lost node (its
        shared-memory copy removed: the window from storage, against a sequential read of a file of the restored
        size in the checkpoint directory, measured now). The window objects' pages are evicted from the page cache
        as that file's are (:mod:`moc_lightning.storage.read_speed`), so the recovery's read starts from the same cache
        state as the bound's."""
        row.recover_seconds = recover_seconds(cfg, self)
        (row.restore_memory_seconds, row.restore_memory_bytes, row.restore_memory_light_ratio,
         row.replay_seconds) = restore_figures(memory := self._replayed("memory"), base.bounds.copy_gbps)  # fmt: skip
        windows = self._resumed().windows
        if windows is None:
            raise RuntimeError(f"{self.name}: the recovery run has no window store (checkpoint.mode=replay makes one)")
        for path in (p for slot in windows.slots for p in (slot.path, memory_head(slot.path))):
            path.unlink(missing_ok=True)  # the node's shared memory is lost
        storage, rank = self.root / "ckpt", this_rank()
        for path in (storage / window_object(rank, index) for index in range(STORAGE_COPIES)):
            if path.exists():
                evict(path)
        gbps = read_gbps(storage / f"read_speed_of_light.{rank}.bin", memory.restored_bytes)
        row.read_gbps = round(-slowest([-gbps])[0], 3)  # the slowest rank's bandwidth
        release_memory()
        row.recover_storage_seconds = recover_seconds(cfg, self)
        (row.restore_storage_seconds, row.restore_storage_bytes, row.restore_storage_light_ratio,
         row.replay_storage_seconds) = restore_figures(self._replayed("storage"), gbps)  # fmt: skip

    def _replayed(self, source: str) -> ReplayReport:
        """The recovery run's report, which must have restored from ``source``."""
        report = self._resumed().replay_report
        if report is None or report.source != source:
            found = "no window" if report is None else f"the window from {report.source}"
            raise RuntimeError(f"{self.name}: the recovery meant to restore from {source} restored {found}")
        return report


class NvrxMethod(Method):
    """nvidia-resiliency-ext's ``LocalCheckpointCallback`` + ``HierarchicalCheckpointIO`` (local tier only).

    nvrx's local manager agrees on the newest complete checkpoint with a collective, so the run gets a
    one-rank gloo process group; its asynchronous path calls ``torch.cuda.synchronize()`` and needs NeMo's
    async queue, so saves are synchronous here.
    """

    def __init__(self, name: str, root: Path, every: int) -> None:
        if NVRX_MISSING:
            raise MethodUnavailable(NVRX_MISSING)
        super().__init__(name, root, every)
        self.checkpoint = LocalCheckpointCallback(every_n_train_steps=every)
        self.notes = "synchronous local save (nvrx async needs CUDA + NeMo's async queue); 1-rank gloo group"

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        dist.init_process_group("gloo", init_method=(self.root / "pg").as_uri(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()

    def _io(self, trainer: L.Trainer) -> CheckpointIO:
        manager = LocalCheckpointManager(self.root / "local")
        timed(manager, "_save", self.probe.persist, _step_of(trainer))
        return LightningHierarchicalCheckpointIO(TorchCheckpointIO(), manager, _no_global_checkpoint)

    def callbacks(self) -> list[L.Callback]:
        return [self.checkpoint]

    def attach(self, trainer: L.Trainer) -> None:
        trainer.strategy.checkpoint_io = self._io(trainer)
        timed(self.checkpoint, "on_train_batch_end", self.probe.blocking, _step_of(trainer))

    def resume(self) -> tuple[list[L.Callback], Callable[[L.Trainer], None], str | None]:
        def install(trainer: L.Trainer) -> None:
            trainer.strategy.checkpoint_io = self._io(trainer)

        return [], install, str(self.root / "local")

    def checkpoints(self) -> list[Path]:
        return sorted(p for p in (self.root / "local").rglob("*") if p.is_file())


def _no_global_checkpoint(path: Any) -> int:
    """The benchmark has no global tier, so a local checkpoint is always the newer one."""
    return -1


def make_method(name: str, root: Path, cfg: BenchConfig, shm_root: Path) -> Method:
    """The method called ``name``, writing under ``root``."""
    every, n = cfg.every_n_train_steps, cfg.model.num_experts
    if name in ("lightning_sync", "lightning_async") and cfg.data_parallel == "zero2" and cfg.devices > 1:
        raise MethodUnavailable(
            "ModelCheckpoint saves rank 0's optimizer state only, and under zero2 the other ranks keep the rest"
        )
    if name == "nvrx_local" and cfg.devices > 1:
        raise MethodUnavailable("the nvrx row runs in one process (it makes its own one-rank process group)")
    if name in ("lightning_sync", "lightning_async"):
        return LightningMethod(name, root, every, asynchronous=name == "lightning_async")
    if name == "dcp_async":
        return DCPMethod(name, root, every, partitioned=cfg.data_parallel == "zero2")
    if name == "nvrx_local":
        return NvrxMethod(name, root, every)
    if name == "moc_replay":
        return ReplayMethod(name, root, every, shm_root / name, cfg.replay_window, cfg.replay_persist_every_n_windows)
    k = {"moc_full": (n, n), "moc_paper": tuple(scaled_k(v, n) for v in PAPER_K), "moc_k1": (1, 1)}[name]
    return MoCMethod(name, root, every, shm_root / name, k_snapshot=k[0], k_persist=k[1])


def disk_bytes(checkpoint: Path) -> int:
    """Bytes a checkpoint occupies on disk, framing included (DCP metadata, ``moc.json``, pickles)."""
    return bytes_written(checkpoint) if checkpoint.is_dir() else checkpoint.stat().st_size


def tensor_bytes(checkpoint: Path) -> int:
    """Bytes of the tensors a checkpoint on disk holds: what eq. 5/6 count, without any file framing.

    Read from a DCP checkpoint's own ``.metadata``, from a replay window file (:mod:`moc_lightning.replay.window_file`), or
    from a ``torch.save`` file loaded memory-mapped.
    """
    if checkpoint.is_dir():
        metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.values()
        return sum(
            math.prod(m.size) * torch.empty((), dtype=m.properties.dtype).element_size()
            for m in metadata
            if isinstance(m, TensorStorageMetadata)
        )
    if checkpoint.name.startswith(WINDOW_PREFIX):
        loaded: Any = read_file(checkpoint)
    else:
        loaded = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
    return sum(t.numel() * t.element_size() for t in _tensors_in(loaded))


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors nested anywhere in ``obj`` (dicts, lists, and objects such as nvrx's state dict)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)
    elif hasattr(obj, "__dict__"):
        yield from _tensors_in(vars(obj))


def _step_of(trainer: L.Trainer) -> Callable[[], int]:
    return lambda: trainer.global_step


def layout_of(trainer: L.Trainer) -> Layout:
    """The units of the model a bench run trained, over its optimizer's state."""
    module = cast(GPTMoEModule, trainer.lightning_module)  # the model every bench run trains (Fit)
    return build_layout(module, trainer.optimizers[0], num_experts=module.model_config.num_experts)


def model_state_tensors(trainer: L.Trainer) -> list[torch.Tensor]:
    """Every tensor of a full checkpoint this rank holds: weights and optimizer state (its local pieces under
    ``fsdp2``)."""
    optimizer_state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)]
    return [piece(t) for t in (*trainer.lightning_module.state_dict().values(), *optimizer_state)]


def model_state_bytes(trainer: L.Trainer) -> int:
    return sum(t.numel() * t.element_size() for t in model_state_tensors(trainer))
