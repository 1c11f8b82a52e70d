"""``MoCCheckpoint``: the Lightning glue. It decides *when*; :class:`PECCheckpointer` decides *how*.

Add it to a Trainer::

    trainer = L.Trainer(callbacks=[MoCCheckpoint(CheckpointConfig(k_snapshot=2, k_persist=1))], ...)

The LightningModule tells the callback about its experts through two optional members: ``moe_layers()``
(the MoE layers whose routers report ``tokens_per_expert``/``tokens_assigned``; without it PLT is not
measured) and ``expert_topology`` (an :class:`ExpertParallelTopology`; without it every rank is assumed to
hold every expert). The reference :class:`GPTMoEModule` has both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint

from moc_lightning.checkpointer import PECCheckpointer, SaveReport
from moc_lightning.config import CheckpointConfig
from moc_lightning.layout import build_layout
from moc_lightning.models.parallel import ExpertParallelTopology
from moc_lightning.storage import make_storage


class MoCCheckpoint(Checkpoint):
    """Partial Experts Checkpointing every ``every_n_train_steps`` optimizer steps."""

    def __init__(self, config: CheckpointConfig | None = None, layout_preset: str = "auto") -> None:
        super().__init__()
        self.config = config or CheckpointConfig()
        self.layout_preset = layout_preset
        self.engine: PECCheckpointer | None = None
        self.reports: list[SaveReport] = []
        self._last_step = -1
        self._restored_state: dict[str, Any] | None = None

    @property
    def storage_url(self) -> str:
        return self.config.storage.url

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.config.storage.url:
            self.config.storage.url = (Path(trainer.default_root_dir) / "checkpoints").resolve().as_uri()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        topology = getattr(pl_module, "expert_topology", None) or _replicated_topology()
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        layout = build_layout(pl_module, optimizer, preset=self.layout_preset, num_experts=_num_experts(pl_module))
        storage = make_storage(self.config.storage.backend, self.config.storage.url)
        self.engine = PECCheckpointer(self.config, layout, topology, storage, backend=self.config.storage.backend)
        if self._restored_state is not None:
            self.engine.load_state_dict(self._restored_state)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if hasattr(pl_module, "moe_layers"):
            self.engine.record_tokens(pl_module.moe_layers())
        step = trainer.global_step
        if step == self._last_step or step % self.config.every_n_train_steps:
            return
        self._last_step = step
        report = self.engine.checkpoint(step)
        if report is None:
            return
        self.reports.append(report)
        pl_module.log_dict(
            {
                "moc/persist_ms": report.seconds * 1000,
                "moc/persist_bytes": float(report.bytes_written),
                "moc/k_persist": float(self.engine.dynamic_k.k_persist),
                "moc/k_snapshot": float(self.engine.dynamic_k.k_snapshot),
            },
            on_step=True,
            on_epoch=False,
        )

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.reports:
            mean_ms = sum(r.seconds for r in self.reports) / len(self.reports) * 1000
            print(
                f"[moc_lightning] checkpoints: {self.config.storage.url} ({self.engine.snapshots_taken} snapshots, "
                f"{len(self.reports)} persists, {self.reports[-1].expected_bytes / 1e6:.2f} MB per persist, "
                f"mean persist {mean_ms:.1f} ms)"
            )

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict() if self.engine else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_state = state_dict or None


def _replicated_topology() -> ExpertParallelTopology:
    if dist.is_available() and dist.is_initialized():
        return ExpertParallelTopology(world_size=dist.get_world_size(), rank=dist.get_rank(), ep=1)
    return ExpertParallelTopology()


def _num_experts(pl_module: L.LightningModule) -> int | None:
    layers = pl_module.moe_layers() if hasattr(pl_module, "moe_layers") else []
    return layers[0].num_experts if layers else None
