"""``MoCCheckpoint``: the Lightning glue. It decides *when*; the engines decide *how*.

Add it to a Trainer and resume through Lightning's usual door::

    moc = MoCCheckpoint(CheckpointConfig(k_snapshot=4, k_persist=1, storage=StorageConfig(url="file:///ckpt")))
    trainer = L.Trainer(callbacks=[moc], ...)
    trainer.fit(model, ckpt_path=moc.resume_target())   # None on a fresh start

Every ``every_n_train_steps`` steps the train-batch end takes an in-memory snapshot (host tensors are copied
there and then; GPU tensors on a side stream while the next forward/backward runs) and a background thread
commits it; the next optimizer step waits only for what is not done. Every ``persist_every_n_snapshots``
snapshots one is persisted to storage in the background, and when ``fit`` ends every unit is persisted.
``ckpt_path`` equal to the storage URL makes Lightning restore through a two-level recovery: units from
surviving snapshots (this rank's or a peer's) or storage, and the rest of the training state from what this
rank captured with the resume step (:mod:`moc_lightning.trainer_state`: loops and the train loader's
position, optimizer hyperparameters, schedulers, precision plugin, datamodule, other callbacks, what the
module and callbacks add in ``on_save_checkpoint``, and this rank's RNG, set just before the next step).

The LightningModule tells the callback about its experts through two optional members: ``moe_layers()``
(MoE layers whose routers report ``tokens_per_expert``/``tokens_assigned``; without it PLT is not measured)
and ``expert_topology`` (an :class:`ExpertParallelTopology`; without it every rank holds every expert).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.callbacks import Checkpoint

from moc_lightning import trainer_state
from moc_lightning.checkpointer import MANIFEST, PECCheckpointer
from moc_lightning.config import CheckpointConfig
from moc_lightning.faults import FaultInjector, FaultPlan
from moc_lightning.layout import build_layout
from moc_lightning.models.parallel import ExpertParallelTopology
from moc_lightning.snapshot import NUM_SLOTS, SnapshotStore
from moc_lightning.storage import make_storage
from moc_lightning.two_level import RecoveryReport, TwoLevelCheckpointer, lose_node, node_root


class MoCCheckpoint(Checkpoint):
    """Partial Experts Checkpointing at two levels, with two-level recovery on resume."""

    def __init__(self, config: CheckpointConfig | None = None, layout_preset: str = "auto") -> None:
        super().__init__()
        self.config = config or CheckpointConfig()
        self.layout_preset = layout_preset
        self.engine: TwoLevelCheckpointer | None = None
        self.recovery: RecoveryReport | None = None
        self._trainer: L.Trainer | None = None
        self._module: L.LightningModule | None = None
        self._last_step = -1
        self._slots_sized = False
        self._restored_state: dict[str, Any] | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self._warned_not_resumable = False

    # ------------------------------------------------------------ resuming
    def resume_target(self, default_root_dir: str | Path | None = None) -> str | None:
        """The ``ckpt_path`` that resumes through MoC, or ``None`` when nothing was saved yet.

        Looks at the manifest in storage and at this node's snapshot slots (both survive a restart).
        """
        if self.config.resume == "never":
            return None
        self._default_url(default_root_dir)
        storage = make_storage(self.config.storage.backend, self.config.storage.url)
        rank = _env_rank()
        slots = self._slot_root(rank)
        has_slots = slots.exists() and any(slots.rglob("meta.json"))
        return self.config.storage.url if storage.get(MANIFEST) is not None or has_slots else None

    def _default_url(self, default_root_dir: str | Path | None) -> None:
        if not self.config.storage.url and default_root_dir is not None:
            self.config.storage.url = (Path(default_root_dir) / "checkpoints").resolve().as_uri()

    def _slot_root(self, rank: int) -> Path:
        run_id = hashlib.sha1(self.config.storage.url.encode()).hexdigest()[:12]
        return node_root(self.config.shm_root, run_id, rank, self.config.ranks_per_node) / f"rank{rank}"

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._default_url(trainer.default_root_dir)
        self._trainer, self._module = trainer, pl_module
        if not isinstance(trainer.strategy.checkpoint_io, _MoCCheckpointIO):
            trainer.strategy.checkpoint_io = _MoCCheckpointIO(trainer.strategy.checkpoint_io, self)

    def _build_engine(self, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer | None) -> None:
        """Create the engine once per process (the persist process group is collective to create)."""
        topology = getattr(pl_module, "expert_topology", None) or _replicated_topology()
        layout = build_layout(pl_module, optimizer, preset=self.layout_preset, num_experts=_num_experts(pl_module))
        if self.engine is not None:
            self.engine.pec.attach(layout)
            return
        storage = make_storage(self.config.storage.backend, self.config.storage.url)
        persist_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        pec = PECCheckpointer(
            self.config, layout, topology, storage, backend=self.config.storage.backend, process_group=persist_group
        )
        faults = FaultInjector(FaultPlan.from_env(), topology.rank)
        slot_root = self._slot_root(topology.rank)
        check_shm_root(self.config, pec, slot_root)
        if faults.lost_node and slot_root.parent == self._slot_root(faults.faulty_rank).parent:
            lose_node(slot_root.parent)
        if dist.is_initialized():
            dist.barrier()  # a lost node is gone before anyone takes inventory
        self.engine = TwoLevelCheckpointer(pec, SnapshotStore(slot_root), faults)
        if self._restored_state:
            pec.load_state_dict(self._restored_state)

    def restore(self) -> dict[str, Any]:
        """Two-level recovery, returned as the checkpoint dict Lightning restores loops and optimizers from."""
        module = self._module
        optimizer = _fresh_optimizer(module)
        self._build_engine(module, optimizer)
        report = self.engine.recover()
        if report is None:
            raise FileNotFoundError(
                f"nothing to resume from: no committed checkpoint under {self.config.storage.url} and no "
                "complete snapshot on any rank"
            )
        self.recovery = report
        self._write_recovery_report(report)
        checkpoint = dict(report.trainer_state or {})
        if report.trainer_state_rank not in (None, self.engine.rank):  # another rank's stands in for a lost one
            checkpoint[trainer_state.RNG_KEY] = trainer_state.derived_rng_states(report.resume_step, self.engine.rank)
        checkpoint["state_dict"] = module.state_dict()
        optimizer_state = optimizer.state_dict()
        saved = checkpoint.get("optimizer_states") or [{}]
        optimizer_state["param_groups"] = saved[0].get("param_groups", optimizer_state["param_groups"])
        checkpoint["optimizer_states"] = [optimizer_state]
        checkpoint.setdefault("callbacks", {})[self.state_key] = self.engine.pec.state_dict()
        return checkpoint

    def _write_recovery_report(self, report: RecoveryReport) -> None:
        rank = self.engine.rank
        directory = Path(self._trainer.default_root_dir) / "moc_recovery"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{rank}.json").write_text(json.dumps(report.to_json(), indent=1))
        if rank == 0:
            levels: dict[str, int] = {}
            for source in report.sources.values():
                levels[source["level"]] = levels.get(source["level"], 0) + 1
            print(
                f"[moc_lightning] recovered to step {report.resume_step} in {report.recover_seconds:.2f}s: "
                f"units by source {levels}, PLT of this fault {report.plt:.4%}, "
                f"accumulated PLT {self.engine.pec.ledger.accumulated_plt:.4%}, "
                f"K now {self.engine.pec.dynamic_k.k_snapshot}/{self.engine.pec.dynamic_k.k_persist}"
            )

    # ------------------------------------------------------------- training
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._build_engine(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        if self.recovery is None and self.config.resume == "never":
            self.engine.store.clear()
        self._last_step = trainer.global_step
        self._slots_sized = False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self.engine
        if hasattr(pl_module, "moe_layers"):
            engine.pec.record_tokens(pl_module.moe_layers())
        step = trainer.global_step
        if not self._slots_sized:
            engine.reserve_slots()  # the first optimizer step has created the optimizer state by now
            self._slots_sized = True
        if step != self._last_step and step % self.config.every_n_train_steps == 0:
            self._last_step = step
            engine.snapshot(step, trainer_state.capture(trainer, self.state_key), may_persist=not self._final(trainer))
        engine.faults.at("train", step)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
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
                "moc/plt": engine.pec.ledger.accumulated_plt,
                "moc/skipped_persists": float(stats.skipped_persists),
                "moc/failed_persists": float(stats.failed_persists),
            }
            if stats.persist_reports:
                metrics["moc/persist_ms"] = stats.persist_reports[-1].seconds * 1000
                metrics["moc/persist_bytes"] = float(stats.persist_reports[-1].bytes_written)
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def _final(self, trainer: L.Trainer) -> bool:
        """Whether this is the last step of ``max_steps``, which ``on_fit_end`` persists whole."""
        return self.config.persist_on_fit_end and 0 < trainer.max_steps <= trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.engine.finish()
        if self.config.persist_on_fit_end:
            report = self.engine.persist_final(trainer.global_step, trainer_state.capture(trainer, self.state_key))
            if report is None and trainer.is_global_zero:
                print(f"[moc_lightning] step {trainer.global_step} was persisted already (with "
                      f"k_persist={self.engine.pec.dynamic_k.k_persist} experts per layer); no final full persist")
        if trainer.is_global_zero:
            print(self.summary())

    def summary(self) -> str:
        """Where the checkpoints are, what was taken, bytes against eq. 5/6, and the mean stall."""
        stats, pec = self.engine.stats, self.engine.pec
        stall = sum(stats.stall_seconds) / max(1, len(stats.stall_seconds)) * 1000
        lines = [
            f"[moc_lightning] checkpoints: {self.config.storage.url} (snapshots under {self.config.shm_root})",
            f"[moc_lightning] {stats.snapshots} snapshots, {stats.persists} persists "
            f"({stats.skipped_persists} skipped while one was in flight, {stats.failed_persists} failed), "
            f"mean stall {stall:.2f} ms per snapshot",
        ]
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
        if self._rng_to_restore is not None:
            _set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        if not self._warned_not_resumable:
            self._warned_not_resumable = True
            trainer_state.warn_if_not_resumable(trainer)


def check_shm_root(config: CheckpointConfig, pec: PECCheckpointer, slot_root: Path) -> None:
    """Fail before training when the shared-memory root is missing or cannot hold this node's slots.

    Every rank of the node keeps ``NUM_SLOTS`` slots there, each sized by
    :meth:`PECCheckpointer.snapshot_share_bytes`.
    """
    root = Path(config.shm_root)
    if not root.parent.is_dir():
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} cannot be created: {root.parent} does not exist; "
            "point it at a node-local tmpfs such as /dev/shm/moc_lightning"
        )
    per_slot = pec.snapshot_share_bytes()
    local_ranks = config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    needed = int(NUM_SLOTS * per_slot * local_ranks)
    free = shutil.disk_usage(root if root.exists() else root.parent).free + _already_used(slot_root)
    if free < needed:
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} has {free / 1e6:.1f} MB free, but the snapshot slots need "
            f"about {needed / 1e6:.1f} MB ({NUM_SLOTS} slots x {local_ranks} ranks x {per_slot / 1e6:.1f} MB at "
            f"k_snapshot={pec.dynamic_k.k_snapshot}); use a larger tmpfs or a smaller checkpoint.k_snapshot"
        )


def _already_used(slot_root: Path) -> int:
    """Bytes this rank's existing slots occupy (they are reused, so they count as available)."""
    return sum(p.stat().st_size for p in slot_root.rglob("data")) if slot_root.exists() else 0


class _MoCCheckpointIO(CheckpointIO):
    """Routes ``ckpt_path=<MoC storage URL>`` to two-level recovery; everything else to the usual IO."""

    def __init__(self, delegate: CheckpointIO, callback: MoCCheckpoint) -> None:
        self.delegate = delegate
        self.callback = callback

    def _is_moc(self, path: Any) -> bool:
        url = self.callback.config.storage.url
        return str(path) in (url, url.removeprefix("file://"))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if self._is_moc(path):
            return self.callback.restore()
        return self.delegate.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.delegate.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.delegate.remove_checkpoint(path)

    def teardown(self) -> None:
        self.delegate.teardown()


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


def _replicated_topology() -> ExpertParallelTopology:
    if dist.is_available() and dist.is_initialized():
        return ExpertParallelTopology(world_size=dist.get_world_size(), rank=dist.get_rank(), ep=1)
    return ExpertParallelTopology()


def _env_rank() -> int:
    """This process's global rank before the process group exists (torchrun, SLURM, Lightning's launcher)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _num_experts(pl_module: L.LightningModule) -> int | None:
    layers = pl_module.moe_layers() if hasattr(pl_module, "moe_layers") else []
    return layers[0].num_experts if layers else None
