"""Planning costs that do not grow with the job (issue 30, item 2): one rank's ownership and write plan build
O(units + ranks) shards, never one per replica of every expert; the coordinator's global plan is DCP's own, built in
one pass without DCP's deduplication, and still refuses writes that overlap, repeat or leave a gap; a periodic
persist plans off the training thread."""

from __future__ import annotations

import gc
import random
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.planner import SavePlan

from moc_lightning.pec.write_plan import zero_weights_ownership
from moc_lightning.sharding import ownership as ownership_module
from moc_lightning.sharding.ownership import Shard, ShardingUnit, Topology, forget_plans
from moc_lightning.sharding.planner import MoCSavePlanner, RowRange, disjoint_global_plan
from moc_lightning.tools.plan_threads import plan_calls


def _moe_units(topology: Topology, layers: int, experts: int) -> list[ShardingUnit]:
    """``experts`` per MoE layer, ``experts // ep`` on each EP rank, and a dense unit per layer plus an embedding
    over the dense share (poured)."""
    per_rank = experts // topology.ep
    units = [ShardingUnit("dense/embed", "dense", 4096, 64, topology.ranks())]
    for layer in range(layers):
        units.append(ShardingUnit(f"dense/attn{layer}", "dense", 64, 48, topology.ranks()))
        units += [
            ShardingUnit(
                f"expert/L{layer}/E{e}", "expert", 112, 96, topology.replicas(e // per_rank), layer=layer, expert=e
            )
            for e in range(experts)
        ]
    return units


class _CountedShard(Shard):
    """A :class:`Shard` that counts its constructions."""

    __slots__ = ()
    built = 0

    def __init__(self, rank: int, row_start: int, row_stop: int) -> None:
        type(self).built += 1
        super().__init__(rank, row_start, row_stop)


def test_a_rank_plans_its_writes_without_a_shard_per_replica_of_every_expert() -> None:
    """4,096 ranks, EP 64: each of 512 experts has 64 replicas, 32,768 expert shards in all. One rank's plan (the
    ZeRO write plan: adaptive around each owner's optimizer bytes) and its writes build at most units + ranks.

    Failed on 86abbc6: 33,116 shards (every replica's shard of every expert, built for every plan)."""
    topology = Topology(4096, 64)
    units = _moe_units(topology, layers=8, experts=64)
    states = [(i % topology.world_size, 1000) for i in range(len(units))]
    forget_plans()
    _CountedShard.built = 0
    with mock.patch.object(ownership_module, "Shard", _CountedShard):
        ownership = zero_weights_ownership(units, states, topology, "adaptive")
        mine = ownership.writes_of(5)
    forget_plans()
    built = _CountedShard.built
    assert built <= len(units) + topology.world_size, f"{built} shards for {len(units)} units on 4,096 ranks"
    everyone = [(unit, shard) for unit, shards in zip(units, ownership.shards) for shard in shards]
    assert [(u.key, s.rank, s.row_start, s.row_stop) for u, s in mine] == [
        (u.key, s.rank, s.row_start, s.row_stop) for u, s in everyone if s.rank == 5
    ], "the same as from all shards"
    loads = [0] * topology.world_size
    for unit, shard in everyone:
        loads[shard.rank] += shard.rows * unit.row_bytes
    assert list(ownership.rank_bytes) == loads
    run = 8 * 112 * 96  # its EP rank's expert of each layer, cut into 64 equal pieces, one per replica
    assert sum(shard.rows * unit.row_bytes for unit, shard in mine if unit.kind == "expert") == run // 64


def _local_plans(
    state: dict[str, torch.Tensor], writes: list[dict[str, RowRange]]
) -> tuple[list[SavePlan], MoCSavePlanner]:
    planners = []
    for rank, mine in enumerate(writes):
        planner = MoCSavePlanner(mine)
        planner.set_up_planner(state, is_coordinator=rank == 0)
        planners.append(planner)
    return [p.create_local_plan() for p in planners], planners[0]


def _random_writes(state: dict[str, torch.Tensor], ranks: int, seed: int) -> list[dict[str, RowRange]]:
    """Each tensor's rows cut at random bounds among random ranks (each rank one range); a scalar to one rank."""
    rng = random.Random(seed)
    writes: list[dict[str, RowRange]] = [{} for _ in range(ranks)]
    for key, tensor in state.items():
        if tensor.dim() == 0:
            writes[rng.randrange(ranks)][key] = (0, 1)
            continue
        cuts = sorted(rng.sample(range(1, tensor.shape[0]), rng.randint(0, min(ranks, tensor.shape[0]) - 1)))
        bounds = [0, *cuts, tensor.shape[0]]
        for rank, (start, stop) in zip(rng.sample(range(ranks), len(bounds) - 1), zip(bounds, bounds[1:])):
            writes[rank][key] = (start, stop)
    return writes


@pytest.mark.parametrize("seed", range(4))
def test_the_global_plan_is_dcps_own_built_in_one_pass(seed: int) -> None:
    """Against DCP's ``create_default_global_save_plan``: the same ``.metadata`` (every chunk in the same order) and
    the same plans, index hints included (``MetadataIndex`` equality ignores them; ``.metadata`` stores them)."""
    state = {f"t{i}": torch.zeros(random.Random(seed * 10 + i).randint(1, 30), 3) for i in range(6)}
    state |= {"step": torch.tensor(1.0), "bias": torch.zeros(17)}
    plans, coordinator = _local_plans(state, _random_writes(state, 5, seed))
    ours, metadata = coordinator.create_global_plan(plans)
    theirs, expected = create_default_global_save_plan(plans)
    assert metadata == expected
    assert _validate_global_plan(theirs, expected) == []
    for mine, dcp in zip(ours, theirs, strict=True):
        assert mine.items == dcp.items
        assert [item.index.index for item in mine.items] == [item.index.index for item in dcp.items]


@pytest.mark.parametrize(
    ("writes", "message"),
    [
        ([{"w": (0, 6)}, {"w": (4, 8)}], "overlapping chunks"),
        ([{"w": (0, 3)}, {"w": (5, 8)}], "invalid fill"),
        ([{"w": (0, 8)}, {"w": (0, 8)}], "two ranks write 'w' whole"),
        ([{"s": (0, 1)}, {"s": (0, 1)}], "two ranks write 's' whole"),
    ],
)
def test_writes_that_overlap_repeat_or_leave_a_gap_are_refused(writes: list[dict], message: str) -> None:
    state = {"w": torch.zeros(8, 2), "s": torch.tensor(0.0)}
    plans, coordinator = _local_plans(state, writes)
    with pytest.raises(ValueError, match=message):
        disjoint_global_plan(plans)


@pytest.mark.parametrize("zero", [True, False], ids=["zero2", "ddp"])
def test_a_periodic_persist_plans_off_the_training_thread(zero: bool) -> None:
    """Two snapshots persisted in the background, then the final persist, on a real engine: every periodic persist's
    write plan runs on the persist thread (its slot's own units, whole: no ownership to compute); only the final
    persist, from the live tensors once training is over, plans its ownership on the training thread. Under DDP the
    snapshot's owners are computed on the training thread, once per selection."""
    calls = plan_calls(zero)
    periodic = [c for c in calls if c.persist == "periodic"]
    plans = [c for c in periodic if c.what == "write plan"]
    assert len(plans) == 2 and not any(c.on_training_thread for c in plans), plans
    assert all(c.thread.startswith("moc-persist") for c in plans)
    assert not any(c.what == "ownership (write plan)" for c in periodic)
    final = {(c.what, c.on_training_thread) for c in calls if c.persist == "final"}
    assert final == {("write plan", True), ("ownership (write plan)", True)}
    owners = [c for c in periodic if c.what == "ownership (snapshot owners)"]
    assert len(owners) == (0 if zero else 2) and all(c.on_training_thread for c in owners), "ZeRO: a lookup"


KINDS = ("expert", "dense")


def test_the_global_plan_has_a_write_item_per_unit_or_cut_not_per_replica_of_every_expert() -> None:
    """4,096 ranks, EP 64: each EP rank's 8 selected experts (one per layer) have 64 replicas. Every simulated rank's
    local plan of its writes (the ZeRO write plan, one weight tensor per unit), then the coordinator's global plan:
    the experts' items are at most one per expert plus one per rank (an EP rank's experts cut as one run over its
    replicas: each cut adds one), not one per (expert, replica); the dense units' at most one per unit plus one per
    rank (the embedding poured in blocks). The plan still tiles every tensor (:func:`disjoint_global_plan` checks it).

    Failed on 7def2ed: 33,116 items (32,768 of them the 512 experts, each split over all 64 of its replicas)."""
    topology = Topology(4096, 64)
    units = _moe_units(topology, layers=8, experts=64)
    states = [(i % topology.world_size, 1000) for i in range(len(units))]
    forget_plans()
    ownership = zero_weights_ownership(units, states, topology, "adaptive")
    tensors = {unit.key: torch.empty(unit.rows, 2, device="meta") for unit in units}
    plans = []
    for rank in topology.ranks():
        writes = {unit.key: (shard.row_start, shard.row_stop) for unit, shard in ownership.writes_of(rank)}
        planner = MoCSavePlanner(writes)
        planner.set_up_planner({key: tensors[key] for key in writes}, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    forget_plans()
    global_plans, metadata = disjoint_global_plan(plans)
    items = {kind: sum(1 for p in global_plans for i in p.items if i.index.fqn.startswith(kind)) for kind in KINDS}
    for kind, count in items.items():
        kind_units = sum(1 for unit in units if unit.kind == kind)
        assert count <= kind_units + topology.world_size, f"{count:,} write items for {kind_units} {kind} units"
    assert sum(len(stored.chunks) for stored in metadata.state_dict_metadata.values()) == sum(items.values())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_the_coordinator_plans_and_left_as_it_was(enabled: bool) -> None:
    """The global plan allocates objects per write item and frees none, so automatic collections only walk them
    (``collector_paused``): off during the plan, then back as the caller had it, also when the plan fails."""
    seen: list[bool] = []

    def planning(all_plans: list[SavePlan]) -> tuple[list[SavePlan], object]:
        seen.append(gc.isenabled())
        raise ValueError("two ranks write 'w' whole")

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with mock.patch("moc_lightning.sharding.planner.disjoint_global_plan", planning):
            with pytest.raises(ValueError, match="two ranks write"):
                MoCSavePlanner({"w": (0, 4)}).create_global_plan([SavePlan([])])
        assert seen == [False] and gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
