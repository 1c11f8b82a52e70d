"""A persist's outcome is agreed by every rank (all-or-nothing): a commit that fails on the coordinator, or a
write that fails on one rank, ends with the same ``PersistFailed`` on every rank, hangs nobody, commits nothing
(or, past the manifest put, commits), and leaves the persist group usable so that the next persist lands."""

from __future__ import annotations

import errno
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from dist_utils import run_ranks
from storage_faults import FaultyStorage, os_error
from trainee import TINY, Trainee, every_step_config

from moc_lightning.engine.layout import build_layout
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.commit import COMMIT_POINTS
from moc_lightning.pec.stored import checkpoint_name
from moc_lightning.pec.write_plan import model_units
from moc_lightning.storage import CheckpointStorage, make_storage

pytestmark = pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")

GROUP_TIMEOUT_S = 45
"""A rank left waiting in a persist collective fails after this, instead of the default 30 minutes: a hang
becomes a test failure."""

BEFORE_THE_COMMIT_POINT = ("commit:description", "commit:previous_manifest", "commit:manifest")


def _engine(storage: CheckpointStorage, group: dist.ProcessGroup, **kwargs: Any) -> PECCheckpointer:
    """A K=N engine with retention 1 (so every commit retires the checkpoint before it) on its own gloo group."""
    topology = ExpertParallelTopology.from_process_group()
    trainee = Trainee(topology)
    layout = build_layout(trainee.model, trainee.optimizer, num_experts=TINY.num_experts)
    cfg = every_step_config(TINY.num_experts, TINY.num_experts, retention=1)
    return PECCheckpointer(cfg, layout, topology, storage, process_group=group, **kwargs)


def _persist_three_times(engine: PECCheckpointer, arm: Any) -> dict[str, Any]:
    """Persist steps 1 (clean), 2 (with the fault armed by ``arm()``) and 3 (clean again); what each rank saw."""
    units = model_units(engine.layout)
    root = Path(engine.storage.url.removeprefix("file://"))
    engine.persist(1, units)
    arm()
    try:
        engine.persist(2, units)
        outcome: tuple[str, str] = ("ok", "")
    except Exception as err:  # noqa: BLE001 - the type is what the test compares
        outcome = (type(err).__name__, str(err))
    after_failure = [r.step for r in engine.read_manifest().records]
    dist.barrier(group=engine.process_group)  # every rank has read the manifest before step 3 changes it
    engine.persist(3, units)
    dist.barrier(group=engine.process_group)  # retention's deletions (coordinator, after the commit) are done
    return {
        "outcome": outcome,
        "after_failure": after_failure,
        "after_retry": [r.step for r in engine.read_manifest().records],
        "dirs": sorted(p.name for p in root.iterdir() if p.is_dir()),
    }


def _commit_fault(rank: int, world_size: int, url: str, point: str) -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    armed: list[str] = []

    def hook(name: str) -> None:
        if armed and name == armed[0]:
            armed.clear()
            raise os_error(errno.ENOSPC, name)

    engine = _engine(make_storage("filesystem", url), group, fault_hook=hook)
    return _persist_three_times(engine, lambda: armed.append(point))


def test_commit_points_are_named() -> None:
    assert COMMIT_POINTS == (*BEFORE_THE_COMMIT_POINT, "commit:retention")


@pytest.mark.slow
@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_commit_fault_at_each_point_is_agreed_and_the_next_persist_lands(tmp_path: Path, point: str) -> None:
    results = run_ranks(_commit_fault, 2, tmp_path, (tmp_path / "ckpt").as_uri(), point)
    outcomes = {r["outcome"] for r in results}
    assert len(outcomes) == 1, f"the ranks disagree about the outcome: {outcomes}"
    (kind, message), = outcomes
    if point in BEFORE_THE_COMMIT_POINT:
        assert kind == "PersistFailed" and point in message and "No space left" in message, message
        assert all(r["after_failure"] == [1] for r in results), "nothing of step 2 is committed"
        assert results[0]["dirs"] == [checkpoint_name(3)], "the failed attempt's directory and step 1 are gone"
    else:  # past the manifest put: committed; only retention's deletion of step 1 failed, and is retried
        assert kind == "ok", message
        assert all(r["after_failure"] == [2] for r in results)
        assert results[0]["dirs"] == [checkpoint_name(3)], "step 1's deletion was retried with step 3's commit"
    assert all(r["after_retry"] == [3] for r in results), "the next persist lands and is listed"


def _full_disk_at_put(rank: int, world_size: int, url: str, put: int) -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    storage = FaultyStorage(make_storage("filesystem", url))
    engine = _engine(storage, group)
    # puts of one commit: moc.json, manifest.previous.json, manifest.json; step 1's are puts 1-3
    return _persist_three_times(engine, lambda: storage.fail_puts.update({3 + put: errno.ENOSPC}))


@pytest.mark.slow
@pytest.mark.parametrize("put", [1, 3], ids=["moc.json", "manifest.json"])
def test_a_full_disk_during_the_commit_fails_on_every_rank_and_hangs_none(tmp_path: Path, put: int) -> None:
    results = run_ranks(_full_disk_at_put, 2, tmp_path, (tmp_path / "ckpt").as_uri(), put)
    assert {r["outcome"][0] for r in results} == {"PersistFailed"}
    assert len({r["outcome"] for r in results}) == 1
    assert all(r["after_failure"] == [1] and r["after_retry"] == [3] for r in results)


def _write_fault_on_rank_1(rank: int, world_size: int, url: str) -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    storage = FaultyStorage(make_storage("filesystem", url))
    engine = _engine(storage, group)
    return _persist_three_times(engine, lambda: storage.fail_writes.update({2: errno.EIO} if rank == 1 else {}))


@pytest.mark.slow
def test_a_write_failing_on_one_rank_fails_the_persist_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_write_fault_on_rank_1, 2, tmp_path, (tmp_path / "ckpt").as_uri())
    assert len({r["outcome"] for r in results}) == 1, [r["outcome"] for r in results]
    kind, message = results[0]["outcome"]
    assert kind == "PersistFailed" and "rank 1" in message and "Input/output error" in message, message
    assert all(r["after_failure"] == [1] and r["after_retry"] == [3] for r in results)
    assert results[0]["dirs"] == [checkpoint_name(3)]
