"""The training job behind ``recipes/train_hf.py``: a Hugging Face MoE built from a small config, trained with MoC.

The same tree as ``recipes/train.py`` (``data``, ``optim``, ``trainer``, ``checkpoint``, ``seed``: the
shared :class:`~moc_lightning.jobs.training.RecipeConfig`), with a ``model`` node that names a ``transformers``
model type and its config options instead of the reference GPT-MoE. Needs the ``hf`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
from hydra.core.config_store import ConfigStore

from moc_lightning.data import LMDataModule
from moc_lightning.jobs.training import RecipeConfig, fit
from moc_lightning.models.hf import HFCausalLMModule, HFModelConfig, build_model


@dataclass
class TrainHFConfig(RecipeConfig):
    """Root of the config tree of ``recipes/train_hf.py`` (``conf/train_hf.yaml``)."""

    model: HFModelConfig = field(default_factory=HFModelConfig)
    """The Hugging Face model (``conf/model/hf_*.yaml``)."""

    def __post_init__(self) -> None:
        if self.trainer.ep not in (None, 1):
            raise ValueError(
                f"trainer.ep={self.trainer.ep}: a Hugging Face model trains data-parallel here (every rank holds "
                "every expert); leave trainer.ep null"
            )
        self.checkpoint.validate_for(self.model.num_experts())


def register_configs() -> None:
    """Register the schema so ``conf/train_hf.yaml`` (``defaults: [train_hf_schema, ...]``) is type-checked."""
    ConfigStore.instance().store(name="train_hf_schema", node=TrainHFConfig)


def run_hf(cfg: TrainHFConfig, output_dir: Path) -> L.Trainer:
    """Train the configured Hugging Face model; returns the finished Trainer."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = HFCausalLMModule(build_model(cfg.model), cfg.optim, data_parallel=cfg.trainer.data_parallel)
    data = LMDataModule(cfg.data, block_size=cfg.model.block_size, vocab_size=cfg.model.vocab_size)
    return fit(cfg, module, data, output_dir)
