"""A torchtitan-style MoE language model, small: stacked ``[E, ...]`` ``w1/w2/w3`` experts, a router whose
``gate`` is an ``nn.Linear``, and an ``expert_bias`` buffer (auxiliary-loss-free load balancing) that shifts
which experts the router selects and is updated from the tokens each expert received.

Written after torchtitan's ``GroupedExperts``/``TokenChoiceTopKRouter``/``MoE`` (names, shapes and what the
router returns), without its parallelism: what a user who brings such a model gives ``MoCCheckpoint``.
:func:`titan_route` is the tests' own reading of what its router selected.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: list[int]) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(x.split(num_tokens_per_expert)):
            h = F.silu(chunk @ self.w1[e].T) * (chunk @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).float())
        _, selected = torch.topk(scores + expert_bias, k=self.top_k, dim=1)  # the bias picks, it does not weigh
        top_scores = scores.gather(1, selected)
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts


def titan_route(router: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor:
    """The experts a :class:`TokenChoiceTopKRouter` forward selected, ``[tokens, k]``, as a forward hook on it sees
    them: recomputed from its gate and the expert bias (its second argument), never read from its ``output``, so a
    test's hand count of the tokens each expert received does not take the router's word for it."""
    x, expert_bias = args
    return (torch.sigmoid(router.gate(x).float()) + expert_bias).topk(router.top_k, dim=-1).indices


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, selected, counts = self.router(x, self.expert_bias)
        order = selected.view(-1).argsort(stable=True)
        token = order // self.router.top_k
        routed = self.experts(x[token], counts.long().tolist()) * top_scores.view(-1, 1)[order]
        out = torch.zeros_like(x).index_add(0, token, routed)
        if self.training:
            with torch.no_grad():  # torchtitan does this before the optimizer step; here once per forward
                self.tokens_per_expert.add_(counts)
                if dist.is_initialized():  # over all data-parallel ranks, as torchtitan's, so the bias stays alike
                    counts = counts.clone()
                    dist.all_reduce(counts)
                self.expert_bias.add_(1e-3 * torch.sign(counts.mean() - counts))
        return out.view(shape)


class TitanMoE(nn.Module):
    """Embedding, ``n_layers`` of (norm, MoE) with residuals, norm, output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, num_experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.RMSNorm(dim), "moe": MoE(dim, 2 * dim, num_experts, top_k)})
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = h + layer["moe"](layer["norm"](h))
        logits = self.output(self.norm(h))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)
