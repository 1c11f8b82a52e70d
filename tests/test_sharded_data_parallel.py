"""``trainer.data_parallel=fsdp2|hsdp``: FSDP2 ``fully_shard`` with expert parallelism under Lightning's
``ModelParallelStrategy`` trains as one process does (loss and weights, within float tolerance)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.hf import HFCausalLMModule
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import check_precision, check_shard_size

# No token dropped (capacity) and no auxiliary loss: the auxiliary loss is a product of per-rank means, so a rank's
# share of it is not the global one's, while the language-model loss of equal shares averages exactly.
CFG = GPTMoEConfig(
    block_size=16, n_layer=2, n_embd=32, n_head=2, num_experts=4, top_k=2, capacity_factor=8.0, aux_loss_coef=0.0
)
GLOBAL_BATCH = 8
STEPS = 3
CLIP = 0.05  # small enough that clipping scales every step: the global norm must be right


def _loader(rank: int, world_size: int) -> DataLoader:
    """This rank's share of ``STEPS`` global batches: sample ``i`` of each goes to rank ``i % world_size``."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS * GLOBAL_BATCH, CFG.block_size + 1), generator=g)[rank::world_size]
    return DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:])), batch_size=GLOBAL_BATCH // world_size)


class _Record(L.Callback):
    """Each step's loss on this rank, and the dtype of the weights an expert computes with."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.compute_dtypes: set[torch.dtype] = set()

    def on_fit_start(self, trainer: L.Trainer, module: GPTMoEModule) -> None:
        expert = next(iter(module.model.moe_layers()[0].experts.values()))
        expert.fc.register_forward_pre_hook(lambda m, _: self.compute_dtypes.add(m.weight.dtype))

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: dict, *_: object) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(rank: int, world_size: int, root: str, data_parallel: str, ep: int, shard: int | None, precision: str) -> dict:
    module = GPTMoEModule(
        CFG, ep=ep, seed=0, data_parallel=data_parallel, hsdp_shard_size=shard if data_parallel == "hsdp" else None
    )
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        precision=precision,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,  # each rank is given its share
        default_root_dir=root,
        callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=_loader(rank, world_size))
    params = dict(module.model.named_parameters())
    state = trainer.optimizers[0].state
    return {
        "losses": record.losses,
        "compute_dtypes": record.compute_dtypes,
        "weights": {n: p.full_tensor().detach().float() for n, p in params.items()},
        "sharded": {n: isinstance(p, DTensor) and p.to_local().numel() < p.numel() for n, p in params.items()},
        "mesh_sizes": {n: p.device_mesh.shape for n, p in params.items()},
        "state_dtypes": {t.dtype for s in state.values() for k, t in s.items() if k != "step"},
        "param_dtypes": {p.dtype for p in params.values()},
    }


def _moc_fit(world_size: int, root: str) -> dict:
    """What ``MoCCheckpoint`` does in a 2-step fit under hsdp with shard groups of 1 (every rank a whole replica):
    its snapshots' bytes, and per rank the bytes of the persist of every unit at fit end."""
    moc = MoCCheckpoint(CheckpointConfig(
        k_snapshot=2, k_persist=1, every_n_train_steps=1, storage=StorageConfig(url=Path(root, "moc").as_uri()),
        shm_root=f"{root}/shm",
    ))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
        callbacks=[moc],
    )
    module = GPTMoEModule(CFG, ep=1, data_parallel="hsdp", hsdp_shard_size=1)
    trainer.fit(module, train_dataloaders=_loader(0, world_size))
    final = moc.engine.stats.final_persist
    return {"snapshots": moc.engine.stats.snapshots, "written": final.bytes_written, "expected": final.expected_bytes}


def _fits(rank: int, world_size: int, root: str, runs: list[tuple], moc: bool = True) -> dict:
    """Every run in one launch of the ranks (a launch costs seconds of imports), then a fit with MoCCheckpoint."""
    fits = [_fit(rank, world_size, f"{root}/{i}", *run) for i, run in enumerate(runs)]
    return {"fits": fits, "moc": _moc_fit(world_size, f"{root}/moc") if moc else None}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in one process without Lightning: the module's optimizer, schedule and clipping."""
    module = GPTMoEModule(CFG, seed=0)
    module.configure_model()
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    losses = []
    for x, y in _loader(0, 1):
        _, loss = module.losses((x, y))
        loss.backward()
        module.configure_gradient_clipping(optimizer, CLIP, "norm")
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss))
    return losses, {n: p.detach() for n, p in module.model.named_parameters()}


def _check_against_reference(ranks: list[dict], reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, weights = reference
    mean_losses = [sum(r["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    assert mean_losses == pytest.approx(losses, rel=1e-5)
    gathered = {n: w for r in ranks for n, w in r["weights"].items()}  # each rank adds its EP group's experts
    assert sorted(gathered) == sorted(weights)
    for name, w in weights.items():
        torch.testing.assert_close(gathered[name], w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


RUNS_2 = [("fsdp2", 1, None, "32-true"), ("fsdp2", 2, None, "32-true"), ("hsdp", 1, 1, "32-true")]
"""(data_parallel, ep, hsdp_shard_size, precision) of each 2-rank fit."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("sharded2")
    return run_ranks(_fits, 2, root, str(root), RUNS_2 + [("fsdp2", 2, None, "bf16-mixed")], init_process_group=False)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(len(RUNS_2)), ids=[f"{r[0]}-ep{r[1]}-shard{r[2]}" for r in RUNS_2])
def test_two_ranks_train_as_one_process(two_ranks: list[dict], run: int) -> None:
    """FSDP2 with the experts sharded over 2 replicas (ep=1) or whole on their one holder (ep=2), and HSDP that
    only replicates (shard groups of 1): loss and every weight after 3 clipped steps equal one process's."""
    ranks = [r["fits"][run] for r in two_ranks]
    _check_against_reference(ranks, _reference())
    data_parallel, ep, _, _ = RUNS_2[run]
    dense = [n for n in ranks[0]["sharded"] if ".experts." not in n and n.endswith("weight")]
    if data_parallel == "fsdp2":
        assert all(ranks[0]["sharded"][n] for n in dense), "dense weights are sharded over the 2 ranks"
        expert_sharded = {v for n, v in ranks[0]["sharded"].items() if ".experts." in n and n.endswith("weight")}
        assert expert_sharded == {ep == 1}, "experts are sharded over their replicas, whole without replicas"
    else:
        assert ranks[0]["mesh_sizes"][dense[0]] == (2, 1) and not any(ranks[0]["sharded"].values())


@pytest.mark.slow
def test_fsdp2_bf16_mixed_computes_in_bf16_over_fp32_master_weights(two_ranks: list[dict]) -> None:
    """``trainer.precision=bf16-mixed`` under fsdp2 is FSDP2's MixedPrecisionPolicy: experts compute with bf16
    weights, the sharded parameters and the optimizer state stay fp32, and the loss stays near fp32's."""
    ranks = [r["fits"][len(RUNS_2)] for r in two_ranks]
    for rank in ranks:
        assert rank["compute_dtypes"] == {torch.bfloat16}
        assert rank["param_dtypes"] == {torch.float32} and rank["state_dtypes"] == {torch.float32}
    fp32 = [r["fits"][1] for r in two_ranks]
    for s in range(STEPS):
        bf16_loss = sum(r["losses"][s] for r in ranks) / 2
        assert bf16_loss == pytest.approx(sum(r["losses"][s] for r in fp32) / 2, rel=2e-2)


@pytest.mark.slow
def test_moc_checkpoint_under_hsdp_writes_each_replicated_byte_once(two_ranks: list[dict]) -> None:
    """A Lightning user keeps MoCCheckpoint under hsdp: it snapshots every step, and at fit end the two replicas split
    the persist of every unit, each writing a part, together every byte once. (The engine's round trips and
    resharding under hsdp: ``test_hsdp_checkpoint.py``.)"""
    written = [rank["moc"]["written"] for rank in two_ranks]
    for rank in two_ranks:
        assert rank["moc"]["snapshots"] == 2
        assert 0.3 * rank["moc"]["expected"] < rank["moc"]["written"] < 0.7 * rank["moc"]["expected"]
    assert sum(written) == two_ranks[0]["moc"]["expected"]


def test_the_sharded_modes_refuse_what_they_cannot_train() -> None:
    """Named options, clear errors: a shard size outside hsdp, a precision without fp32 master weights, an EP group
    across shard groups, and a model without a sharding plan."""
    with pytest.raises(ValueError, match="trainer.hsdp_shard_size is for trainer.data_parallel=hsdp"):
        GPTMoEModule(CFG, data_parallel="fsdp2", hsdp_shard_size=2)
    with pytest.raises(ValueError, match="trainer.precision='bf16-true' is not supported with .*fsdp2"):
        check_precision("bf16-true")
    with pytest.raises(ValueError, match=r"trainer.hsdp_shard_size=3 must be >= 1 and divide .* 4"):
        check_shard_size(4, 3, 1)
    with pytest.raises(ValueError, match=r"EP degree 4 .* must divide trainer.hsdp_shard_size=2"):
        check_shard_size(4, 2, 4)
    with pytest.raises(ValueError, match="trainer.data_parallel='fsdp2' is not supported with HFCausalLMModule; "):
        HFCausalLMModule(torch.nn.Linear(1, 1), data_parallel="fsdp2")


RUNS_4 = [("hsdp", 2, 2, "32-true"), ("hsdp", 1, 2, "32-true")]  # two fits keep 4 processes on 2 cores near 20 s


@pytest.mark.slow
def test_four_ranks_hsdp_trains_as_one_process(tmp_path: Path) -> None:
    """HSDP over 4 ranks in 2 shard groups of 2: dense weights on a (2, 2) mesh; experts with ep=2 whole in each shard
    group and replicated across (a (2, 1) mesh), with ep=1 sharded within a group and replicated across (2, 2). Loss
    and every weight after 3 clipped steps equal one process's. Failed on b13f259: gloo has no PREMUL_SUM (the
    experts' divide factor 4 is not their shard group's size), and with sums forced on the one-rank shard dimension
    of ep=2 the experts' gradients were 1/4 of one process's (torch divided twice)."""
    ranks = run_ranks(_fits, 4, tmp_path, str(tmp_path), RUNS_4, False, init_process_group=False)
    reference = _reference()
    expected_meshes = [((2, 2), (2, 1)), ((2, 2), (2, 2))]  # (dense, experts) per run
    for run, (dense, experts) in enumerate(expected_meshes):
        fits = [r["fits"][run] for r in ranks]
        _check_against_reference(fits, reference)
        meshes = {n: s for n, s in fits[0]["mesh_sizes"].items() if n.endswith("weight")}
        assert {s for n, s in meshes.items() if ".experts." not in n} == {dense}
        assert {s for n, s in meshes.items() if ".experts." in n} == {experts}
