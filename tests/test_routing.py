"""Router counts without user code, and what happens where there are none: PLT unknown, never 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import cpu_trainer, moc_config
from test_persist_metrics import MetricsLog
from titan_moe import TitanMoE
from torch import nn
from torch.utils.checkpoint import checkpoint

from moc_lightning.config import DynamicKConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.routing import RouterTap, read_routing
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig


def test_read_routing_takes_indices_then_a_dispatch_mask_then_logits() -> None:
    indices = torch.tensor([[0, 3], [3, 1], [3, 0]])
    logits = torch.tensor([[5.0, 0, 0, 4], [0, 1, 0, 2], [9, 0, 0, 8]])
    counts, assigned = read_routing((logits, torch.rand(3, 2), indices), num_experts=4, k=2)
    assert counts.tolist() == [2, 1, 0, 3] and assigned == 6
    mask = torch.tensor([[[0, 1, 0, 0], [0, 0, 0, 0]]])  # Switch: the second token was dropped by capacity
    counts, assigned = read_routing((mask, torch.rand(1, 2, 1), torch.rand(1, 2, 4)), num_experts=4, k=1)
    assert counts.tolist() == [0, 1, 0, 0] and assigned == 2
    counts, assigned = read_routing(logits, num_experts=4, k=1)
    assert counts.tolist() == [2, 0, 0, 1] and assigned == 3
    sentinel = torch.tensor([[4, 1], [-1, 1]])  # ids outside [0, N): no expert of this layer
    assert read_routing(sentinel, num_experts=4, k=2)[0].tolist() == [0, 2, 0, 0]
    assert read_routing((torch.rand(3, 5), "x"), num_experts=4, k=2) is None


def _titan_hand_counts(model: TitanMoE, x: torch.Tensor, bias: bool = True) -> list[torch.Tensor]:
    """What each layer's router selects for ``x``, recomputed from the gate's logits (and the expert bias)."""
    counts, h = [], model.tok_embeddings(x)
    for layer in model.layers:
        moe, hidden = layer["moe"], layer["norm"](h)
        scores = torch.sigmoid(moe.router.gate(hidden.reshape(-1, hidden.shape[-1])))
        chosen = (scores + moe.expert_bias if bias else scores).topk(2, dim=-1).indices
        counts.append(torch.bincount(chosen.reshape(-1), minlength=8))
        h = h + moe(hidden)
    return counts


def test_titan_router_counts_follow_its_expert_bias_and_skip_eval_and_recomputed_forwards() -> None:
    torch.manual_seed(0)
    model = TitanMoE()
    for layer in model.layers:
        layer["moe"].expert_bias.copy_(torch.linspace(-1, 1, 8))  # large enough to change the selection
    tap = RouterTap(model, build_layout(model, None))
    x = torch.randint(0, 64, (2, 16))
    model.eval()
    with torch.no_grad():
        expected = _titan_hand_counts(model, x)
        without_bias = _titan_hand_counts(model, x, bias=False)
        model(x, x)  # eval: not counted
    assert not torch.equal(expected[0], without_bias[0]), "the bias must change what is selected"
    model.train()
    torch.manual_seed(1)
    loss = checkpoint(lambda ids: model(ids, ids).loss, x, use_reentrant=False)
    loss.backward()  # recomputes the forward inside backward: not counted again
    counts = tap.take()
    assert [c.tokens_per_expert.tolist() for c in counts] == [c.tolist() for c in expected]
    assert [c.tokens_assigned for c in counts] == [2 * 16 * 2] * 2
    assert [c.tokens_per_expert.tolist() for c in tap.take()] == [[0] * 8] * 2, "take() starts over"
    tap.close()
    model(x, x)
    assert [c.tokens_per_expert.sum().item() for c in tap.take()] == [0, 0]


def test_a_layer_that_reports_its_counts_is_read_without_moe_layers() -> None:
    """The protocol: the reference model's MoE layer sets tokens_per_expert/tokens_assigned in its forward."""
    holder = nn.Module()
    holder.model = GPTMoE(GPTMoEConfig(), ExpertParallelTopology())
    tap = RouterTap(holder, build_layout(holder, None))
    expected = [torch.zeros(8, dtype=torch.int64) for _ in holder.model.moe_layers()]
    for seed in range(2):
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
        holder.model(x, x)
        for total, layer in zip(expected, holder.model.moe_layers()):
            total += layer.tokens_per_expert
    counts = tap.take()
    assert [c.tokens_per_expert.tolist() for c in counts] == [t.tolist() for t in expected]
    assert [c.tokens_assigned for c in counts] == [2 * 2 * 32 * 2] * 2


def test_a_router_output_with_no_routing_in_it_makes_plt_unknown_not_zero() -> None:
    model = nn.Module()
    model.moe = nn.Module()
    model.moe.router = nn.Linear(4, 4)
    model.moe.router.top_k = 1
    model.moe.experts = nn.Module()
    model.moe.experts.w = nn.Parameter(torch.zeros(4, 4, 4))
    tap = RouterTap(model, build_layout(model, None))
    assert tap.unknown == {} and tap.take() is not None
    model.moe.router.register_forward_hook(lambda module, args, output: output[:, :3], prepend=True)  # not N wide
    model.moe.router(torch.zeros(2, 4))
    assert tap.take() is None
    assert "router 'moe.router' returned torch.float32 [2, 3]" in tap.unknown["moe"]


class Unrouted(nn.Module):
    """Stacked experts whose router is called ``selector``: nothing names it a router."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.moe = nn.Module()
        self.moe.selector = nn.Linear(16, 4)
        self.moe.experts = nn.Module()
        self.moe.experts.w = nn.Parameter(torch.randn(4, 16, 16) * 0.25)
        self.head = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        chosen = self.moe.selector(h).argmax(-1)
        h = h + torch.einsum("bsi,bsij->bsj", h, self.moe.experts.w[chosen])
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


class UnroutedModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Unrouted()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


class Crash(Exception):
    pass


class CrashAfter(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()
            raise Crash(f"killed after step {self.step}")


def test_without_a_router_plt_is_unknown_warned_once_not_logged_and_not_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = moc_config(tmp_path, k_snapshot=1, k_persist=1, every_n_train_steps=2, persist_every_n_snapshots=1)
    moc = MoCCheckpoint(config)
    log = MetricsLog()
    trainer = cpu_trainer(tmp_path / "run", 20, [moc, CrashAfter(5)], logger=log)
    with pytest.warns(UserWarning) as warned, pytest.raises(Crash):
        trainer.fit(UnroutedModule())
    unknown = [str(w.message) for w in warned if "PLT is unknown" in str(w.message)]
    assert len(unknown) == 1, unknown
    assert "no router counts for 1 MoE layer(s) (model.moe: no router found" in unknown[0]
    logged = {name for _, metrics in log.rows for name in metrics}
    assert "moc/k_snapshot" in logged and "moc/plt" not in logged

    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(tmp_path / "run", 6, [moc])
    with pytest.warns(UserWarning, match="PLT is unknown"):
        trainer.fit(UnroutedModule(), ckpt_path=moc.resume_target())
    assert moc.recovery is not None and moc.recovery.resume_step == 4 and moc.recovery.plt is None
    assert "PLT of this fault unknown (no router counts), accumulated PLT unknown" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "moc_recovery" / "rank0.json").read_text())["plt"] is None


@pytest.mark.parametrize("option", [{"dynamic_k": DynamicKConfig(enabled=True)}, {"selection": "load_aware"}])
def test_options_that_need_plt_are_refused_without_router_counts(tmp_path: Path, option: dict[str, Any]) -> None:
    config = moc_config(tmp_path, k_snapshot=1, k_persist=1, **option)
    trainer = cpu_trainer(tmp_path / "run", 2, [MoCCheckpoint(config)])
    name = "checkpoint.dynamic_k.enabled=true" if "dynamic_k" in option else "checkpoint.selection=load_aware"
    with pytest.raises(ValueError, match=rf"{name} need\(s\) router counts .* PLT is unknown: .*model\.moe: no router"):
        trainer.fit(UnroutedModule())


class TitanWithBlocks(L.LightningModule):
    """``moe_layers()`` returns the model's MoE blocks, which report no counts (and have no ``num_experts``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TitanMoE()

    def moe_layers(self) -> list[nn.Module]:
        return [layer["moe"] for layer in self.model.layers]

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(batch[0], batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


def test_moe_layers_without_counts_are_counted_by_their_routers(tmp_path: Path) -> None:
    moc = MoCCheckpoint(moc_config(tmp_path, k_snapshot=2, k_persist=1, every_n_train_steps=3))
    cpu_trainer(tmp_path / "run", 3, [moc]).fit(TitanWithBlocks())
    since_start = moc.engine.pec.ledger.tokens_since([[-1] * 8, [-1] * 8])
    assert [int(t.sum()) for t in since_start] == [3 * 4 * 16 * 2] * 2, "3 steps x 64 tokens x top-2, per layer"
