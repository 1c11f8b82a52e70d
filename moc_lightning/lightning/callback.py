"""``MoCCheckpoint``: the Lightning glue. It decides *when*; the engines decide *how*.

Add it to a Trainer and resume through Lightning's usual door::

    moc = MoCCheckpoint(CheckpointConfig(k_snapshot=4, k_persist=1, storage=StorageConfig(url="file:///ckpt")))
    trainer = L.Trainer(callbacks=[moc], ...)
    trainer.fit(model, ckpt_path=moc.resume_target())   # None on a fresh start

Every ``every_n_train_steps`` steps the train-batch end takes an in-memory snapshot (persistent buffers are
copied there and then; weights and optimizer state by a background thread, from host memory or on a side CUDA
stream, while the next forward/backward runs) and that thread commits it; the next optimizer step
(``on_before_optimizer_step``) waits only for what is not done. Every ``persist_every_n_snapshots``
snapshots one is persisted to storage in the background (a lineage's first one with every unit, see
``complete_first_persist``), and when ``fit`` ends every unit is persisted.
``ckpt_path`` equal to the storage URL makes Lightning restore through a two-level recovery: units from
surviving snapshots (this rank's or a peer's) or storage, and the rest of the training state from what this
rank captured with the resume step (:mod:`moc_lightning.engine.trainer_state`: loops and the train loader's
position, optimizer hyperparameters, schedulers, precision plugin, datamodule, other callbacks, what the
module and callbacks add in ``on_save_checkpoint``, and this rank's RNG, set just before the next step).

Router counts for PLT come from the LightningModule's ``moe_layers()`` when it has one (objects reporting
``tokens_per_expert``/``tokens_assigned``), else from forward hooks on each MoE layer or its router
(:mod:`moc_lightning.engine.routing`); where neither exists PLT is unknown, one warning says so, and options that
need it (Dynamic-K, load-aware selection) are refused. ``expert_topology`` (an
:class:`ExpertParallelTopology`) is the other optional member; without it every rank holds every expert.
How it stands beside ``enable_checkpointing`` and a ``ModelCheckpoint``: :mod:`moc_lightning.lightning.coexistence`.

``ckpt_path`` outside ``fit`` (``validate``, ``test``, ``predict``), with MoC the Trainer's only checkpoint
callback: ``None`` with the model evaluates its current weights (after ``fit``, those it ended with, which
the final persist wrote); ``"last"`` (which is ``moc.resume_target()``) or the storage URL loads MoC's newest
committed checkpoint, read-only (:mod:`moc_lightning.lightning.evaluation`); ``"best"``, which Lightning also takes
for a call without a model, is refused: MoC monitors no metric. ``fit(ckpt_path="last")`` resumes through MoC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from moc_lightning.config import AUTO, CheckpointConfig
from moc_lightning.engine import trainer_state
from moc_lightning.engine.layout import Layout, build_layout
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.lineage import fingerprint as lineage_fingerprint
from moc_lightning.engine.pieces import check_supported
from moc_lightning.engine.routing import TokenSource, token_source, unknown_message
from moc_lightning.export.hf_format import describe_model
from moc_lightning.lightning.coexistence import allow_with_checkpointing_disabled, check_other_checkpoints, resolve_last
from moc_lightning.lightning.evaluation import load_newest, no_best
from moc_lightning.lightning.start import agreed_manifest, begin_lineage
from moc_lightning.memory.snapshot import NUM_SLOTS, SnapshotStore
from moc_lightning.memory.two_level import RecoveryReport, TwoLevelCheckpointer, lose_node, node_root
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.stored import MANIFEST
from moc_lightning.replay.driver import (
    ReplayReport,
    WindowCapture,
    check_strategy,
    check_trainer,
    replay_window,
)
from moc_lightning.replay.memory import WindowMemory, window_memory
from moc_lightning.replay.window_choice import WindowChoice, WindowProbe
from moc_lightning.replay.window_store import WINDOW_SUFFIX, Restored, WindowStore
from moc_lightning.runtime.agreement import check_same, from_coordinator
from moc_lightning.runtime.background import spare_core
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.runtime.faults import FaultInjector, FaultPlan
from moc_lightning.storage import make_storage
from moc_lightning.storage.location import local_path


class MoCCheckpoint(Checkpoint):
    """Partial Experts Checkpointing at two levels, with two-level recovery on resume."""

    def __init__(self, config: CheckpointConfig | None = None, layout_preset: str = "auto") -> None:
        super().__init__()
        allow_with_checkpointing_disabled(lambda callback: isinstance(callback, MoCCheckpoint))
        resolve_last(_last_through_moc)
        self.config = config or CheckpointConfig()
        self.layout_preset = layout_preset
        self.engine: TwoLevelCheckpointer | None = None
        self.recovery: RecoveryReport | None = None
        self._trainer: L.Trainer | None = None
        self._module: L.LightningModule | None = None
        self._last_step = -1
        self._slots_sized = False
        self._restored_state: dict[str, Any] | None = None
        self._step_state: dict[str, Any] | None = None
        """The trainer state captured at the end of the latest step that needed it (a snapshot, the last step)."""
        self._fresh_start = False
        self._rng_to_restore: dict[str, Any] | None = None
        self._warned_not_resumable = False
        self.tokens: TokenSource | None = None
        """Where each step's router counts come from (set with the engine)."""
        self._said_unknown = False
        self.capture: WindowCapture | None = None
        """``mode=replay``: this fit's window captures (from the first iteration, or once ``window=auto`` chose W)."""
        self._probe: WindowProbe | None = None
        self.window_choice: WindowChoice | None = None
        """``mode=replay`` with ``replay.window=auto``: W and what it was chosen from (``None`` until chosen)."""
        self.windows: WindowStore | None = None
        """``mode=replay``: where completed windows go (shared memory, then storage) and are found on resume."""
        self._to_replay: Restored | None = None
        self.replay_report: ReplayReport | None = None
        """``mode=replay``: what the resume replayed (``None`` when it replayed nothing)."""
        self.window_memory: WindowMemory | None = None
        """``mode=replay``: the host memory of the windows, reported and checked before training."""

    # ------------------------------------------------------------ resuming
    def resume_target(self, default_root_dir: str | Path | None = None) -> str | None:
        """The ``ckpt_path`` that resumes through MoC, or ``None`` when there is nothing to resume.

        A cheap hint, read before the process group exists: the storage URL when ``resume=auto`` and a
        manifest is committed there (every run commits one before its first snapshot, so this also covers a
        restart before the first persist). Storage is shared, so every rank gets the same answer; whether and
        from where to resume is decided collectively once the process group exists (:meth:`restore`).
        """
        if self.config.resume == "never":
            return None
        self._default_url(default_root_dir)
        storage = make_storage(self.config.storage.backend, self.config.storage.url)
        return self.config.storage.url if storage.get(MANIFEST) is not None else None

    @property
    def best_model_path(self) -> str:
        """Refused (:func:`~moc_lightning.lightning.evaluation.no_best`): Lightning reads it for ``ckpt_path="best"``, and MoC
        monitors no metric."""
        fn = self._trainer.state.fn if self._trainer is not None else None
        raise no_best(fn.value if fn is not None else None, self.config.storage.url)

    def _default_url(self, default_root_dir: str | Path | None) -> None:
        if not self.config.storage.url and default_root_dir is not None:
            self.config.storage.url = (Path(default_root_dir) / "checkpoints").resolve().as_uri()

    def _run_root(self) -> Path:
        """This run's folder under the shared-memory root: one per storage URL."""
        return Path(self.config.shm_root) / hashlib.sha1(self.config.storage.url.encode()).hexdigest()[:12]

    def _slot_root(self, rank: int) -> Path:
        run_id = self._run_root().name
        return node_root(self.config.shm_root, run_id, rank, self.config.ranks_per_node) / f"rank{rank}"

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._default_url(trainer.default_root_dir)
        self._trainer, self._module = trainer, pl_module
        if not isinstance(trainer.strategy.checkpoint_io, _MoCCheckpointIO):
            trainer.strategy.checkpoint_io = _MoCCheckpointIO(trainer.strategy.checkpoint_io, self)
        _route_strategy_loads(trainer.strategy)
        _complete_restores_in_restore(trainer)
        if stage == "fit":
            if self.config.mode == "replay":
                check_strategy(trainer, pl_module)
            resuming = trainer.strategy.checkpoint_io.is_moc(trainer.ckpt_path)
            if resuming and self.config.resume == "never":
                raise ValueError(
                    f"fit was given ckpt_path={trainer.ckpt_path!r}, the MoC storage URL, but checkpoint.resume=never; "
                    "pass ckpt_path=moc.resume_target() (None with resume=never) or set checkpoint.resume=auto"
                )
            check_same(resuming, "whether to resume through MoC (fit's ckpt_path is the MoC storage URL)")

    def _build_engine(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer | None) -> None:
        """Create the engine once per process (the persist process group is collective to create)."""
        check_supported(dict(pl_module.named_parameters()), type(pl_module).__name__)
        topology = getattr(pl_module, "expert_topology", None) or ExpertParallelTopology.replicated()
        check_other_checkpoints(self._trainer, self, topology.ep, local_path(self.config.storage.url))
        layout = build_layout(
            pl_module, optimizer, preset=self.layout_preset, expert_parallel=topology.ep,
            expert_buffers=self.config.expert_buffers,
        )
        if self.tokens is None:
            self.tokens = token_source(pl_module, layout)
            self._check_counts()
        if self.engine is not None:
            self.engine.pec.attach(layout)
            return
        pec = self._new_pec(pl_module, layout, topology)
        faults = FaultInjector(FaultPlan.from_env(), topology.rank)
        slot_root = self._slot_root(topology.rank)
        if faults.lost_node and slot_root.parent == self._slot_root(faults.faulty_rank).parent:
            lose_node(slot_root.parent)
        if dist.is_initialized():
            dist.barrier()  # a lost node is gone before anyone takes inventory (of its slots here, too)
        if self.config.mode == "pec":
            check_shm_root(self.config, pec, slot_root.parent)
        elif self.config.replay.window != "auto":
            self._check_window_memory(layout, self.config.replay.window, topology.rank, slot_root.parent)
        self.engine = TwoLevelCheckpointer(pec, SnapshotStore(slot_root, pin_device=pl_module.device), faults)
        if self.config.mode == "replay":
            self.windows = WindowStore(
                pec.storage, slot_root, topology.rank, self.config.replay.persist_every_n_windows
            )
        if self._restored_state:
            pec.load_state_dict(self._restored_state)

    def _new_pec(
        self, pl_module: L.LightningModule, layout: Layout, topology: ExpertParallelTopology
    ) -> PECCheckpointer:
        """A PEC engine on this run's storage, with a process group of its own (the engine's, once there is one:
        creating a group is collective)."""
        storage = make_storage(self.config.storage.backend, self.config.storage.url)
        if self.engine is not None:
            group = self.engine.pec.process_group
        else:
            group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        pec = PECCheckpointer(
            self.config, layout, topology, storage, backend=self.config.storage.backend, process_group=group
        )
        pec.model_description = describe_model(pl_module)
        return pec

    def _check_counts(self) -> None:
        """Once PLT turns out unknown: refuse the options that need it, else warn once."""
        unknown = self.tokens.unknown
        if not unknown or self._said_unknown:
            return
        needs = [
            option for option, on in (
                ("checkpoint.dynamic_k.enabled=true", self.config.dynamic_k.enabled),
                ("checkpoint.selection=load_aware", self.config.selection == "load_aware"),
            ) if on
        ]
        if needs:
            raise ValueError(
                f"{' and '.join(needs)} need(s) router counts (Dynamic-K reacts to PLT, load-aware selection "
                f"ranks experts by tokens), but {unknown_message(unknown)}; or turn the option(s) off"
            )
        self._said_unknown = True
        rank_zero_warn(unknown_message(unknown))

    @property
    def plt_known(self) -> bool:
        """Whether PLT is measured: every MoE layer's router counts are known."""
        return self.tokens is not None and not self.tokens.unknown

    def restore(self) -> dict[str, Any]:
        """Two-level recovery, returned as the checkpoint dict Lightning restores loops and optimizers from.

        Collective: every rank plans from the same manifest and the slot inventories of all ranks. When no
        consistent state of this run survives, training starts over from step 0 in the same lineage (one line
        says why) instead of failing on every restart. Outside ``fit``: :meth:`_newest_weights`.
        """
        module = self._module
        if self._trainer.state.fn != TrainerFn.FITTING:
            return self._newest_weights(module)
        strategy = self._trainer.strategy
        if strategy.lightning_restore_optimizer or not self._trainer.optimizers:
            optimizer = _fresh_optimizer(module)
        else:  # ModelParallelStrategy restores optimizers itself, after their set-up: restore into the trainer's
            optimizer = self._trainer.optimizers[0]
        self._build_engine(module, optimizer)
        engine = self.engine
        manifest = agreed_manifest(engine.pec)
        fingerprint = lineage_fingerprint(engine.pec.layout)
        if manifest.lineage is None:
            return self._fresh_checkpoint(module, f"no MoC manifest under {self.config.storage.url}")
        Lineage(manifest.lineage.run_id, fingerprint).check_same_run(manifest.lineage, self.config.storage.url)
        if self.config.mode == "replay":
            return self._restore_window(module, optimizer, manifest)
        report = engine.recover(manifest)
        if report is None:
            return self._fresh_checkpoint(module, "no consistent state of this run survives in memory or storage")
        self.recovery = report if self.plt_known else dataclasses.replace(report, plt=None)
        self._write_recovery_report(self.recovery)
        checkpoint = dict(report.trainer_state or {})
        if report.trainer_state_rank not in (None, self.engine.rank):  # another rank's stands in for a lost one
            checkpoint[trainer_state.RNG_KEY] = trainer_state.derived_rng_states(report.resume_step, self.engine.rank)
        return self._checkpoint_from(checkpoint, module, optimizer)

    def _checkpoint_from(
        self, checkpoint: dict[str, Any], module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The checkpoint dict Lightning restores from: a captured trainer state with the module's and the
        optimizer's tensors as they are now (MoC has put the recovered ones there) and the engine's state."""
        checkpoint["state_dict"] = module.state_dict()
        optimizer_state = optimizer.state_dict()
        saved = checkpoint.get("optimizer_states") or [{}]
        optimizer_state["param_groups"] = saved[0].get("param_groups", optimizer_state["param_groups"])
        checkpoint["optimizer_states"] = [optimizer_state]
        checkpoint.setdefault("callbacks", {})[self.state_key] = self.engine.pec.state_dict()
        return checkpoint

    def _restore_window(
        self, module: L.LightningModule, optimizer: torch.optim.Optimizer, manifest: Any
    ) -> dict[str, Any]:
        """``mode=replay``: resume at the end of the newest window every rank has in shared memory or in storage
        (:meth:`WindowStore.restore`, which re-stores it where only memory held it). Its trainer state goes to
        Lightning now; the model and optimizer reach that step by the replay in :meth:`complete_restore`, which
        Lightning's restore calls once the strategy and optimizers are set up. Until then the engine refuses every
        snapshot and persist (:class:`~moc_lightning.engine.completeness.RestoreGuard`)."""
        engine = self.engine
        found = self.windows.restore(manifest.lineage)
        log = found.log if found is not None else None
        engine.store.clear()  # PEC's slots play no part in replay mode
        resumed = manifest.lineage.resumed_at(log.end_step if log is not None else 0)
        engine.pec.persister.commit_lineage(manifest.with_lineage(resumed))
        engine.lineage = resumed
        engine.pec.selector.base_on(manifest)
        if log is None:  # a fresh start within the lineage, as a PEC recovery that finds nothing
            return self._fresh_checkpoint(module, "no replay window of this run that every rank completed")
        self._to_replay = found
        engine.completeness.begin(f"the replay of the window from step {log.start_step} to step {log.end_step}")
        return self._checkpoint_from(dict(log.trainer_state), module, optimizer)

    def _newest_weights(self, module: L.LightningModule) -> dict[str, Any]:
        """What ``validate``/``test``/``predict`` with the storage URL restore: the newest committed weights,
        loaded by an engine of their own (:func:`load_newest`); the training engine and the lineage stay as they are."""
        check_supported(dict(module.named_parameters()), type(module).__name__)
        topology = getattr(module, "expert_topology", None) or ExpertParallelTopology.replicated()
        layout = build_layout(
            module, None, preset=self.layout_preset, expert_parallel=topology.ep,
            expert_buffers=self.config.expert_buffers,
        )
        step = load_newest(self._new_pec(module, layout, topology), self._trainer.state.fn.value)
        return {"pytorch-lightning_version": L.__version__, "global_step": step, "state_dict": module.state_dict()}

    def _fresh_checkpoint(self, module: L.LightningModule, why: str) -> dict[str, Any]:
        """What Lightning restores when there is nothing to resume: the module as it is, fresh everything else."""
        if self.engine.lineage is None:
            self.engine.lineage = begin_lineage(self.engine.pec, lineage_fingerprint(self.engine.pec.layout), why)
            self.engine.store.clear()
        self.recovery = None
        self._fresh_start = True
        if self.engine.rank == 0:
            print(f"[moc_lightning] nothing to resume ({why}); training starts from step 0 "
                  f"in lineage {self.engine.lineage.run_id}")
        return {
            "pytorch-lightning_version": L.__version__,
            "epoch": 0,
            "global_step": 0,
            "state_dict": module.state_dict(),
            "optimizer_states": [],
            "lr_schedulers": [],
        }

    def _write_report(self, report: dict[str, Any]) -> None:
        """``<default_root_dir>/moc_recovery/rank<r>.json``: what this rank's resume did (fault drills read it)."""
        directory = Path(self._trainer.default_root_dir) / "moc_recovery"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{self.engine.rank}.json").write_text(json.dumps(report, indent=1))

    def _write_recovery_report(self, report: RecoveryReport) -> None:
        self._write_report(report.to_json())
        if self.engine.rank == 0:
            levels: dict[str, int] = {}
            for source in report.sources.values():
                levels[source["level"]] = levels.get(source["level"], 0) + 1
            plt, accumulated = (
                (f"{report.plt:.4%}", f"{self.engine.pec.ledger.accumulated_plt:.4%}")
                if report.plt is not None else ("unknown (no router counts)", "unknown")
            )
            print(
                f"[moc_lightning] recovered to step {report.resume_step} in {report.recover_seconds:.2f}s: "
                f"units by source {levels}, PLT of this fault {plt}, accumulated PLT {accumulated}, "
                f"K now {self.engine.pec.dynamic_k.k_snapshot}/{self.engine.pec.dynamic_k.k_persist}"
            )

    # ------------------------------------------------------------- training
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.capture = self._probe = None
        if self.config.mode == "replay":
            check_trainer(trainer, pl_module)
            if self.config.replay.window == AUTO:
                self._probe = WindowProbe()
        self._build_engine(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        if self.config.mode == "replay" and self.config.replay.window != AUTO:
            self.capture = self._window_capture(self.config.replay.window)
        self._slots_sized = False
        self._persists_logged = 0

    def _begin_lineage_unless_resumed(self, trainer: L.Trainer) -> None:
        """A fit that did not resume through MoC begins its own lineage. Decided when training starts: a strategy that
        restores after its set-up (``ModelParallelStrategy``) resumes after ``on_fit_start``, not before it."""
        if self.engine.lineage is None:
            reason = (
                "checkpoint.resume=never" if self.config.resume == "never"
                else "fit was not given ckpt_path=moc.resume_target()"
            )
            self.engine.lineage = begin_lineage(self.engine.pec, lineage_fingerprint(self.engine.pec.layout), reason)
            self.engine.store.clear()
        self._last_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.capture is not None:
            self.capture.begin(trainer.global_step, batch, batch_idx)
        elif self._probe is not None:
            self._probe.begin()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self.engine
        counts = self.tokens.take()
        if counts is None:
            self._check_counts()  # a router whose output turned out unreadable
        else:
            engine.pec.record_tokens(counts)
        step = trainer.global_step
        if not self._slots_sized and self.capture is None:  # replay mode's windows are sized apart (replay_memory)
            engine.reserve_slots()  # the first optimizer step has created the optimizer state by now
            self._slots_sized = True
        snapshot_due = (
            self.config.mode == "pec" and step != self._last_step and step % self.config.every_n_train_steps == 0
        )
        if snapshot_due or 0 < trainer.max_steps <= step or trainer.should_stop:
            self._step_state = trainer_state.capture(trainer, self.state_key)
        if snapshot_due:
            self._last_step = step
            engine.snapshot(step, self._step_state, may_persist=not self._final(trainer))
        if self.capture is not None and (window := self.capture.end(trainer, engine.pec.layout, self.state_key)):
            self.windows.hand_over(window, engine.lineage, self.capture.pending)
        if self._probe is not None and self._probe.end():
            self._choose_window(trainer)
        engine.poll_persist()
        self._log_persists(trainer)
        engine.faults.at("train", step)

    def _choose_window(self, trainer: L.Trainer) -> None:
        """``replay.window=auto``: choose W from the timed iterations (the coordinator's choice, for every rank), log
        it with its inputs once, and capture windows of it from the next window boundary on."""
        probe, self._probe = self._probe, None
        layout = self.engine.pec.layout
        choice = self.window_choice = from_coordinator(lambda: probe.choose(layout), self.engine.pec.process_group)
        rank = self.engine.rank
        self._check_window_memory(layout, choice.window, rank, self._slot_root(rank).parent)
        self.capture = self._window_capture(choice.window)
        _log_now(trainer, choice.metrics())
        if self.engine.rank == 0:
            print(f"[moc_lightning] {choice.describe()}")

    def _window_capture(self, window: int) -> WindowCapture:
        """Captures of windows of ``window`` iterations into this rank's slots, allocated now rather than at the first
        captures (:meth:`WindowSlot.reserve`)."""
        self.windows.reserve(self.window_memory.window_bytes)
        behind = spare_core()
        if self.engine.rank == 0:
            print("[moc_lightning] replay captures copy weights and optimizer state "
                  + ("behind the next forward and backward, on a copy thread" if behind else
                     "on the training thread (no core is left free for a copy thread: background.spare_core)"))
        return WindowCapture(window, self.windows.open_slot, behind)

    def _check_window_memory(self, layout: Layout, window: int, rank: int, node_root: Path) -> None:
        """``mode=replay``: report the windows' host memory and refuse a shared-memory root that cannot hold them,
        before the first capture (before training, or once ``replay.window=auto`` has chosen W)."""
        self.window_memory = window_memory(layout, window)
        if rank == 0:
            print(f"[moc_lightning] {self.window_memory.describe()}")
        check_window_memory(self.config, self.window_memory, node_root)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.capture is not None:
            self.capture.join()  # the step changes what the last capture copies
        engine = self.engine
        had_snapshot = engine.stats.snapshots
        engine.wait_snapshot()
        if engine.stats.snapshots > had_snapshot:
            stats = engine.stats
            metrics = {
                "moc/stall_ms": stats.stall_seconds[-1] * 1000,
                "moc/copy_ms": stats.copy_seconds[-1] * 1000,
                "moc/snapshot_ms": stats.snapshot_seconds[-1] * 1000,
                "moc/snapshot_bytes": float(stats.snapshot_bytes[-1]),
                "moc/k_snapshot": float(engine.pec.dynamic_k.k_snapshot),
                "moc/k_persist": float(engine.pec.dynamic_k.k_persist),
                "moc/skipped_persists": float(stats.skipped_persists),
                "moc/failed_persists": float(stats.failed_persists),
            }
            if self.plt_known:  # an unknown PLT is not logged at all, rather than as 0
                metrics["moc/plt"] = engine.pec.ledger.accumulated_plt
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def _log_persists(self, trainer: L.Trainer) -> None:
        """Log each persist accounted since the last call, once, straight to the loggers (as Lightning's
        ``LearningRateMonitor`` does): a persist lands in the background at no step of its own, possibly
        after the last snapshot or after fit's loop has ended, where ``log_dict`` would drop it."""
        stats = self.engine.stats
        landed = [*stats.persist_reports, *([stats.final_persist] if stats.final_persist is not None else [])]
        for report in landed[self._persists_logged:]:
            metrics = {
                "moc/persist_step": float(report.step),
                "moc/persist_ms": report.seconds * 1000,
                "moc/persist_bytes": float(report.bytes_written),
            }
            _log_now(trainer, metrics)
        self._persists_logged = len(landed)

    def _final(self, trainer: L.Trainer) -> bool:
        """Whether this is the last step of ``max_steps``, which ``on_fit_end`` persists whole."""
        return self.config.persist_on_fit_end and 0 < trainer.max_steps <= trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.capture is not None:
            self.capture.join()
        if self.windows is not None:
            self.windows.flush()
        self.engine.finish()
        if self.config.persist_on_fit_end:
            report = self.engine.persist_final(trainer.global_step, self._last_step_state(trainer))
            if report is None and trainer.is_global_zero:
                print(f"[moc_lightning] step {trainer.global_step} was persisted already (with "
                      f"k_persist={self.engine.pec.dynamic_k.k_persist} experts per layer); no final full persist")
        self._log_persists(trainer)
        for logger in trainer.loggers:
            logger.save()  # fit's loop has finalized the loggers already
        if trainer.is_global_zero:
            print(self.summary())
        if self.config.remove_snapshots_on_fit_end:
            self._remove_snapshots()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.capture is not None:  # a fit that raised: no copy may outlive it into a slot the next fit reuses
            with contextlib.suppress(Exception):  # the fit's own error is what matters
                self.capture.join()
        if self.tokens is not None:
            self.tokens.close()
            self.tokens = None

    def _last_step_state(self, trainer: L.Trainer) -> dict[str, Any]:
        """The trainer state as of the end of the last step, as a snapshot there holds it. Captured now it
        would be wrong when fit stopped mid-epoch (``max_steps``, a stop request): Lightning has marked the
        epoch completed by then, so a resume would start the next epoch and skip the rest of this one."""
        state = self._step_state
        if state is not None and state["global_step"] == trainer.global_step:
            return state
        return trainer_state.capture(trainer, self.state_key)  # fit ended at an epoch's end: nothing skipped

    def _remove_snapshots(self) -> None:
        """A finished run's slots are of no further use (its last step is persisted): free the shared memory.

        Every rank removes its own slots, then (after all have) the node's folder of this run, which may hold
        slots of ranks an earlier world size had.
        """
        self.engine.store.remove()
        if dist.is_initialized():
            dist.barrier()
        node = self._slot_root(self.engine.rank).parent
        shutil.rmtree(node, ignore_errors=True)
        with contextlib.suppress(OSError):
            node.parent.rmdir()  # the run's folder, once no node of it is left on this machine

    def summary(self) -> str:
        """Where the checkpoints are, what was taken, bytes against eq. 5/6, and the mean stall."""
        stats, pec = self.engine.stats, self.engine.pec
        stall = sum(stats.stall_seconds) / max(1, len(stats.stall_seconds)) * 1000
        lines = [f"[moc_lightning] checkpoints: {self.config.storage.url} (snapshots under {self.config.shm_root})"]
        if self.windows is None:  # replay mode takes no PEC snapshot or persist
            lines.append(
                f"[moc_lightning] {stats.snapshots} snapshots, {stats.persists} persists "
                f"({stats.skipped_persists} skipped while one was in flight, {stats.failed_persists} failed), "
                f"mean stall {stall:.2f} ms per snapshot"
            )
        elif stalls := self.windows.stall_seconds:
            lines.append(
                f"[moc_lightning] {len(stalls)} replay windows handed over to shared memory and storage; hand-over "
                f"{sum(stalls) / len(stalls) * 1000:.2f} ms mean, {max(stalls) * 1000:.2f} ms at most on the training "
                "thread"
            )
        model = pec.size_model()
        if stats.persist_reports:
            report = stats.persist_reports[-1]
            lines.append(
                f"[moc_lightning] bytes per persist {report.expected_bytes / 1e6:.3f} MB; eq. 6 with "
                f"K={pec.dynamic_k.k_persist}: {model.c_pec(pec.dynamic_k.k_persist) / 1e6:.3f} MB; "
                f"eq. 5 (full): {model.c_full() / 1e6:.3f} MB"
            )
        if stats.final_persist is not None:
            lines.append(
                f"[moc_lightning] final persist of step {stats.final_persist.step}: every unit, "
                f"{stats.final_persist.expected_bytes / 1e6:.3f} MB (eq. 5: {model.c_full() / 1e6:.3f} MB)"
            )
        return "\n".join(lines)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self.engine.pec.state_dict() if self.engine else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_state = state_dict or None
        if self.engine is not None and state_dict:
            self.engine.pec.load_state_dict(state_dict)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._rng_to_restore = checkpoint.get(trainer_state.RNG_KEY)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """This rank's RNG streams as they were after the resume step, set just before the next step runs:
        Lightning's set-up after loading (the train loader's iterator, ...) would otherwise draw from them."""
        self._begin_lineage_unless_resumed(trainer)
        self.engine.completeness.check("training")
        if self._rng_to_restore is not None:
            _set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        if not self._warned_not_resumable:
            self._warned_not_resumable = True
            trainer_state.warn_if_not_resumable(trainer)

    def complete_restore(self, trainer: L.Trainer) -> None:
        """Finish a restore Lightning has loaded: ``mode=replay`` recomputes the restored window (:mod:`replay_driver`)
        here, inside Lightning's restore (after it loaded the loops, optimizers and schedulers, before the sanity check,
        the loop, any hook that follows the restore, or ``on_fit_end``'s final persist), so nothing observes the model
        at the window's start, even where the loop runs no batch (a resume at ``max_steps``, a stop requested before
        the first batch). Called by the hook :func:`_complete_restores_in_restore` installs; nothing to do otherwise."""
        if self._to_replay is not None:
            self._replay(trainer, trainer.lightning_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("validation")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("prediction")

    def _check_restored(self, what: str) -> None:
        """An evaluation of a model whose restore failed half-way (a fit that raised inside it) is refused."""
        if self.engine is not None:
            self.engine.completeness.check(what)

    def _replay(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        found, self._to_replay = self._to_replay, None
        report = self.replay_report = replay_window(
            trainer, pl_module, self.engine.pec.layout, found.log, found.source, found.nbytes, found.read_seconds
        )
        self.engine.completeness.complete()
        self._write_report({"mode": "replay", **dataclasses.asdict(report)})
        if self.tokens is not None:
            self.tokens.take()  # the replay's routing was counted in the faulty run already
        _log_now(trainer, {
            "moc/replay_iterations": float(report.replay_iterations), "moc/replay_seconds": report.replay_seconds,
            "moc/restore_seconds": report.restore_seconds, "moc/restore_bytes": float(report.restored_bytes),
            "moc/restore_from_memory": float(report.source == "memory"),
        })
        if self.engine.rank == 0:
            print(f"[moc_lightning] restored the window from step {report.window_start} "
                  f"({report.restored_bytes / 1e6:.1f} MB from {report.source}) in {report.restore_seconds:.3f}s and "
                  f"replayed {report.replay_iterations} iterations in {report.replay_seconds:.2f}s; every unit is at "
                  f"its fault-free state of step {report.resume_step} (PLT 0)")


def _log_now(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Hand ``metrics`` straight to the loggers at the current step: they describe events (a persist landing, a
    replay, a window choice) that happen outside ``training_step``, where ``self.log`` would not reach."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def check_shm_root(config: CheckpointConfig, pec: PECCheckpointer, node_root: Path) -> None:
    """Fail before training when the shared-memory root is missing or cannot hold this node's slots.

    Every rank of the node keeps ``NUM_SLOTS`` slots there, each sized by
    :meth:`PECCheckpointer.snapshot_share_bytes` (with the optimizer state a step creates, when the
    optimizer has none yet), one of them for every expert with ``complete_first_persist`` (the slot of the
    complete first snapshot keeps its size). Slots this run already has on the node (``node_root``, every
    local rank's, from before a restart) are reused, so they count as free: a restart of a job that fitted fits.
    """
    per_slot = pec.snapshot_share_bytes(with_optimizer_state=True)
    complete = config.complete_first_persist
    first_slot = pec.snapshot_share_bytes(with_optimizer_state=True, complete=True) if complete else per_slot
    local_ranks = _local_ranks(config)
    needed = int(((NUM_SLOTS - 1) * per_slot + first_slot) * local_ranks)
    free = _shm_free(config, node_root)
    if free < needed:
        first = f", one of them {first_slot / 1e6:.1f} MB for the complete first snapshot" if complete else ""
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} has {free / 1e6:.1f} MB free, but the snapshot slots need "
            f"about {needed / 1e6:.1f} MB ({NUM_SLOTS} slots x {local_ranks} ranks x {per_slot / 1e6:.1f} MB at "
            f"k_snapshot={pec.dynamic_k.k_snapshot}{first}); use a larger tmpfs, a smaller checkpoint.k_snapshot"
            + (", or checkpoint.complete_first_persist=false" if complete else "")
        )


def check_window_memory(config: CheckpointConfig, memory: WindowMemory, node_root: Path) -> None:
    """``mode=replay``: fail before training when the shared-memory root cannot hold the window copies of this
    node's ranks (:mod:`moc_lightning.replay.memory`), counted as :func:`check_shm_root` counts PEC's slots."""
    local_ranks = _local_ranks(config)
    needed = memory.in_shared_memory * local_ranks
    free = _shm_free(config, node_root)
    if free < needed:
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} has {free / 1e6:.1f} MB free, but the replay windows need about "
            f"{needed / 1e6:.1f} MB ({memory.slots} window slots x {local_ranks} ranks x "
            f"{memory.window_bytes / 1e6:.1f} MB a window at checkpoint.replay.window={memory.window}, up to "
            f"{max(memory.per_iteration) / 1e6:.1f} MB per iteration); use a larger tmpfs, a smaller "
            "checkpoint.replay.window (a window holds every unit's full state once plus the weights of the units "
            "still frozen), or checkpoint.mode=pec"
        )


def _local_ranks(config: CheckpointConfig) -> int:
    """Ranks sharing this node's shared-memory root."""
    return config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _shm_free(config: CheckpointConfig, node_root: Path) -> int:
    """Bytes available under the shared-memory root, counting this run's existing slots on the node as free (they
    are reused: a restart of a job that fitted fits); refuses a root that cannot be created."""
    root = Path(config.shm_root)
    if not root.parent.is_dir():
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} cannot be created: {root.parent} does not exist; "
            "point it at a node-local tmpfs such as /dev/shm/moc_lightning"
        )
    return shutil.disk_usage(root if root.exists() else root.parent).free + _already_used(node_root)


def _already_used(node_root: Path) -> int:
    """Bytes this run's existing slots and replay windows on this node occupy (they are reused, so they count as
    available)."""
    if not node_root.exists():
        return 0
    return sum(p.stat().st_size for p in node_root.rglob("*") if p.name == "data" or p.name.endswith(WINDOW_SUFFIX))


class _MoCCheckpointIO(CheckpointIO):
    """Routes ``ckpt_path=<MoC storage URL>`` to two-level recovery; everything else to the usual IO."""

    def __init__(self, delegate: CheckpointIO, callback: MoCCheckpoint) -> None:
        self.delegate = delegate
        self.callback = callback

    def is_moc(self, path: Any) -> bool:
        """Whether ``path`` (fit's ``ckpt_path``) names the MoC storage URL, i.e. asks to resume through MoC."""
        url = self.callback.config.storage.url
        return path is not None and str(path) in (url, url.removeprefix("file://"))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if self.is_moc(path):
            return self.callback.restore()
        return self.delegate.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.delegate.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.delegate.remove_checkpoint(path)

    def teardown(self) -> None:
        self.delegate.teardown()


def _route_strategy_loads(strategy: Strategy) -> None:
    """Route a MoC ``ckpt_path`` of a strategy that reads checkpoints itself, not through its ``CheckpointIO``
    (``ModelParallelStrategy`` loads a DCP directory into the model and optimizers), to :meth:`MoCCheckpoint.restore`.
    Such a strategy loads no model or optimizer state from the returned dict: recovery restored the tensors in place,
    and the param groups' hyperparameters (the learning rate a schedule reached) are set here, as
    ``optimizer.load_state_dict`` would set them."""
    if getattr(strategy, "_moc_routed", False):
        return
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        io = strategy.checkpoint_io
        if isinstance(io, _MoCCheckpointIO) and io.is_moc(checkpoint_path):
            checkpoint = io.callback.restore()
            if not strategy.lightning_restore_optimizer:
                _restore_param_groups(strategy.optimizers, checkpoint.get("optimizer_states", []))
            return checkpoint
        return original(checkpoint_path, weights_only=weights_only)

    strategy.load_checkpoint = load_checkpoint
    strategy._moc_routed = True


def _complete_restores_in_restore(trainer: L.Trainer) -> None:
    """Make the end of Lightning's restore (``restore_training_state``: loops, optimizers, schedulers, after the
    strategy's set-up) call :meth:`MoCCheckpoint.complete_restore` of the Trainer's MoC callbacks. Lightning offers no
    hook there: ``on_train_start`` comes after the sanity check and not at all where the loop has nothing left to run,
    and ``on_fit_start`` comes before a strategy that restores after its set-up (``ModelParallelStrategy``) has
    restored. Installed once per Trainer; a Lightning without that method is refused, rather than resumed half-way."""
    connector = trainer._checkpoint_connector
    if getattr(connector, "_moc_completes", False):
        return
    original = getattr(connector, "restore_training_state", None)
    if original is None:
        raise RuntimeError(
            f"lightning {L.__version__} has no _CheckpointConnector.restore_training_state, where MoC completes a "
            "restore before training; install a lightning version the project supports (pyproject.toml)"
        )

    def restore_training_state() -> None:
        original()
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, MoCCheckpoint):
                callback.complete_restore(trainer)

    connector.restore_training_state = restore_training_state
    connector._moc_completes = True


def _restore_param_groups(optimizers: Sequence[torch.optim.Optimizer], saved: Sequence[dict[str, Any]]) -> None:
    """Each param group's hyperparameters (``lr``, ``betas``, ``weight_decay``, a scheduler's ``initial_lr``) as
    ``saved`` (a checkpoint's ``optimizer_states``) has them; its parameters and their state stay as they are."""
    for optimizer, state in zip(optimizers, saved):
        for group, saved_group in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({key: value for key, value in saved_group.items() if key != "params"})


def _last_through_moc(trainer: L.Trainer) -> str | None:
    """What ``ckpt_path="last"`` means with MoC the Trainer's only checkpoint callback: ``moc.resume_target()``
    (the storage URL once MoC has a manifest there). ``None`` (beside another checkpoint callback, or nothing to
    resume) leaves ``"last"`` to Lightning."""
    callbacks = trainer.checkpoint_callbacks
    if len(callbacks) != 1 or not isinstance(callbacks[0], MoCCheckpoint):
        return None
    return callbacks[0].resume_target(trainer.default_root_dir)


def _fresh_optimizer(module: L.LightningModule) -> torch.optim.Optimizer:
    """An optimizer shaped like the module's, to receive the restored state for Lightning to load."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        if isinstance(configured, (list, tuple)):
            configured = configured[0]
    return configured

