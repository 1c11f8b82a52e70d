"""The training job behind ``recipes/train.py``: typed config tree, Trainer assembly, and the run itself.

The dataclasses here are the Hydra schema (registered in the ConfigStore by :func:`register_configs`), so a
wrong type or an unknown key fails at composition with Hydra's own message, and ``__post_init__`` checks
values when the config is turned into objects. Everything works without Hydra too: build a
:class:`TrainConfig` and call :func:`run`. :class:`RecipeConfig` and :func:`fit` are what every recipe
shares (``recipes/train_hf.py`` trains a Hugging Face model with them, :mod:`moc_lightning.jobs.training_hf`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast, overload

import lightning as L
from hydra.core.config_store import ConfigStore
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from lightning.pytorch.callbacks import Checkpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import _PLUGIN_INPUT
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from omegaconf import DictConfig, OmegaConf

from moc_lightning.config import CheckpointConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models.causal_lm import OptimConfig, check_data_parallel
from moc_lightning.models.gpt_moe import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import SHARDED_DATA_PARALLEL, check_precision, check_shard_size
from moc_lightning.replay.driver import check_supported as check_replay_supported


@dataclass
class TrainerConfig:
    """The subset of ``lightning.Trainer`` arguments the recipe exposes, plus the expert-parallel degree."""

    accelerator: str = "cpu"
    """``cpu`` or ``gpu`` (anything Lightning accepts)."""
    devices: int = 2
    """Processes per node."""
    num_nodes: int = 1
    """Nodes."""
    ep: int | None = None
    """Expert-parallel degree; must divide devices * num_nodes and model.num_experts. ``null``: all ranks."""
    process_group_backend: str | None = None
    """``gloo`` / ``nccl``; ``null`` lets Lightning choose (gloo on CPU, nccl on GPU)."""
    data_parallel: str = "ddp"
    """``ddp`` (every rank keeps the optimizer state of every parameter it holds), ``zero2`` (ZeRO-2: each
    parameter's optimizer state, fp32 master weights included, on one of the ranks holding it;
    :mod:`moc_lightning.sharding.zero`), ``fsdp2`` (FSDP2 ``fully_shard`` under Lightning's ``ModelParallelStrategy``:
    weights, gradients and optimizer state sharded over all ranks, each expert's over its replicas) or ``hsdp``
    (the same within groups of ``hsdp_shard_size`` ranks, replicated across groups;
    :mod:`moc_lightning.models.sharded`). ``fsdp2`` and ``hsdp`` train the reference model only."""
    hsdp_shard_size: int | None = None
    """Under ``data_parallel=hsdp``: ranks per shard group (consecutive ranks; must divide the number of processes
    and be a multiple of the EP degree). ``null``: ``devices`` (shard within a node, replicate across nodes)."""
    precision: str = "32-true"
    """Lightning precision, e.g. ``bf16-mixed`` on GPU; ``bf16-true`` with ``data_parallel=zero2`` keeps bf16
    weights and fp32 master weights in the optimizer state (the paper's mixed precision). Under ``fsdp2``/``hsdp``
    ``32-true`` or ``bf16-mixed`` (an FSDP2 ``MixedPrecisionPolicy``: fp32 sharded master weights, bf16 compute)."""
    max_steps: int = 200
    """Optimizer steps to train."""
    val_check_interval: int = 50
    """Validate every this many optimizer steps."""
    limit_val_batches: int = 8
    """Validation batches per validation run."""
    log_every_n_steps: int = 10
    """Logging interval in steps."""
    gradient_clip_val: float = 1.0
    """Clip the global gradient norm (0 disables)."""
    enable_progress_bar: bool = True
    """Lightning's progress bar (steps, loss), drawn by rank 0 only; ``false`` for logs that keep every redraw."""

    def __post_init__(self) -> None:
        for name in ("devices", "num_nodes", "max_steps", "val_check_interval", "log_every_n_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        check_data_parallel(self.data_parallel)
        if self.data_parallel in SHARDED_DATA_PARALLEL:
            check_precision(self.precision)
        if self.data_parallel == "ddp" and self.precision.startswith(LOW_PRECISION_WEIGHTS):
            raise ValueError(
                f"trainer.precision={self.precision!r} with trainer.data_parallel=ddp would keep bf16/fp16 weights and "
                "optimizer state with no fp32 master copy; use bf16-mixed (fp32 weights, bf16 compute) with ddp, or "
                "trainer.data_parallel=zero2 for bf16 weights with fp32 master weights and moments"
            )
        if self.hsdp_shard_size is not None and self.data_parallel != "hsdp":
            raise ValueError(
                f"trainer.hsdp_shard_size={self.hsdp_shard_size} is for trainer.data_parallel=hsdp, "
                f"not {self.data_parallel!r}; leave it null"
            )

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is sharded over: all under ``fsdp2``, a shard group under ``hsdp``."""
        if self.data_parallel == "hsdp":
            return self.hsdp_shard_size or self.devices
        return self.world_size


LOW_PRECISION_WEIGHTS = ("bf16-true", "16-true")
"""Lightning precisions that store the weights in 16 bits (``zero2`` then keeps fp32 masters in the optimizer)."""


@dataclass
class RecipeConfig:
    """What every training recipe's config holds besides its model."""

    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and batching (``conf/data/``)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer settings (``conf/trainer/``)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """MoC checkpointing options (``conf/checkpoint/``)."""
    seed: int = 0
    """Seed of initialisation and data order."""


@dataclass
class TrainConfig(RecipeConfig):
    """Root of the config tree of ``recipes/train.py`` (``conf/train.yaml``)."""

    model: GPTMoEConfig = field(default_factory=GPTMoEConfig)
    """The reference GPT-MoE shape (``conf/model/``)."""

    def __post_init__(self) -> None:
        ep = self.trainer.ep
        if ep is not None:
            if ep < 1 or self.trainer.world_size % ep:
                raise ValueError(
                    f"trainer.ep={ep} must divide the number of processes "
                    f"(trainer.devices * trainer.num_nodes = {self.trainer.world_size})"
                )
        ep = ep or self.trainer.world_size
        if self.model.num_experts % ep:
            raise ValueError(f"model.num_experts={self.model.num_experts} must be divisible by the EP degree {ep}")
        if self.trainer.data_parallel == "hsdp":
            check_shard_size(self.trainer.world_size, self.trainer.shard_size, ep)
        if self.checkpoint.enabled and self.checkpoint.mode == "replay":
            check_replay_supported(self.trainer.precision, self.trainer.data_parallel)
        self.checkpoint.validate_for(self.model.num_experts)


def register_configs() -> None:
    """Register the schema so ``conf/train.yaml`` (``defaults: [train_schema, ...]``) is type-checked."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


Config = TypeVar("Config", bound=RecipeConfig)


@overload
def to_train_config(cfg: DictConfig) -> TrainConfig: ...


@overload
def to_train_config(cfg: DictConfig, schema: type[Config]) -> Config: ...


def to_train_config(cfg: DictConfig, schema: type[RecipeConfig] = TrainConfig) -> RecipeConfig:
    """Turn a composed Hydra config into objects of ``schema``, running every ``__post_init__`` check.

    The config is merged into a fresh schema first: Hydra's ``+key=value`` appends keys even to typed
    nodes, and ``to_object`` would drop them silently; the merge rejects them by name instead.
    """
    checked = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(cfg, resolve=True))
    return OmegaConf.to_object(checked)  # type: ignore[return-value]


def build_trainer(cfg: RecipeConfig, output_dir: Path, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    """A Trainer that logs CSV under ``output_dir/logs``; Lightning's default ``ModelCheckpoint`` never runs.

    ``ModelCheckpoint`` saves rank 0's state only, which under expert parallelism lacks the other ranks'
    experts; ``MoCCheckpoint`` (a ``Checkpoint`` callback, so Lightning adds no default one beside it) is the
    checkpointing of this recipe, and with ``checkpoint.enabled=false`` checkpointing is off altogether. The
    benchmark passes its own checkpoint callbacks (``ModelCheckpoint`` among them) through ``callbacks``.
    """
    t = cfg.trainer
    strategy: str | Strategy = "auto"
    if t.data_parallel in SHARDED_DATA_PARALLEL:  # even on one rank: the model shards over a device mesh
        strategy = ModelParallelStrategy(
            data_parallel_size=t.world_size, tensor_parallel_size=1, process_group_backend=t.process_group_backend
        )
    elif t.world_size > 1:
        strategy = DDPStrategy(process_group_backend=t.process_group_backend)
    # On SLURM, requeue is submitit's and resume is MoC's: Lightning's own auto-requeue would save a rank-0
    # ``hpc_ckpt`` (missing other ranks' experts) and restore it on top of the MoC recovery.
    plugins: list[_PLUGIN_INPUT] = [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
    callbacks = list(callbacks or [])
    if t.enable_progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        # max_steps bounds the run, so Lightning sets max_epochs=-1, which Lightning 2.6's default bar where
        # ``rich`` is installed shows as "Epoch 0/-2" (Lightning-AI/pytorch-lightning#21925); tqdm's shows the epoch.
        callbacks.append(TQDMProgressBar())
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=cast(_PRECISION_INPUT, t.precision),  # a config str (no Literal in OmegaConf); Lightning checks it
        max_steps=t.max_steps,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        gradient_clip_val=t.gradient_clip_val or None,
        logger=CSVLogger(save_dir=str(output_dir), name="logs"),  # logs/version_N: one per (re)start
        default_root_dir=str(output_dir),
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        callbacks=callbacks,
        enable_progress_bar=t.enable_progress_bar,
        plugins=plugins,
    )


def run(cfg: TrainConfig, output_dir: Path) -> L.Trainer:
    """Train the reference model as configured; returns the finished Trainer."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    t = cfg.trainer
    module = GPTMoEModule(
        cfg.model, cfg.optim, ep=t.ep, seed=cfg.seed, data_parallel=t.data_parallel, hsdp_shard_size=t.hsdp_shard_size
    )
    data = LMDataModule(cfg.data, block_size=cfg.model.block_size, vocab_size=cfg.model.vocab_size)
    return fit(cfg, module, data, output_dir)


def fit(cfg: RecipeConfig, module: L.LightningModule, data: L.LightningDataModule, output_dir: Path) -> L.Trainer:
    """Train ``module`` on ``data`` with MoC checkpointing as ``cfg`` says, resuming when the run's storage holds
    a checkpoint; prints the final metrics and where the logs are. Returns the finished Trainer."""
    moc = MoCCheckpoint(cfg.checkpoint) if cfg.checkpoint.enabled else None
    trainer = build_trainer(cfg, output_dir, [moc] if moc else [])
    trainer.fit(module, datamodule=data, ckpt_path=moc.resume_target(output_dir) if moc else None)
    if trainer.is_global_zero:
        assert isinstance(trainer.logger, CSVLogger)  # build_trainer's, whose log_dir is always set
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"[moc_lightning] finished {trainer.global_step} steps; final metrics: {metrics}")
        print(f"[moc_lightning] logs: {Path(trainer.logger.log_dir) / 'metrics.csv'}")
    return trainer
