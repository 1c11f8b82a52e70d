"""A fault drill's job: 4 ranks, EP=2, 2 simulated nodes of 2 ranks, under torch's elastic agent with one restart
(``--ranks`` and ``--accelerator gpu``: one rank per GPU over NCCL, EP and ranks per node up to 2).

Besides training with ``MoCCheckpoint`` each rank records, independently of MoC, what a test needs to check a
recovery: every rank's full state (weights and optimizer) at each snapshot step, the global router counts
of every step, and the state right after a resume.

``python tests/drill_worker.py --out DIR ...`` is ``torchrun --standalone --nproc-per-node=4 --max-restarts=1`` of
the training, through the same agent, with ranks forked from a preloaded server (:func:`moc_lightning.runtime.launch.standalone`):
the 8 processes of a drill would otherwise spend most of its time importing. ``recipes/fault_drill.py`` runs the
drills under ``torchrun``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning_run import DrainPersists

from moc_lightning.config import CheckpointConfig, DynamicKConfig, ReplayConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.layout import build_layout
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.runtime.launch import standalone

MODEL = GPTMoEConfig(block_size=32)
RANKS = 4


class Capture(L.Callback):
    """Writes what the test compares against, under ``<out>/capture``."""

    def __init__(self, out: Path, every: int) -> None:
        self.out = out / "capture"
        self.every = every
        self.counts: dict[int, list[list[int]]] = {}
        self.assigned: dict[int, list[int]] = {}
        self._saw_start = False

    def _layout_tensors(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
        layout = build_layout(module, trainer.optimizers[0], num_experts=MODEL.num_experts)
        return {k: v.detach().clone() for k, v in layout.pieces(layout.units).items()}  # fsdp2: this rank's pieces

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        """The restored state, before the first step after a resume (``mode=replay`` has replayed its window inside
        Lightning's restore by then, as by ``on_train_start``)."""
        if trainer.global_step > 0 and not self._saw_start:
            torch.save(
                {"step": trainer.global_step, "tensors": self._layout_tensors(trainer, module)},
                self.out / f"restored_rank{trainer.global_rank}.pt",
            )
        self._saw_start = True

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        counts, assigned = [], []
        for layer in module.moe_layers():
            c = layer.tokens_per_expert.to(module.device, copy=True)  # NCCL reduces device tensors only
            a = torch.tensor([layer.tokens_assigned], device=module.device)
            dist.all_reduce(c)
            dist.all_reduce(a)
            counts.append(c.tolist())
            assigned.append(int(a))
        self.counts[step], self.assigned[step] = counts, assigned
        if step % self.every == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            torch.save(
                {"tensors": self._layout_tensors(trainer, module), "counts": self.counts, "assigned": self.assigned},
                self.out / f"inc{restart}_rank{trainer.global_rank}_step{step}.pt",
            )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--persist-every", type=int, default=2)
    parser.add_argument("--k-snapshot", type=int, default=4)
    parser.add_argument("--k-persist", type=int, default=1)
    parser.add_argument("--data-parallel", default="ddp")
    parser.add_argument("--pec-scope", default="both")
    parser.add_argument("--mode", default="pec", help="checkpoint.mode")
    parser.add_argument("--window", type=int, default=5, help="checkpoint.replay.window (with --mode replay)")
    parser.add_argument("--drain-persists", action="store_true", help="wait for every persist: none skipped")
    parser.add_argument("--ranks", type=int, default=RANKS, help="processes (one GPU each with --accelerator gpu)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="gpu: NCCL, one GPU per rank")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    """One rank of one incarnation: fit with MoC (resuming what it finds) and the independent capture."""
    torch.set_num_threads(1)
    config = CheckpointConfig(
        mode=args.mode,
        replay=ReplayConfig(window=args.window),
        k_snapshot=args.k_snapshot,
        k_persist=args.k_persist,
        pec_scope=args.pec_scope,
        every_n_train_steps=args.every,
        persist_every_n_snapshots=args.persist_every,
        storage=StorageConfig(url=(args.out / "ckpt").resolve().as_uri()),
        shm_root=str(args.out / "shm"),
        ranks_per_node=min(2, args.ranks),
        retention=10,
        dynamic_k=DynamicKConfig(enabled=False),
    )
    moc = MoCCheckpoint(config)
    shard_size = 2 if args.data_parallel == "hsdp" else None  # a node's ranks; the nodes replicate each other
    module = GPTMoEModule(
        MODEL, ep=min(2, args.ranks), seed=0, data_parallel=args.data_parallel, hsdp_shard_size=shard_size
    )
    data = LMDataModule(DataConfig(batch_size=4), block_size=MODEL.block_size, vocab_size=MODEL.vocab_size)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.ranks,
        strategy=(
            ModelParallelStrategy(data_parallel_size=args.ranks, tensor_parallel_size=1)
            if args.data_parallel in ("fsdp2", "hsdp")
            else DDPStrategy(process_group_backend="nccl" if args.accelerator == "gpu" else "gloo")
        ),
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out / "run"),
        callbacks=[moc, Capture(args.out, args.every), *([DrainPersists()] * args.drain_persists)],
    )
    trainer.fit(module, datamodule=data, ckpt_path=moc.resume_target())


if __name__ == "__main__":
    arguments = parse()
    standalone(train, (arguments,), arguments.ranks, max_restarts=1)
