"""A GPT-style decoder whose FFN is a Mixture-of-Experts layer every ``moe_every`` blocks (nanoGPT-sized).

Parameter names carry the *global* expert id on every rank (``blocks.{l}.moe.experts.{e}.fc.weight``), so a
checkpoint can never collapse two different experts into one key. Initialisation is a function of the
seed and the parameter's name only, so a model built with any expert-parallel degree starts from the same
global weights: an EP=2 run and an EP=1 run are comparable step for step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moc_lightning.models.moe import MoELayer
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology


@dataclass
class GPTMoEConfig:
    """Shape of the reference GPT-MoE. Presets live in ``conf/model/``."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level default dataset."""
    block_size: int = 64
    """Context length in tokens."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 64
    """Hidden size."""
    num_experts: int = 8
    """Experts per MoE layer (N)."""
    moe_every: int = 2
    """Block ``l`` is an MoE block when ``(l + 1) % moe_every == 0`` (2: every other block, as in the paper)."""
    top_k: int = 2
    """Experts each token is routed to."""
    capacity_factor: float = 1.25
    """Slots per expert = ceil(capacity_factor * tokens * top_k / N); tokens past capacity are dropped."""
    gate_noise: float = 0.0
    """Std of the Gaussian noise added to router logits while training (0 disables noisy gating)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch-style load-balancing loss."""
    ffn_mult: int = 4
    """FFN hidden size as a multiple of ``n_embd`` (dense FFN and every expert)."""
    bias: bool = True
    """Whether linear layers and layer norms have biases."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "num_experts", "moe_every", "top_k")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} must be <= model.num_experts={self.num_experts}")
        if self.moe_every > self.n_layer:
            raise ValueError(f"model.moe_every={self.moe_every} must be <= model.n_layer={self.n_layer}: no MoE block")
        if self.capacity_factor <= 0:
            raise ValueError(f"model.capacity_factor must be > 0, got {self.capacity_factor}")

    def is_moe_block(self, layer: int) -> bool:
        """Whether block ``layer`` carries an MoE FFN."""
        return (layer + 1) % self.moe_every == 0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class DenseMLP(nn.Module):
    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_mult * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_mult * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block; its FFN is ``mlp`` (dense) or ``moe``."""

    def __init__(self, cfg: GPTMoEConfig, layer: int, topology: ExpertParallelTopology) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.ffn_name = "moe" if cfg.is_moe_block(layer) else "mlp"
        if self.ffn_name == "moe":
            self.moe = MoELayer(
                cfg.n_embd,
                cfg.ffn_mult * cfg.n_embd,
                cfg.num_experts,
                cfg.top_k,
                cfg.capacity_factor,
                cfg.gate_noise,
                cfg.bias,
                topology,
            )
        else:
            self.mlp = DenseMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + getattr(self, self.ffn_name)(self.ln2(x))


class GPTMoE(nn.Module):
    """The reference model: token + position embeddings, blocks, final norm, head tied to the embedding."""

    def __init__(self, cfg: GPTMoEConfig, topology: ExpertParallelTopology | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.topology = topology or ExpertParallelTopology()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, layer, self.topology) for layer in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.reset_parameters(seed)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in order; their index in this list is the MoE-layer ordinal used by units."""
        return [cast(MoELayer, block.moe) for block in self.blocks if block.ffn_name == "moe"]

    def expert_parameter_names(self) -> list[str]:
        """Names of the parameters that belong to experts (reduced over expert replicas, not all ranks)."""
        return [name for name, _ in self.named_parameters() if ".experts." in name]

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """nanoGPT initialisation, drawn per parameter from a generator seeded by (seed, parameter name)."""
        for name, param in self.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("bias"):
                param.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                param.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                # Drawn on the CPU generator's device whatever the default device: Lightning runs configure_model
                # under the accelerator's (a CUDA default device and a CPU generator do not mix), and the same draw
                # everywhere keeps a run's initial weights independent of where it trains.
                param.copy_(torch.randn(param.shape, generator=generator, device="cpu") * std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Logits, the language-modelling loss (when ``targets`` are given) and the summed auxiliary loss."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        aux = torch.stack([layer.aux_loss for layer in self.moe_layers()]).sum()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss, aux

    def reduce_expert_gradients(self) -> None:
        """Average expert gradients over the global batch: sum over the expert's replicas, divide by world size.

        An expert's gradient already holds the contributions of every rank of its EP group (the all-to-all
        backward brings them); the replicas in other EP groups hold the rest. Dense gradients are averaged
        by DDP over all ranks; both end up as the gradient of the global mean loss.
        """
        grads = [p.grad for name, p in self.named_parameters() if ".experts." in name and p.grad is not None]
        if not grads:
            return
        topology = self.topology
        if topology.replica_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat, group=topology.replica_group)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        if topology.world_size > 1:
            for g in grads:
                g.div_(topology.world_size)
