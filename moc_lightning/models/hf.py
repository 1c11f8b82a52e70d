"""A Hugging Face ``transformers`` causal LM as a ``LightningModule``, built from a small config (no download).

This is the module a user who trains a Hugging Face MoE writes: the model is ``self.model`` and nothing about
experts is declared. MoC finds the experts from the parameter names (stacked ``experts.gate_up_proj`` in
``transformers`` 5), records the model's config with every checkpoint, and ``moc-consolidate --format hf``
hands the result back to ``from_pretrained``. Every rank holds every expert (data parallelism under DDP).

Needs the ``hf`` extra (``pip install 'moc_lightning[hf]'``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from moc_lightning.models.causal_lm import Batch, CausalLMModule, OptimConfig

EXPERT_COUNT_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Where the config classes of MoE families keep the number of routed experts per layer."""


@dataclass
class HFModelConfig:
    """A ``transformers`` model type and the config options that make it small (``conf/model/hf_*.yaml``)."""

    model_type: str = "mixtral"
    """A ``transformers`` model type (``AutoConfig.for_model``): ``mixtral``, ``qwen3_moe``, ``deepseek_v3``, ..."""
    vocab_size: int = 256
    """Vocabulary of the model; the shipped corpus is bytes (256)."""
    block_size: int = 64
    """Tokens per training sequence."""
    config: dict[str, Any] = field(default_factory=dict)
    """Options of the model type's config class (sizes, experts, top-k), each one it defines."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.block_size < 1:
            raise ValueError(f"model.vocab_size and model.block_size must be >= 1, got {self.vocab_size}, {self.block_size}")
        self.build_config()  # an unknown type or option fails here, before anything runs

    def build_config(self) -> PretrainedConfig:
        """The ``transformers`` config; an option its class does not define is refused by name."""
        try:
            default = AutoConfig.for_model(self.model_type)
        except (KeyError, ValueError) as err:
            raise ValueError(f"model.model_type={self.model_type!r} is not a transformers model type ({err})") from err
        fields = {f.name for f in dataclasses.fields(default)} if dataclasses.is_dataclass(default) else set()
        known = set(default.to_dict()) | set(default.attribute_map) | fields  # fields: those None leaves out
        unknown = sorted(set(self.config) - known)
        if unknown:
            hints = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
            raise ValueError(
                f"model.config has options {unknown} that {type(default).__name__} does not define"
                + "".join(f"; {name}: did you mean {close[0]!r}?" for name, close in hints.items() if close)
            )
        return AutoConfig.for_model(self.model_type, vocab_size=self.vocab_size, **self.config)

    def num_experts(self) -> int:
        """Routed experts per MoE layer, read from the config under its family's name."""
        config = self.build_config()
        for attr in EXPERT_COUNT_ATTRS:
            if isinstance(getattr(config, attr, None), int):
                return getattr(config, attr)
        raise ValueError(
            f"model.model_type={self.model_type!r}: its config has none of {list(EXPERT_COUNT_ATTRS)}, "
            "so it is not a mixture-of-experts model MoC can checkpoint"
        )


def build_model(cfg: HFModelConfig) -> PreTrainedModel:
    """The causal LM of ``cfg``, initialised from the current torch seed."""
    return AutoModelForCausalLM.from_config(cfg.build_config())


class HFCausalLMModule(CausalLMModule):
    """Trains a Hugging Face causal LM; the loss adds the model's router auxiliary loss when it reports one.

    Every rank holds every expert (no expert parallelism); ``data_parallel="zero2"`` partitions the optimizer
    state over the ranks, each unit's on one of them (the experts of one stacked ``[E, ...]`` tensor together).
    """

    def __init__(self, model: PreTrainedModel, optim: OptimConfig | None = None, data_parallel: str = "ddp") -> None:
        super().__init__(optim, data_parallel)
        self.model: PreTrainedModel = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits

    def losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets are already shifted (``y[t] = x[t + 1]``), so the model is not given ``labels`` (it would
        shift them again); its ``aux_loss`` (load balancing, with ``output_router_logits``) is weighted by
        the config's ``router_aux_loss_coef``."""
        x, y = batch
        out = self.model(input_ids=x, use_cache=False)
        lm_loss = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            return lm_loss, lm_loss
        return lm_loss, lm_loss + self.model.config.router_aux_loss_coef * aux
