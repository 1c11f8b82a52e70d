"""A tiny MoE with every kind of state a recovery must bring back, trained by hand.

- a dense BatchNorm (``running_mean``/``running_var`` and an int64 ``num_batches_tracked``),
- MoE layer 0 with one module per expert, each with a persistent per-expert buffer ``calls``; its last
  expert never receives a token, so it never has optimizer state,
- MoE layer 1 with stacked ``[E, ...]`` expert weights and a stacked ``[E]`` ``expert_bias`` buffer on the
  layer (torchtitan's load balancing bias), plus a non-persistent buffer that is not state,
- a frozen parameter that stays in the optimizer (no gradient, so no optimizer state).
"""

from __future__ import annotations

import torch
from torch import nn

N = 4
"""Experts per MoE layer."""
WIDTH = 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += x.shape[0]
        return self.fc(x)


class PerModuleMoE(nn.Module):
    """Top-1 over the first ``N - 1`` experts: expert ``N - 1`` is never routed to."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, N)
        self.experts = nn.ModuleList(Expert() for _ in range(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x)[:, : N - 1].argmax(-1)
        out = torch.zeros_like(x)
        for e in range(N - 1):
            mask = choice == e
            if mask.any():
                out[mask] = self.experts[e](x[mask])
        return x + out


class StackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, WIDTH, WIDTH) * 0.1)


class StackedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, N)
        self.experts = StackedExperts()
        self.register_buffer("expert_bias", torch.zeros(N))
        self.register_buffer("scratch", torch.zeros(N), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = (self.router(x) + self.expert_bias).argmax(-1)
        counts = torch.bincount(choice, minlength=N).float()
        with torch.no_grad():
            self.expert_bias += 0.01 * torch.sign(counts.mean() - counts)
            self.scratch.copy_(counts)
        return x + torch.einsum("bi,bij->bj", x, self.experts.w[choice])


class BufferedMoE(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.moe0 = PerModuleMoE()
        self.moe1 = StackedMoE()
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)
        with torch.no_grad():  # distinct buffers per seed, so a restore that misses one is seen
            for buffer in (self.norm.running_mean, self.moe1.expert_bias):
                buffer.copy_(torch.randn_like(buffer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.moe1(self.moe0(self.norm(self.embed(x))))
        return self.head(h + self.frozen(h))


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    """Every parameter, the frozen one included, as a user's ``model.parameters()`` optimizer has them."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a resumed run must have, by the model's own names (independent of any layout)."""
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            state[f"optim/{name}/{key}"] = value.clone()
    return state


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected), f"keys differ: {sorted(set(got) ^ set(expected))}"
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].device == value.device, key
        assert torch.equal(got[key], value), f"{key} differs"
