"""MoE models described by their tensor shapes alone, for reports that plan checkpoints of models too large to build.

A shape lists each unit's tensors (local name and shape), as :mod:`moc_lightning.engine.layout` would find them in the
built model: the non-expert modules at layer granularity, in state-dict order, and one expert's tensors (every expert
of every MoE layer alike). From it the reports derive parameter counts (the paper's accounting, ``checkpoint_units``)
or the engine's own units (:mod:`moc_lightning.tools.scale_report`). Two shapes: GPT-350M-16E (MoC-System Table 1) and
a DeepSeek-V3-shaped model (58 MoE layers x 256 routed experts, the scale DESIGN.md asks the control plane to hold).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from moc_lightning.engine.selection import SequentialSelection
from moc_lightning.engine.units import DenseUnit, ExpertUnit
from moc_lightning.runtime.expert_parallel import ep_position
from moc_lightning.sharding.ownership import ShardingUnit, Topology

TensorShapes = tuple[tuple[str, tuple[int, ...]], ...]
"""(local name, shape) of each tensor of one unit."""


class MoeShape(Protocol):
    """What the reports need of a model: its non-expert modules, one expert's tensors, and where the MoE layers are."""

    @property
    def experts(self) -> int: ...

    @property
    def moe_layers(self) -> range: ...

    def dense_tensors(self) -> list[tuple[str, TensorShapes]]: ...

    def expert_tensors(self) -> TensorShapes: ...


def numel(tensors: TensorShapes) -> int:
    """Parameters of a unit's tensors."""
    return sum(math.prod(shape) for _, shape in tensors)


def dense_params(shape: MoeShape) -> list[tuple[str, int]]:
    """Non-expert modules at layer granularity, in state-dict order, as (name, parameter count)."""
    return [(name, numel(tensors)) for name, tensors in shape.dense_tensors()]


@dataclass(frozen=True)
class GptMoeShape:
    """GPT-350M-16E (Table 1): MoE replaces the FFN of every other layer (layers 1, 3, ..., 23)."""

    layers: int = 24
    hidden: int = 1024
    experts: int = 16
    vocab: int = 50304
    """GPT-2's 50257 padded to a multiple of 128, as Megatron does; the LM head is tied to it."""
    seq_len: int = 2048
    ffn_mult: int = 4

    @property
    def moe_layers(self) -> range:
        return range(1, self.layers, 2)

    @property
    def ffn_params(self) -> int:
        """One GPT FFN (fc + proj, with biases): the size of a dense FFN and of each expert."""
        return numel(self.expert_tensors())

    def expert_tensors(self) -> TensorShapes:
        h, f = self.hidden, self.ffn_mult * self.hidden
        return (("fc.weight", (f, h)), ("fc.bias", (f,)), ("proj.weight", (h, f)), ("proj.bias", (h,)))

    def dense_params(self) -> list[tuple[str, int]]:
        return dense_params(self)

    def dense_tensors(self) -> list[tuple[str, TensorShapes]]:
        h = self.hidden
        norm = (("ln.weight", (h,)), ("ln.bias", (h,)))
        attn = (*norm, ("qkv.weight", (3 * h, h)), ("qkv.bias", (3 * h,)), ("proj.weight", (h, h)), ("proj.bias", (h,)))
        modules: list[tuple[str, TensorShapes]] = [
            ("wte", (("weight", (self.vocab, h)),)),
            ("wpe", (("weight", (self.seq_len, h)),)),
        ]
        for layer in range(self.layers):
            modules.append((f"layers.{layer}.attn", attn))
            if layer in self.moe_layers:
                modules.append((f"layers.{layer}.router", (*norm, ("gate.weight", (self.experts, h)))))
            else:
                modules.append((f"layers.{layer}.ffn", (*norm, *self.expert_tensors())))
        modules.append(("ln_f", norm))
        return modules


@dataclass(frozen=True)
class DeepSeekV3Shape:
    """DeepSeek-V3's shapes (its published config): 61 layers, the first 3 with a dense FFN, the other 58 with 256
    routed experts and one shared expert; multi-head latent attention; an untied LM head. The router's score bias
    (``e_score_correction_bias``) is a buffer, kept with the router."""

    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    experts: int = 256
    expert_ffn: int = 2048
    dense_ffn: int = 18432
    vocab: int = 129280
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128

    @property
    def moe_layers(self) -> range:
        return range(self.dense_layers, self.layers)

    def _ffn(self, inner: int) -> TensorShapes:
        h = self.hidden
        return (("gate_proj.weight", (inner, h)), ("up_proj.weight", (inner, h)), ("down_proj.weight", (h, inner)))

    def expert_tensors(self) -> TensorShapes:
        return self._ffn(self.expert_ffn)

    def dense_tensors(self) -> list[tuple[str, TensorShapes]]:
        h, heads = self.hidden, self.heads
        attn = (
            ("input_layernorm.weight", (h,)),
            ("q_a_proj.weight", (self.q_lora, h)),
            ("q_a_layernorm.weight", (self.q_lora,)),
            ("q_b_proj.weight", (heads * (self.qk_nope + self.qk_rope), self.q_lora)),
            ("kv_a_proj_with_mqa.weight", (self.kv_lora + self.qk_rope, h)),
            ("kv_a_layernorm.weight", (self.kv_lora,)),
            ("kv_b_proj.weight", (heads * (self.qk_nope + self.v_head), self.kv_lora)),
            ("o_proj.weight", (h, heads * self.v_head)),
            ("post_attention_layernorm.weight", (h,)),
        )
        modules: list[tuple[str, TensorShapes]] = [("embed_tokens", (("weight", (self.vocab, h)),))]
        for layer in range(self.layers):
            modules.append((f"layers.{layer}.attn", attn))
            if layer in self.moe_layers:
                router = (("weight", (self.experts, h)), ("e_score_correction_bias", (self.experts,)))
                modules.append((f"layers.{layer}.router", router))
                modules.append((f"layers.{layer}.shared_expert", self.expert_tensors()))
            else:
                modules.append((f"layers.{layer}.ffn", self._ffn(self.dense_ffn)))
        modules += [("norm", (("weight", (h,)),)), ("lm_head", (("weight", (self.vocab, h)),))]
        return modules


def rotation(shape: MoeShape, ep: int, k: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Experts each MoE layer persists at every checkpoint of one full rotation (ceil(N/k) checkpoints).

    The rotation then repeats, so its worst checkpoint is the worst of the whole run.
    """
    policy = SequentialSelection(num_experts=[shape.experts] * len(shape.moe_layers), ep_degree=ep)
    for checkpoint in range(math.ceil(shape.experts / k)):
        yield policy.select(checkpoint, k, k).persist


def checkpoint_units(
    shape: MoeShape, topology: Topology, selection: Sequence[Sequence[int]], bytes_per_param: int
) -> tuple[ShardingUnit, ...]:
    """All dense units and the selected experts, in state-dict order; one row of ``bytes_per_param`` per parameter."""
    expert_params = numel(shape.expert_tensors())
    units = []
    for name, params in dense_params(shape):
        units.append(ShardingUnit(DenseUnit(name).key, "dense", params, bytes_per_param, topology.ranks()))
        if name.endswith(".router"):
            moe_index = shape.moe_layers.index(int(name.split(".")[1]))
            units.extend(
                ShardingUnit(
                    ExpertUnit(moe_index, e).key,
                    "expert",
                    expert_params,
                    bytes_per_param,
                    topology.replicas(ep_position(e, shape.experts, topology.ep)),
                    layer=moe_index,
                    expert=e,
                )
                for e in selection[moe_index]
            )
    return tuple(units)
