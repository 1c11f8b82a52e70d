"""A top-k gated Mixture-of-Experts FFN with capacity-limited dispatch and real expert parallelism.

The router runs on every rank over its own tokens. Each (token, choice) pair takes a slot in its expert's
buffer of ``capacity`` slots, first choices before second choices (GShard's priority); pairs past capacity
are dropped and pass through the residual connection only. The buffer ``[N, capacity, d]`` is exchanged
with ``all_to_all`` inside the EP group, each rank runs its local experts, and the results travel back.

``tokens_per_expert`` records what each expert actually processed in the last forward (after drops): the
token ledger counts lost tokens from it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moc_lightning.runtime.expert_parallel import ExpertParallelTopology, all_to_all


class ExpertMLP(nn.Module):
    """One expert: the GPT FFN (``fc`` -> GELU -> ``proj``)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoELayer(nn.Module):
    """Router plus the experts this rank holds, keyed by their *global* id so parameter names are unique."""

    def __init__(
        self,
        n_embd: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float,
        gate_noise: float,
        bias: bool,
        topology: ExpertParallelTopology,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.gate_noise = gate_noise
        self.topology = topology
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.local_expert_ids = list(topology.local_experts(num_experts))
        self.experts = nn.ModuleDict({str(e): ExpertMLP(n_embd, hidden, bias) for e in self.local_expert_ids})
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
        """Tokens each expert processed in the last forward on this rank (after capacity drops)."""
        self.tokens_assigned = 0
        """Tokens x top_k routed in the last forward on this rank (before capacity drops)."""
        self.aux_loss = torch.zeros(())
        """Switch-style load-balancing loss of the last forward."""

    def capacity(self, num_tokens: int) -> int:
        """Slots per expert for ``num_tokens`` local tokens: ``ceil(capacity_factor * tokens * top_k / N)``."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        num_tokens, n = tokens.shape[0], self.num_experts
        logits = self.router(tokens)
        if self.training and self.gate_noise > 0:
            logits = logits + torch.randn_like(logits) * self.gate_noise
        probs = logits.softmax(dim=-1)
        gate, choice = probs.topk(self.top_k, dim=-1)  # [S, k]

        # Choice-major order: all first choices claim slots before any second choice.
        flat_expert = choice.t().reshape(-1)  # [k*S]
        flat_gate = gate.t().reshape(-1)
        flat_token = torch.arange(num_tokens, device=x.device).repeat(self.top_k)
        one_hot = F.one_hot(flat_expert, n)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
        capacity = self.capacity(num_tokens)
        keep = position < capacity
        slot = flat_expert[keep] * capacity + position[keep]
        kept_token = flat_token[keep]

        # Kept on the device: the ledger accumulates there and syncs only at checkpoint time.
        self.tokens_per_expert = torch.bincount(flat_expert[keep], minlength=n).detach()
        self.tokens_assigned = num_tokens * self.top_k
        assignment_share = one_hot.float().mean(dim=0)  # fraction of (token, choice) pairs per expert
        self.aux_loss = n * (assignment_share * probs.mean(dim=0)).sum()

        dispatch = tokens.new_zeros(n * capacity, shape[-1]).index_copy(0, slot, tokens[kept_token])
        expert_out = self._run_experts(dispatch.view(n, capacity, -1)).reshape(n * capacity, -1)
        # Under autocast (``bf16-mixed``) the experts answer in bf16; their outputs are summed in the tokens' dtype.
        weighted = (expert_out[slot] * flat_gate[keep].unsqueeze(-1)).to(tokens.dtype)
        combined = tokens.new_zeros(num_tokens, shape[-1]).index_add(0, kept_token, weighted)
        return combined.view(shape)

    def _run_experts(self, dispatch: torch.Tensor) -> torch.Tensor:
        """``[N, capacity, d]`` in global expert order in, the experts' outputs in the same order out."""
        ep = self.topology.ep
        n_local = len(self.local_expert_ids)
        capacity, d = dispatch.shape[1], dispatch.shape[2]
        # Expert block p belongs to EP rank p, so chunk p of the flat buffer goes to EP rank p.
        received = all_to_all(dispatch, self.topology.ep_group).view(ep, n_local, capacity, d)
        outputs = [
            self.experts[str(e)](received[:, i].reshape(ep * capacity, d)).view(ep, capacity, d)
            for i, e in enumerate(self.local_expert_ids)
        ]
        local = torch.stack(outputs, dim=1).reshape(ep * n_local, capacity, d)
        return all_to_all(local, self.topology.ep_group)
