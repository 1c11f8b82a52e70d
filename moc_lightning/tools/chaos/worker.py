"""One incarnation of a chaos trial's job on 4 ranks (CPU, gloo), as ``torchrun --standalone`` would run it:

    python -m moc_lightning.tools.chaos.worker --work DIR --max-steps 24

(:func:`moc_lightning.runtime.launch.standalone`: torch's elastic agent, ranks forked from a preloaded server.)

The tiny reference GPT-MoE (block size 32, batch 4, EP=2: 4 ranks as 2 simulated nodes of 2) trains with
``MoCCheckpoint`` and the :class:`~moc_lightning.tools.chaos.oracle.Oracle`, resuming through MoC whenever
``resume_target()`` says so; with ``--mode replay`` MoC captures windows of ``--window`` iterations, stores every
``--persist-windows``-th, and an :class:`~moc_lightning.tools.chaos.oracle.AfterRestore` records the state after its
replay. The process-group timeout is short, so a collective that never completes ends
the incarnation with an error instead of hanging it. Faults come from ``MOC_FAULT`` (see
:mod:`moc_lightning.runtime.faults`) and fire in the incarnation ``MOC_INCARNATION`` names.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from moc_lightning.config import CheckpointConfig, ReplayConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import SHARDED_DATA_PARALLEL
from moc_lightning.runtime.launch import standalone
from moc_lightning.tools.chaos.harness import RANKS_PER_NODE, WORLD
from moc_lightning.tools.chaos.oracle import AfterRestore, Oracle

MODEL = GPTMoEConfig(block_size=32)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True, help="trial directory (storage, run dir, oracle)")
    parser.add_argument("--shm-root", required=True)
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--persist-every", type=int, default=2)
    parser.add_argument("--k-snapshot", type=int, default=2)
    parser.add_argument("--k-persist", type=int, default=1)
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout in seconds")
    parser.add_argument("--no-moc", action="store_true", help="train without MoC (the reference run)")
    parser.add_argument("--data-parallel", default="ddp", help="trainer.data_parallel: ddp, zero2 or fsdp2")
    parser.add_argument("--pec-scope", default="both", help="checkpoint.pec_scope: both, optimizer or weights")
    parser.add_argument("--mode", default="pec", help="checkpoint.mode: pec or replay")
    parser.add_argument("--window", type=int, default=4, help="checkpoint.replay.window (mode replay)")
    parser.add_argument("--persist-windows", type=int, default=2,
                        help="checkpoint.replay.persist_every_n_windows (mode replay)")
    parser.add_argument("--storage-url", default="", help="an s3:// checkpoint.storage.url (default: WORK/ckpt)")
    parser.add_argument("--endpoint", default="", help="checkpoint.storage.endpoint of an s3:// --storage-url")
    return parser.parse_args()


def _storage(args: argparse.Namespace) -> StorageConfig:
    """``WORK/ckpt`` on the default backend, or ``--storage-url`` (``s3://``) on ``tensorstore`` with the trials' retry
    bounds."""
    if not args.storage_url:
        return StorageConfig(url=(args.work / "ckpt").resolve().as_uri())
    from moc_lightning.tools.chaos.s3_trials import S3_RETRIES  # boto3: the dev extra, needed by storage=s3 alone

    return StorageConfig(backend="tensorstore", url=args.storage_url, endpoint=args.endpoint, retries=S3_RETRIES)


def train(args: argparse.Namespace) -> None:
    """One rank: fit with the oracle (and MoC, resuming what it finds, unless ``--no-moc``)."""
    torch.set_num_threads(1)
    oracle = Oracle(args.work / "oracle")
    callbacks: list[L.Callback] = [oracle]
    if args.mode == "replay":
        callbacks.append(AfterRestore(oracle))
    moc = None
    if not args.no_moc:
        moc = MoCCheckpoint(CheckpointConfig(
            k_snapshot=args.k_snapshot,
            k_persist=args.k_persist,
            every_n_train_steps=args.every,
            persist_every_n_snapshots=args.persist_every,
            pec_scope=args.pec_scope,
            mode=args.mode,
            replay=ReplayConfig(window=args.window, persist_every_n_windows=args.persist_windows),
            storage=_storage(args),
            shm_root=args.shm_root,
            ranks_per_node=RANKS_PER_NODE,
        ))
        callbacks.append(moc)
    module = GPTMoEModule(MODEL, ep=2, seed=0, data_parallel=args.data_parallel)
    data = LMDataModule(DataConfig(batch_size=4), block_size=MODEL.block_size, vocab_size=MODEL.vocab_size)
    timeout = timedelta(seconds=args.pg_timeout)
    strategy: Strategy = DDPStrategy(process_group_backend="gloo", timeout=timeout)
    if args.data_parallel in SHARDED_DATA_PARALLEL:
        strategy = ModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, process_group_backend="gloo", timeout=timeout
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=moc is not None,
        default_root_dir=str(args.work / "run"),
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=moc.resume_target() if moc is not None else None)


if __name__ == "__main__":
    standalone(train, (parse(),), WORLD)
