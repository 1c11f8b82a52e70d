"""A tiny GPT-MoE trained by hand, step by step, recording the router counts a test checks PLT against."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.pieces import piece
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.models.sharded import data_parallel_meshes, shard_gpt_moe
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.sharding.zero import ZeroAdamW, partition_by_units
from moc_lightning.storage import make_storage

TINY = GPTMoEConfig()  # conf/model/tiny.yaml: 4 blocks, 2 MoE layers, N=8, top-2
BATCH = 8


class Trainee:
    """A model, its optimizer and the router counts of every step, as a test records them by hand. ``zero``:
    ZeRO-2 (:class:`ZeroAdamW`, each parameter's state on one of its holders) instead of DDP's replicated state;
    ``fsdp2``: FSDP2 ``fully_shard`` over all ranks (parameters and optimizer state are DTensors), or with
    ``shard_size`` HSDP: sharded within groups of that many consecutive ranks, replicated across the groups."""

    def __init__(
        self,
        topology: ExpertParallelTopology,
        seed: int = 0,
        zero: bool = False,
        fsdp2: bool = False,
        shard_size: int | None = None,
        config: GPTMoEConfig = TINY,
    ) -> None:
        self.config = config
        self.model = GPTMoE(config, topology, seed=seed)
        self.fsdp2 = fsdp2
        if fsdp2:
            shards = shard_size or topology.world_size
            dense, experts = data_parallel_meshes(topology.world_size, shards, topology.ep, "cpu")
            shard_gpt_moe(self.model, dense, experts, MixedPrecisionPolicy())
        if zero:
            partition = partition_by_units(build_layout(self.model, None, expert_parallel=topology.ep), topology)
            self.optimizer: torch.optim.Optimizer = ZeroAdamW(self.model.parameters(), partition, lr=1e-2)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.counts: list[list[torch.Tensor]] = []  # per step, per MoE layer: global tokens per expert
        self.assigned: list[list[int]] = []

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 256, (BATCH, self.config.block_size + 1), generator=g)
        topo = self.model.topology
        share = BATCH // topo.world_size
        mine = tokens[topo.rank * share : (topo.rank + 1) * share]
        _, loss, _ = self.model(mine[:, :-1], mine[:, 1:])
        self.optimizer.zero_grad()
        loss.backward()
        if not self.fsdp2:  # FSDP2 has reduce-scattered every gradient in backward
            for name, p in self.model.named_parameters():
                if ".experts." not in name and topo.world_size > 1:
                    dist.all_reduce(p.grad)
                    p.grad /= topo.world_size
            self.model.reduce_expert_gradients()
        self.optimizer.step()
        counts, assigned = [], []
        for layer in self.model.moe_layers():
            c = layer.tokens_per_expert.clone()
            a = torch.tensor(layer.tokens_assigned)
            if topo.world_size > 1:
                dist.all_reduce(c)
                dist.all_reduce(a)
            counts.append(c)
            assigned.append(int(a))
        self.counts.append(counts)
        self.assigned.append(assigned)

    def engine(self, cfg: CheckpointConfig, url: str) -> PECCheckpointer:
        layout = build_layout(self.model, self.optimizer, num_experts=self.config.num_experts)
        return PECCheckpointer(cfg, layout, self.model.topology, make_storage(cfg.storage.backend, url))

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's tensors of every unit it holds (of a DTensor, its local piece)."""
        layout = build_layout(self.model, self.optimizer, num_experts=self.config.num_experts)
        return {k: piece(v).clone() for k, v in layout.tensors().items()}

    def full_snapshot(self) -> dict[str, torch.Tensor]:
        """As :meth:`snapshot`, a DTensor all-gathered whole (collective): a test's oracle, never a checkpoint's."""
        layout = build_layout(self.model, self.optimizer, num_experts=self.config.num_experts)
        return {k: (v.full_tensor() if v is not piece(v) else v).clone() for k, v in layout.tensors().items()}


def every_step_config(k_snapshot: int, k_persist: int, **kw) -> CheckpointConfig:
    """A checkpoint at every step, each persisted. Its first persist is PEC's too (unless ``kw`` says otherwise):
    the tests that drive the engine by hand check PEC's own rotation, bytes (eq. 6) and PLT from the first
    checkpoint on; the complete first persist has its own tests (``test_complete_first_persist.py``)."""
    return CheckpointConfig(
        **{"k_snapshot": k_snapshot, "k_persist": k_persist, "every_n_train_steps": 1, "persist_every_n_snapshots": 1,
           "complete_first_persist": False, **kw}
    )




def train_and_checkpoint(
    rank: int,
    world_size: int,
    url: str,
    ep: int | None = None,
    backend: str = "filesystem",
    zero: bool = False,
    fsdp2: bool = False,
    pec_scope: str = "both",
    shard_size: int | None = None,
    guard: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> dict:
    """Six steps with PEC checkpoints (K=4 of 8, ``pec_scope``) at steps 2 and 4, which save disjoint expert subsets.

    ``captured``: this rank's tensors at each checkpoint (local pieces under ``fsdp2``), ``reports`` what each
    checkpoint wrote; under ``fsdp2`` also
    ``captured_full``, the whole tensors (all-gathered for the test's oracle). ``shard_size``: HSDP's (with
    ``fsdp2``); each checkpoint runs inside ``guard()`` (a test's tripwire)."""
    topology = ExpertParallelTopology.from_process_group(ep if world_size > 1 else None)
    trainee = Trainee(topology, zero=zero, fsdp2=fsdp2, shard_size=shard_size)
    engine = trainee.engine(every_step_config(4, 4, storage=StorageConfig(backend=backend), pec_scope=pec_scope), url)
    captured, full, saved, reports = {}, {}, {}, {}
    for step in range(1, 7):
        trainee.step(step)
        engine.record_tokens(trainee.model.moe_layers())
        if step in (2, 4):
            with guard():
                report = engine.checkpoint(step)
            captured[step] = trainee.snapshot()
            if fsdp2:
                full[step] = trainee.full_snapshot()
            saved[step] = [u for u in report.units if u.startswith("expert/")]
            reports[step] = report
    result = {
        "captured": captured, "saved": saved, "reports": reports, "counts": trainee.counts, "assigned": trainee.assigned
    }
    return result | ({"captured_full": full} if fsdp2 else {})


def load_fresh(
    rank: int,
    world_size: int,
    url: str,
    ep: int | None = None,
    backend: str = "filesystem",
    zero: bool = False,
    fsdp2: bool = False,
    shard_size: int | None = None,
) -> dict:
    """A differently initialised model restored from storage: what it loaded (local pieces under ``fsdp2``, and in
    ``loaded_full`` the whole tensors, all-gathered for the test's oracle) and from which steps. ``shard_size``:
    HSDP's (with ``fsdp2``)."""
    topology = ExpertParallelTopology.from_process_group(ep if world_size > 1 else None)
    fresh = Trainee(topology, seed=1, zero=zero, fsdp2=fsdp2, shard_size=shard_size)
    load = fresh.engine(every_step_config(4, 4, storage=StorageConfig(backend=backend)), url).load_latest()
    result = {"loaded": fresh.snapshot(), "sources": load.sources, "plt": load.plt}
    return result | ({"loaded_full": fresh.full_snapshot()} if fsdp2 else {})
