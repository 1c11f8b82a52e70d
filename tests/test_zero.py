"""ZeRO-2 (``trainer.data_parallel=zero2``): the partition is by unit, and training matches one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from buffered_model import BufferedMoE, train
from dist_utils import run_ranks
from torch import nn
from trainee import every_step_config

from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.units import parse_unit
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.sharding.zero import MASTER_DTYPE, ZeroAdamW, partition_by_units
from moc_lightning.storage import make_storage

# Capacity large enough that no token is dropped, so EP and non-EP routing agree exactly.
CFG = GPTMoEConfig(block_size=16, n_layer=2, n_embd=32, n_head=2, num_experts=4, top_k=2, capacity_factor=8.0)
BATCH = 8
STEPS = 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _optimizer(model: GPTMoE, cls: type[torch.optim.AdamW], **kw: object) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return cls(groups, lr=1e-2, betas=(0.9, 0.95), **kw)


def _train(rank: int, world_size: int, ep: int, dtype: torch.dtype, zero: bool = True, url: str | None = None) -> dict:
    """STEPS steps on this rank's share of each batch; dense gradients averaged as DDP would. ``zero=False``:
    torch's AdamW on every rank, as under DDP. With ``url``, then one K=1 persist there (:func:`_persist`), one
    under each partial ``pec_scope`` beside it (``<url>_<scope>``) and one with ``checkpoint.sharding=equal``
    (``<url>_equal``)."""
    topology = ExpertParallelTopology.from_process_group(ep)
    model = GPTMoE(CFG, topology, seed=0).to(dtype)
    if zero:
        partition = partition_by_units(build_layout(model, None, expert_parallel=topology.ep), topology)
        optimizer = _optimizer(model, ZeroAdamW, partition=partition)
    else:
        optimizer = _optimizer(model, torch.optim.AdamW)
    share = BATCH // world_size
    for x, y in _batches():
        _, loss, _ = model(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])
        loss.backward()
        for name, p in model.named_parameters():
            if ".experts." not in name and world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= world_size
        model.reduce_expert_gradients()
        optimizer.step()
        optimizer.zero_grad()
    names = {p: n for n, p in model.named_parameters()}
    return {
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "state": {names[p]: {k: (v.dtype, tuple(v.shape)) for k, v in s.items()} for p, s in optimizer.state.items()},
        **(_persist(model, optimizer, url) if url else {}),
        **({"scopes": {s: _persist(model, optimizer, f"{url}_{s}", s) for s in PARTIAL_SCOPES}} if url else {}),
        **({"equal": _persist(model, optimizer, f"{url}_equal", sharding="equal")} if url else {}),
    }


PARTIAL_SCOPES = ("optimizer", "weights")
"""``checkpoint.pec_scope`` values besides ``both``, whose K=1 persists :func:`_train` also writes."""


def _persist(
    model: GPTMoE, optimizer: torch.optim.Optimizer, url: str, scope: str = "both", sharding: str = "adaptive"
) -> dict:
    """One K=1 persist under ``pec_scope=scope`` and ``checkpoint.sharding=sharding``: the bytes this rank wrote
    (as it reports them, and as its data file holds them, optimizer state apart), what it keeps the optimizer state
    of, whether every weight it wrote is of a unit it holds, and eq. 6."""
    layout = build_layout(model, optimizer, expert_parallel=model.topology.ep)
    storage = make_storage("filesystem", url)
    engine = PECCheckpointer(
        every_step_config(1, 1, pec_scope=scope, sharding=sharding), layout, model.topology, storage,
        process_group=None,
    )
    engine.record_tokens(model.moe_layers())
    report = engine.checkpoint(STEPS)
    rank = model.topology.rank
    kept = [u for u in layout.units if engine.plan.state_owners[u.key] == rank]
    units = [u for u in kept if u.key in report.units]
    parts = engine.plan.partial_parts([parse_unit(key) for key in report.units])
    with_state = [u for u in kept if u.key in report.units or f"{u.key}/optimizer" in parts]
    items = storage.reader(report.name).read_metadata().storage_data
    mine = {index.fqn: info.length for index, info in items.items() if info.relative_path.startswith(f"__{rank}_")}
    return {
        "written": report.bytes_written,
        "file": sum(mine.values()),
        "file_optimizer": sum(n for key, n in mine.items() if "/optim/" in key),
        "kept": sum(layout.unit_bytes(u).total for u in units),
        "kept_optimizer": sum(layout.unit_bytes(u).optimizer for u in with_state),
        "writes_only_held": all(parse_unit(key) in layout.slots for key in mine),
        "c_pec": engine.size_model().c_pec(1, scope),
        "expected": report.expected_bytes,
    }


def _reference() -> dict[str, torch.Tensor]:
    model = GPTMoE(CFG, seed=0)
    optimizer = _optimizer(model, torch.optim.AdamW)
    for x, y in _batches():
        _, loss, _ = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("world", "ep"), [(4, 2), (2, 1)])
def test_the_partition_gives_every_unit_one_owner_among_its_holders(world: int, ep: int) -> None:
    """Computed on each rank alone: the dense owners agree, expert owners agree among replicas, loads balance."""
    answers = []
    for rank in range(world):
        topology = ExpertParallelTopology(world_size=world, rank=rank, ep=ep)
        layout = build_layout(GPTMoE(CFG, topology, seed=0), None, expert_parallel=ep)
        answers.append({u.key: r for u, r in partition_by_units(layout, topology).unit_owners(layout).items()})
    for rank, owners in enumerate(answers):
        assert {k: r for k, r in owners.items() if not k.startswith("expert/")} == {
            k: r for k, r in answers[0].items() if not k.startswith("expert/")
        }
        assert owners == {**owners, **{k: r for k, r in answers[rank % ep].items() if k.startswith("expert/")}}
        for key, owner in owners.items():
            if key.startswith("expert/"):
                assert owner % ep == rank % ep, f"{key} is owned by a rank that does not hold it"
    assert len({r for owners in answers for r in owners.values()}) == world, "every rank owns some state"


def _modes(rank: int, world_size: int, ep: int, url: str) -> dict:
    """One launch of the ranks for every mode the tests compare (a launch costs seconds of imports)."""
    return {
        "zero": _train(rank, world_size, ep, torch.float32),
        "ddp": _train(rank, world_size, ep, torch.float32, False),
        "zero_bf16": _train(rank, world_size, ep, torch.bfloat16, url=url),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """4 ranks in 2 EP groups: dense state partitioned over 4 ranks, each expert's over its 2 replicas."""
    root = tmp_path_factory.mktemp("zero")
    return run_ranks(_modes, 4, root, 2, (root / "ckpt").as_uri())


@pytest.mark.slow
def test_zero2_trains_as_ddp_and_one_process_do(four_ranks: list[dict]) -> None:
    """Bitwise as DDP with the same gradients (ZeRO moves the state, not the arithmetic); as one process within
    what Adam makes of float rounding in the averaged gradients (its update divides by sqrt(v): about 2e-5 here)."""
    reference = _reference()
    owned: dict[str, int] = {}
    for rank, result in enumerate(four_ranks):
        zero, ddp = result["zero"], result["ddp"]
        for name, tensor in zero["params"].items():
            assert torch.equal(tensor, ddp["params"][name]), f"{name} on rank {rank} differs from DDP's"
            torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-4, msg=f"{name} on rank {rank}")
        for name in zero["state"]:
            owned[name] = owned.get(name, 0) + 1
        assert len(ddp["state"]) == len(ddp["params"]), "under DDP every rank holds every state"
    # a dense parameter's state on one of the 4 ranks; an expert's (named by its global id) on one of its 2 replicas
    assert owned == {name: 1 for name in reference}, "each parameter's optimizer state lives on exactly one rank"


@pytest.mark.slow
def test_bf16_replicas_stay_equal_and_keep_fp32_state(four_ranks: list[dict]) -> None:
    """2 bytes of weight and 12 of optimizer state per parameter, as in the paper's accounting."""
    for rank, result in enumerate(four_ranks):
        run = result["zero_bf16"]
        for name, tensor in run["params"].items():
            twin = four_ranks[rank % 2 if ".experts." in name else 0]["zero_bf16"]["params"][name]
            assert torch.equal(tensor, twin), f"{name} differs between its holders"
        for name, state in run["state"].items():
            assert {k: v[0] for k, v in state.items()} == {
                "step": MASTER_DTYPE, "master": MASTER_DTYPE, "exp_avg": MASTER_DTYPE, "exp_avg_sq": MASTER_DTYPE
            }, name
            assert state["master"][1] == tuple(run["params"][name].shape)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["adaptive", "equal"])
def test_a_k1_persist_splits_the_replicated_weights_and_each_owner_writes_its_state(
    four_ranks: list[dict], sharding: str
) -> None:
    """bf16 weights and fp32 master + moments (the paper's 2 + 12 bytes). The optimizer state of a unit is on its
    ZeRO owner only, and that rank writes it; the weights are replicated over their holders, so ownership splits
    them over the holders as under DDP (``checkpoint.sharding``), and the busiest rank writes less than when each
    owner wrote its units whole. Each rank's data file holds exactly what it reports; summed over ranks, the
    bytes match eq. 6 at K=1 within 1%."""
    runs = [r["zero_bf16"] if sharding == "adaptive" else r["zero_bf16"]["equal"] for r in four_ranks]
    for rank, run in enumerate(runs):
        assert run["written"] == run["file"] > 0, f"rank {rank} reports other bytes than its data file holds"
        assert run["file_optimizer"] == run["kept_optimizer"] > 0, f"rank {rank} wrote other state than it keeps"
        assert run["writes_only_held"], f"rank {rank} wrote a weight of a unit it does not hold"
    written = [run["written"] for run in runs]
    weights = [run["written"] - run["file_optimizer"] for run in runs]
    whole = [run["kept"] for run in runs]
    total = sum(written)
    c_pec = runs[0]["c_pec"]
    print(f"ZeRO-2 bf16 K=1 persist, sharding={sharding}: per rank {written} bytes (optimizer state "
          f"{[r['file_optimizer'] for r in runs]} + weights {weights}); owners writing their units whole: {whole}; "
          f"busiest {max(written)} vs {max(whole)}; {total} in all, eq. 6 {c_pec:.0f}")
    assert sum(w > 0 for w in weights) > 1, "the replicated weights are split over their holders"
    assert max(written) < max(whole), "splitting the weights lightens the busiest rank"
    assert total == pytest.approx(c_pec, rel=0.01)
    assert all(run["c_pec"] == c_pec and run["expected"] == total for run in runs), "every rank sees the same eq. 6"


@pytest.mark.slow
def test_adaptive_counts_each_owners_optimizer_state_when_it_places_the_weights(four_ranks: list[dict]) -> None:
    """``adaptive`` fills the ranks the optimizer partitions and the expert selection leave light: its busiest rank
    writes no more than ``equal``'s, which places the dense weights ignoring everything else."""
    adaptive = max(r["zero_bf16"]["written"] for r in four_ranks)
    equal = max(r["zero_bf16"]["equal"]["written"] for r in four_ranks)
    print(f"ZeRO-2 bf16 K=1 persist, busiest rank: adaptive {adaptive} bytes, equal {equal}")
    assert adaptive <= equal


@pytest.mark.slow
@pytest.mark.parametrize("scope", PARTIAL_SCOPES)
def test_a_k1_persist_under_each_pec_scope_matches_its_eq6_over_ranks(four_ranks: list[dict], scope: str) -> None:
    """``pec_scope=optimizer``/``weights`` in the paper's setting (ZeRO-2, bf16 + fp32 state): each rank writes the
    optimizer state it keeps and its share of the replicated weights, every expert's non-PEC part included; summed
    over ranks, eq. 6 of the scope."""
    runs = [r["zero_bf16"]["scopes"][scope] for r in four_ranks]
    for rank, run in enumerate(runs):
        assert run["written"] == run["file"] and run["writes_only_held"], f"rank {rank}"
        assert run["file_optimizer"] == run["kept_optimizer"], f"rank {rank} wrote other state than it keeps"
    total = sum(run["written"] for run in runs)
    c_pec = runs[0]["c_pec"]
    print(f"ZeRO-2 bf16 K=1 pec_scope={scope}: {[r['written'] for r in runs]} bytes per rank, {total} in all; "
          f"eq. 6 {c_pec:.0f}")
    assert total == pytest.approx(c_pec, rel=0.01)
    assert all(run["c_pec"] == c_pec and run["expected"] == total for run in runs), "every rank sees the same eq. 6"


def test_a_bf16_step_is_fp32_adamw_on_the_master_rounded_into_the_weight() -> None:
    model = GPTMoE(CFG, seed=0)
    low = GPTMoE(CFG, seed=0).to(torch.bfloat16)
    full = _optimizer(model, torch.optim.AdamW)
    topology = ExpertParallelTopology()
    zero = _optimizer(low, ZeroAdamW, partition=partition_by_units(build_layout(low, None), topology))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))  # the same starting point as the bf16 model's master
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        for p, q in zip(model.parameters(), low.parameters()):
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            p.grad, q.grad = grad.float(), grad
        full.step()
        zero.step()
    for (name, p), q in zip(model.named_parameters(), low.parameters()):
        master = zero.state[q]["master"]
        assert torch.equal(master, p.detach()), f"{name}: the master is not fp32 AdamW's result"
        assert torch.equal(q.detach(), master.to(torch.bfloat16)), f"{name}: the weight is not its rounded master"


def test_a_unit_of_buffers_alone_has_an_owner_and_round_trips(tmp_path: Path) -> None:
    """A module holding persistent buffers and no parameter (a statistic, a cache a model keeps in ``state_dict``) is a
    dense unit with no optimizer state. Under ZeRO-2 it still needs an owner, the rank that snapshots and writes it.
    Failed on d816d30: ``KeyError: 'dense/stats'`` when sizing the snapshot slots."""

    def model(seed: int) -> nn.Module:
        built = BufferedMoE(seed)
        built.stats = nn.Module()
        built.stats.register_buffer("seen", torch.full((3,), float(seed)))
        return built

    topology = ExpertParallelTopology.replicated()
    url = (tmp_path / "ckpt").as_uri()

    def engine(built: nn.Module) -> tuple[PECCheckpointer, ZeroAdamW]:
        optimizer = ZeroAdamW(built.parameters(), partition_by_units(build_layout(built, None), topology), lr=1e-2)
        layout = build_layout(built, optimizer)
        return PECCheckpointer(every_step_config(2, 2), layout, topology, make_storage("filesystem", url)), optimizer

    trained = model(0)
    pec, optimizer = engine(trained)
    train(trained, optimizer, range(2))
    trained.stats.seen.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert pec.snapshot_share_bytes(with_optimizer_state=True) > 0
    pec.checkpoint(2)
    fresh = model(1)
    engine(fresh)[0].load_latest()
    assert torch.equal(fresh.stats.seen, trained.stats.seen)
