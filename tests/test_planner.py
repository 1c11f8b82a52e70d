"""MoCSavePlanner as pure planning, several simulated ranks in one process (no process group)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from moc_lightning.sharding.planner import MoCSavePlanner, owned_bytes, tensor_row_range


def _plans(state: dict[str, torch.Tensor], writes_by_rank: list[dict | None]) -> tuple[list, object]:
    planners = []
    local = []
    for rank, writes in enumerate(writes_by_rank):
        planner = MoCSavePlanner(writes)
        planner.set_up_planner(state, is_coordinator=rank == 0)
        local.append(planner.create_local_plan())
        planners.append(planner)
    global_plan, metadata = planners[0].create_global_plan(local)
    finished = [p.finish_plan(g) for p, g in zip(planners, global_plan)]
    return list(zip(planners, finished)), metadata


def test_row_ranges_of_one_tensor_are_split_across_ranks() -> None:
    state = {"w": torch.arange(24.0).view(6, 4), "step": torch.tensor(3.0), "b": torch.arange(6.0)}
    writes = [{"w": (0, 2), "b": (0, 6), "step": (0, 1)}, {"w": (2, 6)}]
    ranks, metadata = _plans(state, writes)
    w = metadata.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata) and w.size == torch.Size([6, 4])
    assert sorted((c.offsets[0], c.sizes[0]) for c in w.chunks) == [(0, 2), (2, 4)]
    (p0, plan0), (p1, plan1) = ranks
    assert {i.index.fqn for i in plan0.items} == {"w", "b", "step"} and {i.index.fqn for i in plan1.items} == {"w"}
    shard = next(i for i in plan1.items if i.index.fqn == "w")
    assert shard.type == WriteItemType.SHARD
    assert torch.equal(p1.resolve_data(shard), state["w"][2:6])
    assert owned_bytes(plan0) == (8 + 6 + 1) * 4 and owned_bytes(plan1) == 16 * 4


def test_unowned_keys_are_not_written_and_empty_ranges_skipped() -> None:
    state = {"w": torch.ones(4, 2)}
    ranks, metadata = _plans(state, [{"w": (0, 4)}, {"w": (4, 4)}])
    assert len(ranks[1][1].items) == 0
    assert ranks[0][1].items[0].type == WriteItemType.TENSOR


def test_dcp_default_keeps_dcp_deduplication() -> None:
    state = {"w": torch.ones(4, 2), "v": torch.ones(3)}
    ranks, _ = _plans(state, [None, None])
    written = [sorted(i.index.fqn for i in plan.items) for _, plan in ranks]
    assert sorted(written[0] + written[1]) == ["v", "w"], "each replicated tensor written once by DCP's dedup"


def test_tensor_row_ranges_partition_every_tensor() -> None:
    unit_rows, bounds = 10, [0, 3, 7, 10]
    for tensor_rows in (1, 4, 10, 33):
        pieces = [tensor_row_range(a, b, unit_rows, tensor_rows) for a, b in zip(bounds, bounds[1:])]
        assert pieces[0][0] == 0 and pieces[-1][1] == tensor_rows
        assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
