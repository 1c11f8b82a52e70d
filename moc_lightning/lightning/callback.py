"""``MoCCheckpoint``: the Lightning glue. It decides *when*; the engines decide *how*.

Add it to a Trainer and resume through Lightning's usual door::

    moc = MoCCheckpoint(CheckpointConfig(k_snapshot=4, k_persist=1, storage=StorageConfig(url="file:///ckpt")))
    trainer = L.Trainer(callbacks=[moc], ...)
    trainer.fit(model, ckpt_path=moc.resume_target())   # None on a fresh start

Every ``every_n_train_steps`` steps the train-batch end takes an in-memory snapshot (persistent buffers are
copied there and then; weights and optimizer state by a background thread, from host memory or on a side CUDA
stream, while the next forward/backward runs) and that thread commits it; the next optimizer step
(``on_before_optimizer_step``) waits only for what is not done; the batch end before a snapshot step starts the
ranks' vote on whether its persist may start, read at the snapshot without waiting
(:mod:`~moc_lightning.memory.persist_vote`). Every ``persist_every_n_snapshots``
snapshots one is persisted to storage in the background (a lineage's first one with every unit, see
``complete_first_persist``), and when ``fit`` ends every unit is persisted.
``ckpt_path`` equal to the storage URL makes Lightning restore through a two-level recovery: units from
surviving snapshots (this rank's or a peer's) or storage, and the rest of the training state from what this
rank captured with the resume step (:mod:`moc_lightning.engine.trainer_state`: loops and the train loader's
position, optimizer hyperparameters, schedulers, precision plugin, datamodule, other callbacks, what the
module and callbacks add in ``on_save_checkpoint``, and this rank's RNG, set just before the next step).

Router counts for PLT come from the LightningModule's ``moe_layers()`` when it has one (objects reporting
``tokens_per_expert``/``tokens_assigned``), else from forward hooks on each MoE layer or its router
(:mod:`moc_lightning.lightning.tokens`); where neither exists PLT is unknown, one warning says so, and options that
need it (Dynamic-K, load-aware selection) are refused. ``expert_topology`` (an
:class:`ExpertParallelTopology`) is the other optional member; without it every rank holds every expert.
How it stands beside ``enable_checkpointing`` and a ``ModelCheckpoint``: :mod:`moc_lightning.lightning.coexistence`.

The callback is glue: its hooks decide *when*, and the modules beside it *how*: building the engines
(:mod:`~moc_lightning.lightning.engines`, :mod:`~moc_lightning.lightning.shared_memory`), routing Lightning's loads
(:mod:`~moc_lightning.lightning.loads`) to a restore (:mod:`~moc_lightning.lightning.recovery`), replay mode
(:mod:`~moc_lightning.lightning.replay_wiring`), router counts (:mod:`~moc_lightning.lightning.tokens`) and what is
logged and printed (:mod:`~moc_lightning.lightning.reporting`).

``ckpt_path`` outside ``fit`` (``validate``, ``test``, ``predict``), with MoC the Trainer's only checkpoint
callback: ``None`` with the model evaluates its current weights (after ``fit``, those it ended with, which
the final persist wrote); ``"last"`` (which is ``moc.resume_target()``) or the storage URL loads MoC's newest
committed checkpoint, read-only (:mod:`moc_lightning.lightning.evaluation`); ``"best"``, which Lightning also takes
for a call without a model, is refused: MoC monitors no metric. ``fit(ckpt_path="last")`` resumes through MoC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine import trainer_state
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.lineage import fingerprint as lineage_fingerprint
from moc_lightning.lightning.coexistence import allow_with_checkpointing_disabled, check_other_checkpoints, resolve_last
from moc_lightning.lightning.engines import (
    ensure_lineage,
    model_layout,
    model_topology,
    new_engine,
    new_pec,
    open_storage,
)
from moc_lightning.lightning.evaluation import newest_weights, no_best
from moc_lightning.lightning.loads import complete_restores_in_restore, moc_io, route_strategy_loads
from moc_lightning.lightning.recovery import checkpoint_from, fresh_checkpoint, restore_optimizer
from moc_lightning.lightning.replay_wiring import ReplayAttribute, ReplayWiring
from moc_lightning.lightning.reporting import (
    PersistLog,
    fit_summary,
    log_now,
    report_recovery,
    report_replay,
    snapshot_metrics,
)
from moc_lightning.lightning.shared_memory import check_shm_root, remove_slots
from moc_lightning.lightning.start import agreed_manifest
from moc_lightning.lightning.tokens import TokenCounts
from moc_lightning.memory.two_level import RecoveryReport, TwoLevelCheckpointer
from moc_lightning.pec.stored import MANIFEST
from moc_lightning.replay.driver import ReplayReport, WindowCapture
from moc_lightning.replay.memory import WindowMemory
from moc_lightning.replay.window_choice import WindowChoice
from moc_lightning.replay.window_store import WindowStore
from moc_lightning.runtime.agreement import check_same
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
        self.counts = TokenCounts(self.config)
        """Each training step's router counts, which PLT is computed from (their source is set with the engine)."""
        self.replay = ReplayWiring(self.config)
        """``mode=replay``: window captures in training, and the replay of a resume."""
        self._trainer: L.Trainer | None = None
        self._module: L.LightningModule | None = None
        self._last_step = -1
        self._vote_step = -1
        """The snapshot step whose persist vote was started last (once, under gradient accumulation too)."""
        self._slots_sized = False
        self._restored_state: dict[str, Any] | None = None
        self._step_state: dict[str, Any] | None = None
        """The trainer state captured at the end of the latest step that needed it (a snapshot, the last step)."""
        self._rng_to_restore: dict[str, Any] | None = None
        self._warned_not_resumable = False
        self._persist_log = PersistLog()

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
        return self.config.storage.url if open_storage(self.config).get(MANIFEST) is not None else None

    @property
    def best_model_path(self) -> str:
        """Refused (:func:`~moc_lightning.lightning.evaluation.no_best`): Lightning reads it for
        ``ckpt_path="best"``, and MoC monitors no metric."""
        fn = self._trainer.state.fn if self._trainer is not None else None
        raise no_best(fn.value if fn is not None else None, self.config.storage.url)

    @property
    def plt_known(self) -> bool:
        """Whether PLT is measured: every MoE layer's router counts are known."""
        return self.counts.known

    def restore(self) -> dict[str, Any]:
        """Two-level recovery, returned as the checkpoint dict Lightning restores loops and optimizers from.

        Collective: every rank plans from the same manifest and the slot inventories of all ranks. When no
        consistent state of this run survives, training starts over from step 0 in the same lineage (one line
        says why) instead of failing on every restart. Outside ``fit``: the newest committed weights, read-only
        (:func:`~moc_lightning.lightning.evaluation.newest_weights`).
        """
        trainer, module = self._attached()
        fn = trainer.state.fn
        if fn is not None and fn != TrainerFn.FITTING:
            return newest_weights(module, self.config, self.layout_preset, self.engine, fn.value)
        optimizer = restore_optimizer(trainer, module)
        engine = self._build_engine(module, optimizer)
        manifest = agreed_manifest(engine.pec)
        fingerprint = lineage_fingerprint(engine.pec.layout)
        if manifest.lineage is None:
            return self._fresh_checkpoint(engine, module, f"no MoC manifest under {self.config.storage.url}")
        Lineage(manifest.lineage.run_id, fingerprint).check_same_run(manifest.lineage, self.config.storage.url)
        if self.config.mode == "replay":
            state = self.replay.resume_point(engine, manifest)
            if state is None:
                return self._fresh_checkpoint(engine, module, "no replay window of this run that every rank completed")
            return checkpoint_from(dict(state), module, optimizer, self.state_key, engine)
        report = engine.recover(manifest)
        if report is None:
            why = "no consistent state of this run survives in memory or storage"
            return self._fresh_checkpoint(engine, module, why)
        self.recovery = report if self.plt_known else dataclasses.replace(report, plt=None)
        report_recovery(trainer, engine, self.recovery)
        checkpoint = dict(report.trainer_state or {})
        if report.trainer_state_rank not in (None, engine.rank):  # another rank's stands in for a lost one
            checkpoint[trainer_state.RNG_KEY] = trainer_state.derived_rng_states(report.resume_step, engine.rank)
        return checkpoint_from(checkpoint, module, optimizer, self.state_key, engine)

    def complete_restore(self, trainer: L.Trainer) -> None:
        """Finish a restore Lightning has loaded: ``mode=replay`` recomputes the restored window
        (:mod:`~moc_lightning.lightning.replay_wiring`) here, inside Lightning's restore (after it loaded the loops,
        optimizers and schedulers, before the sanity check, the loop, any hook that follows the restore, or
        ``on_fit_end``'s final persist), so nothing observes the model at the window's start, even where the loop runs
        no batch (a resume at ``max_steps``, a stop requested before the first batch). Called by the hook
        :func:`~moc_lightning.lightning.loads.complete_restores_in_restore` installs; nothing to do otherwise."""
        if self.replay.pending:
            engine = self._engine
            report_replay(trainer, engine.rank, self.replay.replay(trainer, engine))
            self.counts.discard()  # the replay's routing was counted in the faulty run already

    # ------------------------------------------------------ replay mode's state (``mode=replay``; ``None`` otherwise)
    capture = ReplayAttribute[WindowCapture | None]("capture", "This fit's window captures.")
    window_choice = ReplayAttribute[WindowChoice | None]("window_choice", "``window=auto``: W and what it came from.")
    windows = ReplayAttribute[WindowStore | None]("windows", "Where windows go and are found on resume.")
    replay_report = ReplayAttribute[ReplayReport | None]("report", "What the resume replayed (``None``: nothing).")
    window_memory = ReplayAttribute[WindowMemory | None]("memory", "The host memory of the windows, checked first.")

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._default_url(trainer.default_root_dir)
        self._trainer, self._module = trainer, pl_module
        io = moc_io(trainer.strategy, self)
        route_strategy_loads(trainer.strategy)
        complete_restores_in_restore(trainer, MoCCheckpoint)
        if stage == "fit":
            self.replay.check_setup(trainer, pl_module)
            resuming = io.is_moc(trainer.ckpt_path)
            if resuming and self.config.resume == "never":
                raise ValueError(
                    f"fit was given ckpt_path={trainer.ckpt_path!r}, the MoC storage URL, but checkpoint.resume=never; "
                    "pass ckpt_path=moc.resume_target() (None with resume=never) or set checkpoint.resume=auto"
                )
            check_same(resuming, "whether to resume through MoC (fit's ckpt_path is the MoC storage URL)")

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

    # ------------------------------------------------------------- training
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.replay.start_fit(trainer, pl_module)
        engine = self._build_engine(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        self.replay.begin_capture(engine.rank)
        self._slots_sized = False
        self._vote_step = -1
        self._persist_log = PersistLog()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit that did not resume through MoC begins its own lineage, decided now: a strategy that restores after
        its set-up (``ModelParallelStrategy``) resumes after ``on_fit_start``, not before it. Then this rank's RNG
        streams as they were after the resume step, set just before the next step runs: Lightning's set-up after
        loading (the train loader's iterator, ...) would otherwise draw from them."""
        engine = self._engine
        ensure_lineage(engine, "checkpoint.resume=never" if self.config.resume == "never"
                       else "fit was not given ckpt_path=moc.resume_target()")
        self._last_step = trainer.global_step
        engine.completeness.check("training", would="train from")
        if self._rng_to_restore is not None:
            # Lightning's private helper, the inverse of the _collect_rng_states trainer_state captures with: the
            # same format (CUDA, NumPy, Python streams) without a copy of its code here.
            _set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        if not self._warned_not_resumable:
            self._warned_not_resumable = True
            trainer_state.warn_if_not_resumable(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.replay.batch_start(trainer.global_step, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        counts = self.counts.take()
        if counts is not None:
            engine.pec.record_tokens(counts)
        step = trainer.global_step
        if not self._slots_sized and self.replay.capture is None:  # replay mode's windows are sized apart
            engine.reserve_slots()  # the first optimizer step has created the optimizer state by now
            self._slots_sized = True
        pec_mode, every = self.config.mode == "pec", self.config.every_n_train_steps
        snapshot_due = pec_mode and step != self._last_step and step % every == 0
        capture_seconds = 0.0
        if snapshot_due or 0 < trainer.max_steps <= step or trainer.should_stop:
            start = time.perf_counter()
            self._step_state = trainer_state.capture(trainer, self.state_key)
            capture_seconds = time.perf_counter() - start
        if snapshot_due:
            self._last_step = step
            engine.snapshot(step, self._step_state, not self._final(trainer), capture_seconds)
        self.replay.batch_end(trainer, engine, self.state_key)
        engine.poll_persist()
        if pec_mode and (step + 1) % every == 0 and self._vote_step != step + 1:
            # the next step takes a snapshot: its persist vote arrives during that step's forward and backward
            self._vote_step = step + 1
            engine.start_vote()
        self._persist_log.log_new(trainer, engine.stats)
        engine.faults.at("train", step)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.replay.join()  # the step changes what the last capture copies
        engine = self._engine
        had_snapshot = engine.stats.snapshots
        engine.wait_snapshot()
        if engine.stats.snapshots > had_snapshot:
            log_now(trainer, snapshot_metrics(engine, self.plt_known))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.replay.finish()
        engine = self._engine
        engine.finish()
        if self.config.persist_on_fit_end:
            report = engine.persist_final(trainer.global_step, self._last_step_state(trainer))
            if report is None and trainer.is_global_zero:
                print(f"[moc_lightning] step {trainer.global_step} was persisted already (with "
                      f"k_persist={engine.pec.dynamic_k.k_persist} experts per layer); no final full persist")
        self._persist_log.log_new(trainer, engine.stats)
        for logger in trainer.loggers:
            logger.save()  # fit's loop has finalized the loggers already
        if trainer.is_global_zero:
            print(self.summary())
        if self.config.remove_snapshots_on_fit_end:
            remove_slots(self.config, engine.store, engine.rank)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # A fit that raised: no copy may outlive it into a slot the next fit reuses; its own error is what matters.
        with contextlib.suppress(Exception):
            self.replay.join()
        self.counts.close()

    def summary(self) -> str:
        """Where the checkpoints are, what was taken, bytes against eq. 5/6, and the mean stall."""
        return fit_summary(self.config, self._engine, self.replay.windows)

    # ------------------------------------------------------------ evaluating
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("validation")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_restored("prediction")

    # --------------------------------------------------------------- private
    @property
    def _engine(self) -> TwoLevelCheckpointer:
        """The engine, in a hook that runs once it is built (by ``restore`` or ``on_fit_start``)."""
        if self.engine is None:
            raise RuntimeError("MoCCheckpoint's engine is built when a fit starts; this hook ran before that")
        return self.engine

    def _attached(self) -> tuple[L.Trainer, L.LightningModule]:
        """The Trainer and module of the latest ``setup``, which every restore and engine build follows."""
        if self._trainer is None or self._module is None:
            raise RuntimeError("MoCCheckpoint acts only once a Trainer has set it up (fit, validate, test or predict)")
        return self._trainer, self._module

    def _default_url(self, default_root_dir: str | Path | None) -> None:
        if not self.config.storage.url and default_root_dir is not None:
            self.config.storage.url = (Path(default_root_dir) / "checkpoints").resolve().as_uri()

    def _build_engine(
        self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer | None
    ) -> TwoLevelCheckpointer:
        """Create the engine once per process (the persist process group is collective to create); a later call
        attaches the layout with ``optimizer``'s state to it."""
        topology = model_topology(pl_module)
        check_other_checkpoints(self._attached()[0], self, topology.ep, local_path(self.config.storage.url))
        layout = model_layout(pl_module, optimizer, topology, self.config, self.layout_preset)
        self.counts.attach(pl_module, layout)
        if self.engine is not None:
            self.engine.pec.attach(layout)
            return self.engine
        pec = new_pec(self.config, pl_module, layout, topology, None)

        def check_node(node_root: Path) -> None:
            if self.config.mode == "pec":
                check_shm_root(self.config, pec, node_root)
            self.replay.check_node(layout, topology.rank, node_root)

        engine = self.engine = new_engine(self.config, pec, pl_module.device, check_node)
        self.replay.open_windows(pec.storage, engine.store.root, topology.rank)
        if self._restored_state:
            pec.load_state_dict(self._restored_state)
        return engine

    def _fresh_checkpoint(self, engine: TwoLevelCheckpointer, module: L.LightningModule, why: str) -> dict[str, Any]:
        """Nothing to resume (``why``): no recovery, and a fresh start (:func:`fresh_checkpoint`)."""
        checkpoint = fresh_checkpoint(engine, module, why)
        self.recovery = None
        return checkpoint

    def _check_restored(self, what: str) -> None:
        """An evaluation of a model whose restore failed half-way (a fit that raised inside it) is refused."""
        if self.engine is not None:
            self.engine.completeness.check(what, would="evaluate")

    def _final(self, trainer: L.Trainer) -> bool:
        """Whether this is the last step of ``max_steps``, which ``on_fit_end`` persists whole."""
        return self.config.persist_on_fit_end and 0 < trainer.max_steps <= trainer.global_step

    def _last_step_state(self, trainer: L.Trainer) -> dict[str, Any]:
        """The trainer state as of the end of the last step, as a snapshot there holds it. Captured now it
        would be wrong when fit stopped mid-epoch (``max_steps``, a stop request): Lightning has marked the
        epoch completed by then, so a resume would start the next epoch and skip the rest of this one."""
        state = self._step_state
        if state is not None and state["global_step"] == trainer.global_step:
            return state
        return trainer_state.capture(trainer, self.state_key)  # fit ended at an epoch's end: nothing skipped


def _last_through_moc(trainer: L.Trainer) -> str | None:
    """What ``ckpt_path="last"`` means with MoC the Trainer's only checkpoint callback: ``moc.resume_target()``
    (the storage URL once MoC has a manifest there). ``None`` (beside another checkpoint callback, or nothing to
    resume) leaves ``"last"`` to Lightning."""
    callbacks = trainer.checkpoint_callbacks
    if len(callbacks) != 1 or not isinstance(callbacks[0], MoCCheckpoint):
        return None
    return callbacks[0].resume_target(trainer.default_root_dir)
