"""MoE models nobody here wrote, each built from a tiny config with no download, under ``MoCCheckpoint`` as a
user adds it: no regex, no ``moe_layers()``.

For each family: (a) the layout's experts are exactly the family's (listed here by hand, from its modeling
code); (b) after a fault that brings some experts back from older versions, the recovery's PLT equals a hand
count from the router's own output (top-k of its logits, or the family's documented rule) recorded by this
test's own hooks; (c) the resume restores every parameter, persistent buffer and optimizer tensor bitwise to
the state it had at its unit's source step.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import cpu_trainer, moc_config
from titan_moe import TitanMoE, titan_route
from torch import nn

from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.units import parse_unit
from moc_lightning.lightning.callback import MoCCheckpoint

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install moc_lightning[hf])"
)

VOCAB, SEQ, BATCH = 64, 16, 4
N = 8
"""Experts per MoE layer, in every family."""
CRASH_AFTER = 7
"""Snapshots and persists every 2 steps, of 4 of the 8 experts of each layer: at the crash, half the experts
are from step 6 and half from step 4, so the tokens the older half received in steps 5 and 6 are lost."""

Route = Callable[[nn.Module, tuple[Any, ...], Any], torch.Tensor]
"""The test's own reading of one router forward: ``(router, args, output) -> [tokens, k]`` expert ids."""


def top_k_of_logits(k: int, at: int | None = None) -> Route:
    """Top-k of the router logits (the whole output, or element ``at`` of the output tuple)."""
    def route(router: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor:
        logits = output if at is None else output[at]
        return logits.reshape(-1, logits.shape[-1]).topk(k, dim=-1).indices

    return route


def deepseek_v3_route(router: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor:
    """DeepSeek-V3's routing (its paper, section 2.1.2): sigmoid scores plus the correction bias choose the
    ``topk_group`` groups with the best top-2 sums, then the top-k experts inside them."""
    scores = output[0].sigmoid() + router.e_score_correction_bias
    grouped = scores.view(scores.shape[0], router.num_group, -1)
    best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
    allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best_groups, True)
    masked = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(scores.shape[0], -1)
    return masked.topk(router.top_k, dim=-1).indices


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    experts: dict[str, tuple[str, ...]]
    """MoE layer prefix -> the expert parameters under it (names relative to the prefix), in model order."""
    routers: dict[str, str]
    """MoE layer prefix -> its router module."""
    route: Route


def _hf(config_class: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(vocab_size=VOCAB, **kw)
        if config_class == "SwitchTransformersConfig":
            return transformers.SwitchTransformersForConditionalGeneration(config)
        return transformers.AutoModelForCausalLM.from_config(config)

    return build


def _titan() -> nn.Module:
    torch.manual_seed(0)
    return TitanMoE(vocab=VOCAB)


LLAMA_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
FUSED = ("experts.gate_up_proj", "experts.down_proj")
TWO = ("model.layers.0", "model.layers.1")


def _layers(prefixes: tuple[str, ...], leaf: str, experts: tuple[str, ...], router: str) -> tuple[dict, dict]:
    return ({f"{p}.{leaf}": experts for p in prefixes}, {f"{p}.{leaf}": f"{p}.{leaf}.{router}" for p in prefixes})


def _family(build: Callable[[], nn.Module], layers: tuple[dict, dict], route: Route) -> Family:
    return Family(build, *layers, route)


FAMILIES: dict[str, Family] = {
    "mixtral": _family(
        _hf("MixtralConfig", intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, **LLAMA_LIKE),
        _layers(TWO, "mlp", FUSED, "gate"), top_k_of_logits(2, at=0),
    ),
    "qwen2_moe": _family(
        _hf("Qwen2MoeConfig", intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, **LLAMA_LIKE),
        _layers(TWO, "mlp", FUSED, "gate"), top_k_of_logits(2, at=0),
    ),
    "qwen3_moe": _family(
        _hf("Qwen3MoeConfig", intermediate_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            head_dim=8, **LLAMA_LIKE),
        _layers(TWO, "mlp", FUSED, "gate"), top_k_of_logits(2, at=0),
    ),
    "deepseek_v3": _family(  # layer 0 dense (first_k_dense_replace); shared experts are dense
        _hf("DeepseekV3Config", intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=64),
        _layers(("model.layers.1",), "mlp", FUSED, "gate"), deepseek_v3_route,
    ),
    "switch_transformers": Family(  # block 1 of each stack is sparse; top-1, capacity above the tokens
        _hf("SwitchTransformersConfig", d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4, num_experts=8,
            expert_capacity=64, router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0),
        {p: tuple(f"experts.expert_{e}.{w}.weight" for e in range(N) for w in ("wi", "wo"))
         for p in ("encoder.block.1.layer.1.mlp", "decoder.block.1.layer.2.mlp")},
        {p: f"{p}.router" for p in ("encoder.block.1.layer.1.mlp", "decoder.block.1.layer.2.mlp")},
        lambda router, args, output: output[2].reshape(-1, N).argmax(-1, keepdim=True),
    ),
    "granitemoe": _family(
        _hf("GraniteMoeConfig", intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, **LLAMA_LIKE),
        _layers(TWO, "block_sparse_moe", FUSED, "router"), top_k_of_logits(2, at=0),
    ),
    "jetmoe": Family(  # mixture of attention heads and of MLPs, each a MoE layer; the [32] biases are dense
        _hf("JetMoeConfig", hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
            intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64),
        {f"model.layers.{l}.{m}": ("input_linear.weight", "output_linear.weight")
         for l in (0, 1) for m in ("mlp", "self_attention.experts")},
        {f"model.layers.{l}.{m}": f"model.layers.{l}.{m}.router"
         for l in (0, 1) for m in ("mlp", "self_attention.experts")},
        top_k_of_logits(2, at=4),
    ),
    "dbrx": _family(  # experts flattened [E*I, H]
        _hf("DbrxConfig", d_model=32, n_heads=4, n_layers=2, max_seq_len=64,  # rope_theta, clip_qkv: 5.24 needs them
            attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2}),
        _layers(("transformer.blocks.0", "transformer.blocks.1"), "ffn", ("experts.mlp.w1", "experts.mlp.v1",
                "experts.mlp.w2"), "router"), top_k_of_logits(2),
    ),
    "torchtitan": _family(
        _titan, _layers(("layers.0", "layers.1"), "moe", ("experts.w1", "experts.w2", "experts.w3"), "router"),
        titan_route,
    ),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_detected_experts_are_the_familys_experts(name: str) -> None:
    family = FAMILIES[name]
    model = family.build()
    layout = build_layout(model, None)
    found = {
        layer.prefix: sorted({s.param for u in layout.expert_units if u.layer == layer.index for s in layout.slots[u]
                              if not s.buffer})
        for layer in layout.moe_layers
    }
    assert found == {prefix: sorted(f"{prefix}.{p}" for p in params) for prefix, params in family.experts.items()}
    assert [(layer.prefix, layer.router) for layer in layout.moe_layers] == list(family.routers.items())
    assert {layer.num_experts for layer in layout.moe_layers} == {N}
    expert_params = {s.param for u in layout.expert_units for s in layout.slots[u]}
    for param_name, param in model.named_parameters():  # each expert tensor is split into N slices, no more
        if param_name in expert_params:
            owners = [u for u in layout.expert_units if any(s.param == param_name for s in layout.slots[u])]
            assert len(owners) in (1, N), param_name


class Wrapped(L.LightningModule):
    """The minimal ``LightningModule`` a user writes around a model: a loss, an optimizer, random tokens."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self.model = family.build()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens = torch.randint(2, VOCAB, (BATCH * 16, SEQ), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH)


class Crash(Exception):
    pass


class HandCount(L.Callback):
    """Per step, the tokens each expert of each MoE layer received, from this test's own hooks on the routers
    (``Family.route``); the full training state after every step; and a crash after ``crash_after``."""

    def __init__(self, family: Family, crash_after: int | None) -> None:
        self.family, self.crash_after = family, crash_after
        self.counts: dict[int, list[torch.Tensor]] = {}
        self.assigned: dict[int, list[int]] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self._pending: list[torch.Tensor] = []
        self._pending_assigned: list[int] = []

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        prefixes = list(self.family.routers)
        self._pending = [torch.zeros(N, dtype=torch.int64) for _ in prefixes]
        self._pending_assigned = [0] * len(prefixes)
        for i, prefix in enumerate(prefixes):
            module.get_submodule(f"model.{self.family.routers[prefix]}").register_forward_hook(self._hook(i))

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(router: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if router.training:
                chosen = self.family.route(router, args, output)
                self._pending[layer] += torch.bincount(chosen.reshape(-1), minlength=N)
                self._pending_assigned[layer] += chosen.numel()

        return hook

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.states[trainer.global_step] = _state(trainer, module)
        self.shared = _shared_states(build_layout(module, trainer.optimizers[0]).tensors())

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        # every persist done before the next step: what storage holds does not depend on timing
        next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()
        step = trainer.global_step
        self.counts[step], self.assigned[step] = self._pending, self._pending_assigned
        self._pending = [torch.zeros_like(c) for c in self._pending]
        self._pending_assigned = [0] * len(self._pending)
        self.states[step] = _state(trainer, module)
        if step == self.crash_after:
            raise Crash(f"killed after step {step}")


def _state(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter, persistent buffer and optimizer tensor, by unit key."""
    layout = build_layout(module, trainer.optimizers[0])
    return {key: tensor.detach().clone() for key, tensor in layout.tensors().items()}


def _fit(tmp_path: Path, family: Family, max_steps: int, recorder: L.Callback) -> MoCCheckpoint:
    config = moc_config(tmp_path, k_snapshot=4, k_persist=4, every_n_train_steps=2, persist_every_n_snapshots=1)
    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(tmp_path / "run", max_steps, [moc, recorder])
    try:
        trainer.fit(Wrapped(family), ckpt_path=moc.resume_target())
    except Crash:
        pass
    return moc


@pytest.mark.parametrize("level", ["memory_local", "storage"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fault_plt_is_the_hand_count_and_resume_is_bitwise(tmp_path: Path, name: str, level: str) -> None:
    """From the crashed process's snapshots, or (its node's shared memory lost) from storage alone."""
    family = FAMILIES[name]
    first = HandCount(family, crash_after=CRASH_AFTER)
    _fit(tmp_path, family, 20, first)
    if level == "storage":
        shutil.rmtree(tmp_path / "shm")
    second = HandCount(family, crash_after=None)
    moc = _fit(tmp_path, family, CRASH_AFTER + 1, second)

    report = moc.recovery
    resume = report.resume_step
    assert resume == 6 and {source["level"] for source in report.sources.values()} == {level}
    sources = {key: source["step"] for key, source in report.sources.items()}
    experts = [(layer, e) for layer in range(len(family.routers)) for e in range(N)]
    assert sorted(sources[f"expert/L{layer}/E{e}"] for layer, e in experts) == [4] * (len(experts) // 2) + [6] * (
        len(experts) // 2
    )

    # (b) eq. 7 from the hand counts: tokens routed to each expert after its source step, up to the resume
    lost_share = []
    for layer in range(len(family.routers)):
        lost = sum(
            int(first.counts[t][layer][e])
            for e in range(N)
            for t in range(sources[f"expert/L{layer}/E{e}"] + 1, resume + 1)
        )
        lost_share.append(lost / sum(first.assigned[t][layer] for t in range(1, resume + 1)))
    hand_plt = sum(lost_share) / len(lost_share)
    assert hand_plt > 0
    assert report.plt == pytest.approx(hand_plt, rel=1e-12, abs=0)

    # (c) every tensor as it was at its unit's source step; a state all experts of a stacked parameter share
    # (Adam's scalar step) as it was at the newest of their source steps
    restored = second.states[resume]
    assert set(restored) == set(first.states[resume])
    shared = second.shared
    newest = {group: max(sources[parse_unit(key).key] for key in keys) for group, keys in shared.items()}
    sharing = {key: newest[group] for group, keys in shared.items() for key in keys}
    for key, tensor in restored.items():
        expected = first.states[sharing.get(key, sources[parse_unit(key).key])][key]
        assert torch.equal(tensor, expected), key


def _shared_states(state: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """Keys of the live state whose tensors are one 0-dim tensor held by several experts, grouped by it."""
    groups: dict[int, list[str]] = {}
    for key, tensor in state.items():
        groups.setdefault(tensor.data_ptr() if tensor.dim() == 0 else -1, []).append(key)
    groups.pop(-1, None)
    return {ptr: keys for ptr, keys in groups.items() if len(keys) > 1}
