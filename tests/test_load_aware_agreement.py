"""``load_aware`` selection is decided from one view of storage that every rank shares (issue 11, item 9).

The coordinator commits persists in the background while every rank selects the next snapshot's experts.
Reading the manifest for that, as 7dbc115 did, lets a rank that reads just after a commit choose other
experts than a rank that read just before it: the ranks then snapshot different experts, and the ownership
and the slots disagree. The selection must come from the persists every rank has seen succeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_utils import run_ranks
from trainee import Trainee

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.manifest import CheckpointRecord
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.pec.write_plan import model_units


def _select_while_a_commit_lands(rank: int, world_size: int, url: str, shm: str) -> list[Any]:
    topology = ExpertParallelTopology.from_process_group()
    trainee = Trainee(topology)
    pec = trainee.engine(CheckpointConfig(
        k_snapshot=2, k_persist=1, every_n_train_steps=1, persist_every_n_snapshots=2, selection="load_aware"
    ), url)
    engine = TwoLevelCheckpointer(pec, SnapshotStore(Path(shm) / f"rank{rank}"))
    chosen: list[Any] = []
    select = pec.selector.select

    def recording_select(*args: Any, **kwargs: Any) -> Any:
        selection = select(*args, **kwargs)
        chosen.append(selection.snapshot)
        return selection

    pec.selector.select = recording_select
    for step in range(1, 4):
        trainee.step(step)
        pec.record_tokens(trainee.model.moe_layers())
        engine.snapshot(step, None)
        engine.wait_snapshot()
        engine.finish()  # step 1's persist is committed and reaped everywhere before step 3
    if rank == 1:  # this rank reads storage just after the coordinator committed a persist of every expert
        committed = pec.read_manifest()
        landed = CheckpointRecord(
            name="step_000000004", step=4, units=tuple(u.key for u in model_units(pec.layout)), strategy="adaptive",
            world_size=world_size, ep=topology.ep, backend="filesystem",
        )
        pec.read_manifest = lambda: committed.with_record(landed)  # type: ignore[method-assign]
    trainee.step(4)
    pec.record_tokens(trainee.model.moe_layers())
    engine.snapshot(4, None)
    engine.finish()
    dist.barrier()
    return chosen


def test_load_aware_ranks_select_alike_while_a_persist_commits(tmp_path: Path) -> None:
    ranks = run_ranks(_select_while_a_commit_lands, 2, tmp_path, (tmp_path / "ckpt").as_uri(), str(tmp_path / "shm"))
    assert len(ranks[0]) == 4
    assert ranks[0] == ranks[1], f"ranks chose different experts: {ranks[0][-1]} vs {ranks[1][-1]}"
