"""The reference expert-parallel GPT-MoE model and its Lightning wrapper."""

from moc_lightning.models.gpt_moe import GPTMoE, GPTMoEConfig
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology

__all__ = ["ExpertParallelTopology", "GPTMoE", "GPTMoEConfig"]
