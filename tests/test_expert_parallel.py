"""Expert parallelism is real and exact: EP runs match a single-process run; replicas stay in sync."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning_run import cpu_trainer

from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule

# Capacity large enough that no token is dropped, so EP and non-EP routing agree exactly.
CFG = GPTMoEConfig(block_size=16, n_layer=2, n_embd=32, n_head=2, num_experts=4, top_k=2, capacity_factor=8.0)
BATCH = 8


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _ep_step(rank: int, world_size: int, ep: int, device: torch.device = torch.device("cpu")) -> dict:
    """One forward/backward on this rank's share of the batch on ``device``; dense grads averaged as DDP would.
    Returned on the CPU."""
    model = GPTMoE(CFG, ExpertParallelTopology.from_process_group(ep), seed=0).to(device)
    x, y = (t.to(device) for t in _batch())
    share = BATCH // world_size
    _, loss, _ = model(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])
    loss.backward()
    for name, p in model.named_parameters():
        if ".experts." not in name:
            dist.all_reduce(p.grad)
            p.grad /= world_size
    model.reduce_expert_gradients()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return {
        "loss": (mean_loss / world_size).cpu(),
        "grads": {n: p.grad.cpu() for n, p in model.named_parameters()},
        "experts": [layer.local_expert_ids for layer in model.moe_layers()],
    }


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "ep"), [(2, 2), (4, 2)])
def test_ep_loss_and_gradients_match_single_process(tmp_path: Path, world_size: int, ep: int) -> None:
    check_against_one_process(run_ranks(_ep_step, world_size, tmp_path, ep), world_size, ep)


def check_against_one_process(results: list[dict], world_size: int, ep: int) -> None:
    """The ranks' loss and gradients (:func:`_ep_step`) are one CPU process's; experts are disjoint within an EP group
    and replicated across groups."""
    reference = GPTMoE(CFG, seed=0)
    x, y = _batch()
    _, ref_loss, _ = reference(x, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    covered = set()
    for result in results:
        torch.testing.assert_close(result["loss"], ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
            covered.add(name)
    assert covered == set(ref_grads), "every parameter of the reference is held by some rank"
    # Within one EP group the ranks hold disjoint experts; across groups they are replicas.
    for r in range(world_size):
        assert results[r]["experts"] == results[r % ep]["experts"]
    held = [set(results[r]["experts"][0]) for r in range(ep)]
    assert set.union(*held) == set(range(CFG.num_experts)) and sum(map(len, held)) == CFG.num_experts


def _lightning_fit(rank: int, world_size: int, root: str) -> dict:
    module = GPTMoEModule(replace(CFG, capacity_factor=1.0), ep=world_size, seed=0)
    data = LMDataModule(DataConfig(batch_size=4), block_size=CFG.block_size, vocab_size=CFG.vocab_size)
    trainer = cpu_trainer(Path(root), 5, [], devices=world_size, gradient_clip_val=0.5, enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    model = module.model
    return {
        "experts": [layer.local_expert_ids for layer in model.moe_layers()],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "initial": {n: p.detach().clone() for n, p in GPTMoE(module.model_config, model.topology).named_parameters()},
    }


@pytest.mark.slow
def test_lightning_ep2_disjoint_experts_and_identical_dense_replicas(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(_lightning_fit, 2, tmp_path, str(tmp_path), init_process_group=False)
    experts0 = {e for layer in rank0["experts"] for e in layer}
    experts1 = {e for layer in rank1["experts"] for e in layer}
    assert experts0 and experts1 and not experts0 & experts1
    names0 = {n for n in rank0["params"] if ".experts." in n}
    names1 = {n for n in rank1["params"] if ".experts." in n}
    assert names0 and names1 and not names0 & names1, "expert parameter names carry distinct global ids"
    dense = [n for n in rank0["params"] if n not in names0]
    assert dense == [n for n in rank1["params"] if n not in names1]
    for name in dense:
        assert torch.equal(rank0["params"][name], rank1["params"][name]), f"dense replica {name} diverged"
    moved = [n for n in rank0["params"] if not torch.equal(rank0["params"][n], rank0["initial"][n])]
    assert len(moved) > len(rank0["params"]) // 2, "training changed the parameters"
