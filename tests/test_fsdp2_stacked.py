"""torchtitan's layout under FSDP2 (issue 12, item 5): a MoE whose experts are stacked ``[E, ...]`` tensors, sharded by
``fully_shard`` along dim 0, the expert dim, in the ``configure_model`` a Lightning user writes for
``ModelParallelStrategy``. Each rank then holds whole experts (rank ``r`` of 2 the rows ``[4r, 4r + 4)`` of 8), which
MoC checkpoints as the experts they are, nothing gathered.

The oracle is this file's own, not MoC's layout: every parameter's and optimizer tensor's local piece by torch's names
after every step, and the tokens each expert received, from hooks on the routers (:func:`titan_route`). After a crash
and a resume, each row of a stacked tensor must be what it was at the step MoC says its expert came from, every other
tensor what it was at the resume step, and PLT the hand count of eq. 7. The per-expert ``expert_bias`` buffer of each
MoE layer, which every rank holds whole, is routing state (DESIGN.md hard part 10: it comes back with the router, at the
resume step): it is what it was at the resume step on every rank, although half the experts come from an older step."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_run import Crash, moc_config
from safetensors.torch import load_file
from titan_moe import TitanMoE, titan_route
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.layout import build_layout
from moc_lightning.export.consolidate import consolidate
from moc_lightning.lightning.callback import MoCCheckpoint

VOCAB, SEQ, BATCH, N = 64, 16, 4, 8
CRASH_AFTER = 7
EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.w\d$")
EXPERT_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias$")

pytestmark = pytest.mark.xdist_group("fsdp2_stacked")


class ShardedTitan(L.LightningModule):
    """The torchtitan-style model, ``fully_shard`` per MoE layer and at the root over the data-parallel mesh."""

    def __init__(self, vocab: int = VOCAB, replicas: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TitanMoE(vocab=vocab, num_experts=N)
        self.replicas = replicas

    def configure_model(self) -> None:
        if self.device_mesh is None:  # one process, no ModelParallelStrategy: the same module unsharded
            return
        mesh = self.device_mesh["data_parallel"]
        if self.replicas > 1:  # HSDP: shard within groups of consecutive ranks, replicate across them
            shape = (self.replicas, mesh.size() // self.replicas)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for layer in self.model.layers:
            fully_shard(layer["moe"], mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens = torch.randint(2, VOCAB, (BATCH * 64, SEQ), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


class Oracle(L.Callback):
    """This rank's piece of every parameter, buffer and optimizer tensor by torch's names after every step, the tokens
    each expert received in each step (this rank's), and a crash after ``crash_after``."""

    def __init__(self, crash_after: int | None) -> None:
        self.crash_after = crash_after
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, list[torch.Tensor]] = {}
        self._pending = [torch.zeros(N, dtype=torch.int64) for _ in range(2)]

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for i, layer in enumerate(module.model.layers):
            layer["moe"].router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int) -> Any:
        def hook(router: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if router.training:
                self._pending[layer] += torch.bincount(titan_route(router, args, output).reshape(-1), minlength=N)

        return hook

    def _record(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        state = {name: _local(t) for name, t in module.model.named_parameters()}
        state |= {name: _local(t) for name, t in module.model.named_buffers() if "tokens_per_expert" not in name}
        params = dict(module.model.named_parameters())
        optimizer = trainer.optimizers[0]
        for name, param in params.items():
            state |= {f"{name}/{k}": _local(v) for k, v in optimizer.state.get(param, {}).items()}
        self.states[trainer.global_step] = state

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._record(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()
        self.counts[trainer.global_step] = self._pending
        self._pending = [torch.zeros_like(c) for c in self._pending]
        self._record(trainer, module)
        if trainer.global_step == self.crash_after:
            raise Crash(f"killed after step {trainer.global_step}")


def _fit_titan(
    module: ShardedTitan, root: str, world: int, max_steps: int, config: CheckpointConfig, crash_after: int | None
) -> tuple[Oracle, MoCCheckpoint]:
    """Fit ``module`` on ``world`` ranks (``ModelParallelStrategy``; one process: Lightning's default) under MoC with
    ``config``, resuming where MoC says, until ``max_steps`` or the oracle's crash."""
    moc, oracle = MoCCheckpoint(config), Oracle(crash_after)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=max_steps, callbacks=[moc, oracle],
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if world > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=f"{root}/run",
    )
    try:
        trainer.fit(module, ckpt_path=moc.resume_target())
    except Crash:
        pass
    return oracle, moc


def _fit(
    root: str, world: int, max_steps: int, crash_after: int | None = None, replicas: int = 1
) -> tuple[Oracle, MoCCheckpoint]:
    config = moc_config(Path(root), k_snapshot=4, k_persist=4, every_n_train_steps=2, persist_every_n_snapshots=1)
    return _fit_titan(ShardedTitan(replicas=replicas), root, world, max_steps, config, crash_after)


def _crash_and_resume(rank: int, world_size: int, root: str, level: str, replicas: int) -> dict:
    first, _ = _fit(root, world_size, 20, CRASH_AFTER, replicas)
    dist.barrier()
    if level == "storage" and rank == 0:
        shutil.rmtree(Path(root, "shm"))
    dist.barrier()
    second, moc = _fit(root, world_size, CRASH_AFTER + 1, replicas=replicas)
    report = moc.recovery
    return {"first": first.states, "counts": first.counts, "restored": second.states[report.resume_step],
            "resume": report.resume_step, "sources": dict(report.sources), "plt": report.plt}


@pytest.mark.parametrize(
    ("level", "world", "replicas"), [("memory_local", 2, 1), ("storage", 2, 1), ("storage", 4, 2)],
    ids=["fsdp2-memory", "fsdp2-storage", "hsdp-storage"],
)
def test_stacked_dtensor_experts_recover_each_row_from_its_experts_source_step(
    tmp_path: Path, level: str, world: int, replicas: int
) -> None:
    """Under FSDP2 over 2 ranks, and under HSDP over 4 (2 replica groups of 2, whose persist splits each piece's
    writing over its replicas)."""
    ranks = run_ranks(_crash_and_resume, world, tmp_path, str(tmp_path), level, replicas, init_process_group=False)
    shards = world // replicas
    resume = ranks[0]["resume"]
    assert resume == 6 and {s["level"] for s in ranks[0]["sources"].values()} == {level}
    sources = {key: s["step"] for key, s in ranks[0]["sources"].items()}
    experts = {key: step for key, step in sources.items() if key.startswith("expert/")}
    assert sorted(experts) == sorted(f"expert/L{layer}/E{e}" for layer in range(2) for e in range(N))
    assert set(experts.values()) == {4, 6}, "PEC: some experts come from the older snapshot"
    assert {step for key, step in sources.items() if not key.startswith("expert/")} == {resume}

    # eq. 7 from the hand counts over both ranks: tokens routed to each expert after its source step
    counts = {t: [sum(r["counts"][t][layer] for r in ranks) for layer in range(2)] for t in range(1, resume + 1)}
    lost = [
        sum(int(counts[t][layer][e]) for e in range(N) for t in range(experts[f"expert/L{layer}/E{e}"] + 1, resume + 1))
        / sum(int(counts[t][layer].sum()) for t in range(1, resume + 1))
        for layer in range(2)
    ]
    assert sum(lost) > 0
    for rank in ranks:
        assert rank["plt"] == pytest.approx(sum(lost) / len(lost), rel=1e-12, abs=0)

    for rank, got in enumerate(ranks):
        before, restored = got["first"], got["restored"]
        assert restored.keys() == before[resume].keys()
        for name, tensor in restored.items():
            if EXPERT_BIAS.match(name):  # routing state: a restore from the experts' older steps would show
                assert not torch.equal(before[min(experts.values())][name], before[resume][name]), (name, "must move")
            m = EXPERT.match(name.split("/")[0])
            if m is None:
                assert torch.equal(tensor, before[resume][name]), (rank, name)
                continue
            rows = N // shards
            steps = [experts[f"expert/L{m[1]}/E{rank % shards * rows + j}"] for j in range(rows)]
            if tensor.dim() == 0:  # Adam's step, one for all experts of the tensor: the newest of theirs
                assert torch.equal(tensor, before[max(steps)][name]), (rank, name)
                continue
            assert tensor.shape[0] == rows
            for j, step in enumerate(steps):
                assert torch.equal(tensor[j], before[step][name][j]), (rank, name, j, step)


def _train(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    """4 steps: the fit ends with a persist of every unit at step 4; this rank's pieces then."""
    oracle, _ = _fit(root, world_size, 4)
    return oracle.states[4]


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    oracle, moc = _fit(root, world_size, 5)
    return {"resume": moc.recovery.resume_step, "start": oracle.states[moc.recovery.resume_step]}


def _joined(ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole tensors, from the ranks' pieces along dim 0 (a scalar, or the replicated ``expert_bias``, from rank 0)."""
    return {
        name: tensor if tensor.dim() == 0 or "expert_bias" in name else torch.cat([r[name] for r in ranks])
        for name, tensor in ranks[0].items()
    }


def test_stacked_dtensor_experts_reshard_from_2_to_4_ranks_and_1_process_and_consolidate(tmp_path: Path) -> None:
    """Two FSDP2 ranks' pieces (4 whole experts of 8 per rank) -> four ranks (2 each), and -> one process without
    ``ModelParallelStrategy``: each resume starts from the tensors the two ranks held, bitwise, joined along dim 0, and
    every rank holds the whole ``expert_bias`` (a dense buffer each rank loads whole); ``moc-consolidate`` writes the
    same weights into the dense model's state dict."""
    trained = run_ranks(_train, 2, tmp_path, str(tmp_path), init_process_group=False)
    assert all(torch.equal(r["layers.0.moe.expert_bias"], trained[0]["layers.0.moe.expert_bias"]) for r in trained)
    whole = _joined(trained)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "one" / "ckpt")  # the 2-rank checkpoint, before any resume

    consolidate((tmp_path / "ckpt").as_uri(), tmp_path / "dense.safetensors", "safetensors", progress=False)
    dense = load_file(tmp_path / "dense.safetensors")
    model = {name: t for name, t in whole.items() if "/" not in name}
    assert {name.removeprefix("model.") for name in dense} == set(model)
    for name, tensor in dense.items():
        assert torch.equal(tensor, model[name.removeprefix("model.")]), name

    shutil.rmtree(tmp_path / "shm")  # other nodes: the slots hold pieces of a world of 2
    for world, root in ((4, tmp_path), (1, tmp_path / "one")):
        resumed = run_ranks(_resume, world, root / f"world{world}", str(root), init_process_group=False)
        assert {r["resume"] for r in resumed} == {4}
        for r in resumed:
            for name in ("layers.0.moe.expert_bias", "layers.1.moe.expert_bias"):
                assert torch.equal(r["start"][name], whole[name]), (world, name)
        start = _joined([r["start"] for r in resumed])
        assert start.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(start[name], tensor), (world, name)


class StatefulTitan(ShardedTitan):
    """With a loader that resumes where it stopped (replay needs the batches again) over the byte corpus."""

    def __init__(self) -> None:
        super().__init__(vocab=256)

    def train_dataloader(self) -> Any:
        data = LMDataModule(DataConfig(batch_size=BATCH), block_size=SEQ, vocab_size=256)
        data.setup("fit")
        return data.train_dataloader()


def _replay_fit(root: str, world: int, crash_after: int | None) -> tuple[Oracle, MoCCheckpoint]:
    config = moc_config(Path(root), mode="replay", replay=ReplayConfig(window=3))
    return _fit_titan(StatefulTitan(), root, world, 9, config, crash_after)


def _replayed(rank: int, world_size: int, root: str, crash: int) -> dict[str, Any]:
    straight, _ = _replay_fit(f"{root}/straight", world_size, None)
    _replay_fit(f"{root}/faulty", world_size, crash)
    resumed, moc = _replay_fit(f"{root}/faulty", world_size, None)
    return {"straight": straight.states[9], "resumed": resumed.states[9], "report": moc.replay_report}


def test_replay_of_stacked_dtensor_experts_ends_bitwise_on_the_uninterrupted_state(tmp_path: Path) -> None:
    crash = random.Random(int(os.environ.get("MOC_REPLAY_SEED", "14"))).randrange(4, 9)
    print(f"crash after step {crash}")
    for rank, got in enumerate(run_ranks(_replayed, 2, tmp_path, str(tmp_path), crash, init_process_group=False)):
        assert got["report"] is not None and got["report"].plt == 0.0 and got["report"].replay_iterations >= 1
        assert got["resumed"].keys() == got["straight"].keys()
        differ = [k for k, v in got["straight"].items() if not torch.equal(got["resumed"][k], v)]
        assert differ == [], (rank, differ)


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    """The message ``build_layout`` refuses each stack with: a flattened ``[E*I, H]`` stack (DBRX's) of 3 experts of
    2 rows whose 6 rows ``fully_shard`` splits 3 and 3, and a ``[E, ...]`` stack sharded along dim 1."""
    mesh = init_device_mesh("cpu", (world_size,))
    messages = {}
    for case, shape, placement in (("split", (6, 4), Shard(0)), ("dim1", (3, 4, 4), Shard(1))):
        layer = nn.Module()
        layer.router = nn.Linear(4, 3, bias=False)
        layer.experts = nn.Module()
        if case == "split":
            layer.experts.mlp = nn.Module()
            holder = layer.experts.mlp
        else:
            holder = layer.experts
        holder.w1 = nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [placement]))
        model = nn.ModuleDict({"ffn": layer})
        with pytest.raises(ValueError) as refused:
            build_layout(model, None)
        messages[case] = str(refused.value)
    return messages


def test_a_stack_whose_pieces_are_not_whole_experts_is_refused_by_name(tmp_path: Path) -> None:
    for messages in run_ranks(_refusals, 2, tmp_path):
        assert "'ffn.experts.mlp.w1'" in messages["split"] and "splits an expert of 2 rows" in messages["split"]
        assert "'ffn.experts.w1'" in messages["dim1"] and "Shard(dim=1)" in messages["dim1"]
