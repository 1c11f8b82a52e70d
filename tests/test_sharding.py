"""Ownership must write every selected byte exactly once, only from a holder, and spread the bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from moc_lightning.sharding.ownership import (
    STRATEGIES,
    Ownership,
    Shard,
    ShardingUnit,
    Topology,
    compute_ownership,
    equal_experts_ownership,
    plan_ownership,
)
from moc_lightning.sharding.paper_accounting import ZERO2_PLANS

REPO = Path(__file__).resolve().parents[1]


@st.composite
def layouts(draw: st.DrawFn, dense_on_subsets: bool = False) -> tuple[tuple[ShardingUnit, ...], Topology]:
    """A random topology, a random PEC selection of experts per layer, and a few dense units, shuffled.

    Dense units are held by every rank, or with ``dense_on_subsets`` by any ranks, so that pouring meets
    holders that run out or sit on the ideal line.
    """
    topology = Topology(world_size=(ep := draw(st.integers(1, 4))) * draw(st.integers(1, 4)), ep=ep)
    per_rank = draw(st.integers(1, 3))
    as_tuple = draw(st.booleans())  # holders as a tuple instead of a range: both must work

    def holders(ranks: range) -> tuple[int, ...] | range:
        return tuple(ranks) if as_tuple else ranks

    sizes = st.tuples(st.integers(0, 40), st.integers(1, 8))
    units = []
    for layer in range(draw(st.integers(0, 3))):
        for expert in sorted(draw(st.sets(st.integers(0, ep * per_rank - 1)))):
            rows, row_bytes = draw(sizes)
            units.append(
                ShardingUnit(
                    f"expert({layer}, {expert})",
                    "expert",
                    rows,
                    row_bytes,
                    holders(topology.replicas(expert // per_rank)),
                    layer=layer,
                    expert=expert,
                )
            )
    for name in range(draw(st.integers(0, 6))):
        rows, row_bytes = draw(sizes)
        ranks = topology.ranks()
        if dense_on_subsets:
            ranks = tuple(sorted(draw(st.sets(st.sampled_from(ranks), min_size=1))))
        units.append(ShardingUnit(f"dense({name})", "dense", rows, row_bytes, holders(ranks)))
    return tuple(draw(st.permutations(units))), topology


def unit_bytes_by_rank(ownership: Ownership, kind: str) -> list[int]:
    loads = [0] * ownership.topology.world_size
    for unit, shards in zip(ownership.units, ownership.shards):
        if unit.kind == kind:
            for shard in shards:
                loads[shard.rank] += shard.rows * unit.row_bytes
    return loads


@settings(max_examples=60, deadline=None)
@given(layouts(dense_on_subsets=True), st.sampled_from(STRATEGIES))
def test_every_byte_written_once_by_a_holder(layout: tuple[tuple[ShardingUnit, ...], Topology], strategy: str) -> None:
    units, topology = layout
    ownership = compute_ownership(units, topology, strategy)
    assert ownership.units == units
    for unit in units:
        shards = ownership.shards_of(unit.key)
        assert all(shard.rank in unit.holders for shard in shards)
        assert [shard.row_start for shard in shards] == [0] + [shard.row_stop for shard in shards[:-1]]
        assert shards[-1].row_stop == unit.rows
        assert all(shard.rows > 0 for shard in shards) or shards == (shards[0],)
        assert len({shard.rank for shard in shards}) == len(shards)  # the engine writes one range per rank
    assert sum(ownership.rank_bytes) == sum(unit.nbytes for unit in units)
    for rank in range(topology.world_size):
        writes = ownership.writes_of(rank)
        assert sum(shard.rows * unit.row_bytes for unit, shard in writes) == ownership.rank_bytes[rank]
        assert all(shard.rank == rank for _, shard in writes)
    assert sum(len(ownership.writes_of(rank)) for rank in range(topology.world_size)) == sum(map(len, ownership.shards))


def dense_bytes(units: tuple[ShardingUnit, ...]) -> int:
    return sum(unit.nbytes for unit in units if unit.kind == "dense")


def check_runs(ownership: Ownership) -> None:
    """The experts of each set of holders, in unit order, are one run cut into one contiguous piece per holder: the
    holders' pieces follow each other along the run (so each unit's shards go to consecutive holders, ascending), each
    within one row of an equal share of the run's bytes (rows weigh ``max(1, row_bytes)``), and a run has at most one
    shard per unit plus one per cut."""
    runs: dict[tuple[int, ...], list[tuple[ShardingUnit, tuple[Shard, ...]]]] = {}
    for unit, shards in zip(ownership.units, ownership.shards):
        if unit.kind == "expert":
            runs.setdefault(tuple(unit.holders), []).append((unit, shards))
    for holders, run in runs.items():
        along = [(holders.index(s.rank), j, s.row_start) for j, (u, shards) in enumerate(run) if u.rows for s in shards]
        assert along == sorted(along), "each holder's piece is one stretch of the run, in holder order"
        assert len(along) <= sum(1 for u, _ in run if u.rows) + len(holders) - 1
        weighted = [0] * len(holders)
        for unit, shards in run:
            for shard in shards:
                weighted[holders.index(shard.rank)] += shard.rows * max(1, unit.row_bytes)
        share = sum(weighted) / len(holders)
        heaviest_row = max(max(1, unit.row_bytes) for unit, _ in run)
        assert all(abs(piece - share) < heaviest_row + 1 for piece in weighted), (weighted, share)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from(["equal", "adaptive"]))
def test_equal_and_adaptive_split_experts_evenly_and_bound_the_busiest_rank(
    layout: tuple[tuple[ShardingUnit, ...], Topology], strategy: str
) -> None:
    units, topology = layout
    ownership = compute_ownership(units, topology, strategy)
    check_runs(ownership)
    for unit, shards in zip(units, ownership.shards):
        if unit.kind == "dense" and unit.nbytes * topology.world_size <= dense_bytes(units):
            assert len(shards) == 1  # fits in the dense share: layer granularity
    dense = [unit.nbytes for unit in units if unit.kind == "dense"]
    largest = max(dense, default=0)
    if strategy == "equal":  # dense bytes alone are balanced, whatever the experts do
        assert max(unit_bytes_by_rank(ownership, "dense")) <= sum(dense) / topology.world_size + largest
    else:  # greedy onto the lightest rank: never above the ideal plus one dense unit, or the expert peak
        experts = unit_bytes_by_rank(ownership, "expert")
        assert ownership.busiest_bytes <= max(max(experts), ownership.ideal_bytes + largest)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from(["equal", "adaptive"]))
def test_oversized_dense_units_are_poured_up_to_the_ideal_line(
    layout: tuple[tuple[ShardingUnit, ...], Topology], strategy: str
) -> None:
    """A rank that takes a block of an oversized unit ends at most one row above the strategy's ideal line.

    The line is the dense share for ``equal`` (it ignores experts) and the total over ranks for ``adaptive``;
    so each block is at most that line, rounded up to a row.
    """
    units, topology = layout
    ownership = compute_ownership(units, topology, strategy)
    loads = unit_bytes_by_rank(ownership, "dense") if strategy == "equal" else list(ownership.rank_bytes)
    line = sum(loads) / topology.world_size
    oversized = [
        (unit, shards)
        for unit, shards in zip(units, ownership.shards)
        if unit.kind == "dense" and unit.nbytes * topology.world_size > dense_bytes(units)
    ]
    for unit, shards in oversized:
        for shard in shards:
            assert shard.rows * unit.row_bytes < line + unit.row_bytes
            assert loads[shard.rank] < line + max(u.row_bytes for u, _ in oversized)


def embedding_layout() -> tuple[list[ShardingUnit], Topology]:
    """Four EP ranks with one 100-byte expert each, four 5-byte dense units and a 40-byte embedding.

    The dense share is 60 / 4 = 15 bytes, so the embedding is oversized; the ideal is 460 / 4 = 115 bytes.
    """
    topology = Topology(world_size=4, ep=4)
    experts = [
        ShardingUnit(f"expert(0, {e})", "expert", 100, 1, topology.replicas(e), layer=0, expert=e) for e in range(4)
    ]
    dense = [ShardingUnit(f"dense({d})", "dense", 5, 1, topology.ranks()) for d in range(4)]
    return [*experts, ShardingUnit("dense(embedding)", "dense", 40, 1, topology.ranks()), *dense], topology


@pytest.mark.parametrize("strategy", ["equal", "adaptive"])
def test_oversized_embedding_is_split_into_blocks_that_reach_the_ideal(strategy: str) -> None:
    units, topology = embedding_layout()
    ownership = compute_ownership(units, topology, strategy)
    blocks = ownership.shards_of("dense(embedding)")
    assert [(block.row_start, block.row_stop) for block in blocks] == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert sorted(block.rank for block in blocks) == [0, 1, 2, 3]
    assert all(len(ownership.shards_of(f"dense({d})")) == 1 for d in range(4))  # the others fit: whole
    assert ownership.rank_bytes == (115, 115, 115, 115)
    lightest_expert_rank, embedding = 100, 40  # whole, the embedding would land on some rank of 100 bytes
    assert (lightest_expert_rank + embedding) / ownership.ideal_bytes > 1.2


def test_oversized_unit_on_few_holders_leaves_the_rest_to_the_last_holder() -> None:
    topology = Topology(world_size=4, ep=1)
    units = [ShardingUnit("dense(a)", "dense", 40, 1, (0, 1))]  # dense share 10, two holders
    shards = compute_ownership(units, topology, "equal").shards_of("dense(a)")
    assert shards == (Shard(0, 0, 10), Shard(1, 10, 40))


def test_balanced_layout_is_perfectly_even() -> None:
    topology = Topology(world_size=4, ep=2)
    experts = [
        ShardingUnit(f"expert(0, {e})", "expert", 8, 3, topology.replicas(e), layer=0, expert=e) for e in range(2)
    ]
    dense = [ShardingUnit(f"dense({d})", "dense", 5, 2, topology.ranks()) for d in range(4)]
    for strategy in ("equal", "adaptive"):
        assert compute_ownership(experts + dense, topology, strategy).rank_bytes == (22, 22, 22, 22)


def test_adaptive_fills_the_rank_the_selection_left_light() -> None:
    topology = Topology(world_size=2, ep=2)
    units = [
        ShardingUnit("expert(0, 0)", "expert", 10, 1, topology.replicas(0), layer=0, expert=0),
        ShardingUnit("dense(embedding)", "dense", 10, 1, topology.ranks()),
    ]
    assert compute_ownership(units, topology, "adaptive").rank_bytes == (10, 10)  # poured whole into rank 1
    assert compute_ownership(units, topology, "equal").rank_bytes == (15, 5)  # dense halved, ignoring experts


def test_adaptive_fills_around_the_bytes_ranks_write_besides_the_units() -> None:
    """Under ZeRO each owner writes its optimizer partition itself; ``adaptive`` places the replicated weights around
    those bytes, ``equal`` and ``rank0`` place them as they always do."""
    topology = Topology(world_size=2, ep=1)
    units = [ShardingUnit(f"dense({d})", "dense", 4, 1, topology.ranks()) for d in range(2)]
    around = plan_ownership(units, topology, "adaptive", base_loads=(8, 0))
    assert around.rank_bytes == (0, 8), "both weights onto the rank with no optimizer state to write"
    assert plan_ownership(units, topology, "adaptive", base_loads=(8, 0)) is around, "cached"
    assert plan_ownership(units, topology, "equal", base_loads=(8, 0)).rank_bytes == (4, 4)
    assert plan_ownership(units, topology, "rank0", base_loads=(8, 0)).rank_bytes == (8, 0)


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_rank0_writes_dense_on_rank0_and_experts_in_ep_group0(layout: tuple[tuple[ShardingUnit, ...], Topology]) -> None:
    units, topology = layout
    ownership = compute_ownership(units, topology, "rank0")
    for unit, shards in zip(units, ownership.shards):
        assert len(shards) == 1
        assert shards[0].rank == 0 if unit.kind == "dense" else shards[0].rank < topology.ep


def dcp_plans(units: tuple[ShardingUnit, ...], world_size: int) -> list[SavePlan]:
    """Each rank's DCP plan: one uint8 tensor item per unit it holds, in unit order."""

    def item(unit: ShardingUnit) -> WriteItem:
        size = torch.Size([unit.nbytes])
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.uint8), size=size)
        return WriteItem(index=MetadataIndex(unit.key), type=WriteItemType.TENSOR, tensor_data=data)

    return [SavePlan([item(unit) for unit in units if rank in unit.holders]) for rank in range(world_size)]


@st.composite
def arbitrary_holders(draw: st.DrawFn) -> tuple[tuple[ShardingUnit, ...], Topology]:
    """Units on arbitrary rank subsets of up to 40 ranks, so that Python set order is not ascending."""
    topology = Topology(world_size=draw(st.integers(1, 40)), ep=1)
    units = []
    for name in range(draw(st.integers(1, 12))):
        holders = draw(st.sets(st.integers(0, topology.world_size - 1), min_size=1))
        rows = draw(st.integers(0, 6))
        units.append(ShardingUnit(f"dense({name})", "dense", rows, 1, tuple(sorted(holders))))
    return tuple(units), topology


@settings(max_examples=60, deadline=None)
@given(arbitrary_holders())
def test_dcp_default_matches_torch_dedup_save_plans(layout: tuple[tuple[ShardingUnit, ...], Topology]) -> None:
    units, topology = layout
    deduplicated = dedup_save_plans(dcp_plans(units, topology.world_size))
    writer = {item.index.fqn: rank for rank, plan in enumerate(deduplicated) for item in plan.items}
    ownership = compute_ownership(units, topology, "dcp_default")
    assert {unit.key: shards[0].rank for unit, shards in zip(units, ownership.shards)} == writer


def test_plan_is_cached_while_the_selection_repeats() -> None:
    topology = Topology(world_size=2, ep=1)
    units = [ShardingUnit("dense(a)", "dense", 3, 1, topology.ranks())]
    first = plan_ownership(units, topology, "adaptive")
    assert plan_ownership(list(units), topology, "adaptive") is first
    assert plan_ownership(units, topology, "equal") is not first


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: compute_ownership([], Topology(2, 1), "fastest"), "allowed: equal, adaptive, rank0, dcp_default"),
        (lambda: Topology(world_size=6, ep=4), "ep >= 1 that divides it"),
        (lambda: Topology(2, 1).replicas(1), "ep_rank=1"),
        (lambda: ShardingUnit("e", "expert", 1, 1, range(2)), "layer and expert are required"),
        (lambda: ShardingUnit("d", "moe", 1, 1, range(2)), "kind='moe'"),
        (lambda: ShardingUnit("d", "dense", 1, 1, (1, 0)), "ascending"),
        (lambda: ShardingUnit("d", "dense", 1, 1, ()), "at least one rank"),
        (lambda: ShardingUnit("d", "dense", -1, 1, range(2)), "rows=-1"),
        (lambda: compute_ownership([ShardingUnit("d", "dense", 1, 1, range(3))], Topology(2, 1), "equal"), "outside"),
        (
            lambda: compute_ownership([ShardingUnit("d", "dense", 1, 1, range(2))] * 2, Topology(2, 1), "equal"),
            "appears twice",
        ),
        (lambda: compute_ownership([], Topology(2, 1), "equal").writes_of(2), "rank=2"),
        (
            lambda: equal_experts_ownership([], Topology(2, 1), label="EE+AN", base_loads=[0], pour=False),
            "base_loads must give bytes >= 0 for each of world_size=2 ranks",
        ),
    ],
)
def test_bad_inputs_name_the_option_and_what_is_allowed(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_report_writes_the_required_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "recipes/sharding_report.py", f"out={out}", "plan_ranks=32"]
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, timeout=60)
    report = json.loads(out.read_text())
    assert {"case", "strategy", "k", "busiest_bytes", "ideal_bytes", "ratio"} <= report["rows"][0].keys()
    assert {(row["case"], row["strategy"], row["k"]) for row in report["rows"]} == {
        (case, strategy, k) for case in ("Case1", "Case2", "Case3") for strategy in STRATEGIES for k in (16, 1)
    }
    assert all({"ranks", "seconds"} <= timing.keys() for timing in report["plan_time"])
    zero2 = report["zero2"]  # the paper's accounting (Figure 10), beside today's DDP rows
    assert {(row["case"], row["plan"], row["k"]) for row in zero2["rows"]} == {
        (case, plan, k) for case in ("Case1", "Case2", "Case3") for plan in ZERO2_PLANS for k in (16, 1)
    }
    assert {"busiest_bytes", "weight_bytes", "optimizer_bytes", "reduction_vs_deepspeed"} <= zero2["rows"][0].keys()
    assert [paper.get("high") for paper in zero2["paper"]] == [0.28, 0.29, 0.061, None]


def test_an_ep_ranks_experts_are_cut_as_one_run_over_its_replicas() -> None:
    """EP rank 0 holds experts 0 (10 rows) and 1 (6 rows), replicated on ranks 0 and 2: their 16 rows are cut at 8, so
    rank 0 writes 8 rows of expert 0 and rank 2 the rest of it and expert 1 whole (three shards, not four). EP rank 1's
    one expert is halved over ranks 1 and 3, as in the paper's Figure 7."""
    topology = Topology(world_size=4, ep=2)
    sizes = {0: 10, 1: 6, 2: 7}
    units = [
        ShardingUnit(f"expert(0, {e})", "expert", rows, 1, topology.replicas(e // 2), layer=0, expert=e)
        for e, rows in sizes.items()
    ]
    for strategy in ("equal", "adaptive"):
        ownership = compute_ownership(units, topology, strategy)
        expected = ((Shard(0, 0, 8), Shard(2, 8, 10)), (Shard(2, 0, 6),), (Shard(1, 0, 3), Shard(3, 3, 7)))
        assert ownership.shards == expected
        assert ownership.rank_bytes == (8, 3, 8, 4)
        assert [s for _, s in ownership.writes_of(2)] == [Shard(2, 8, 10), Shard(2, 0, 6)]
