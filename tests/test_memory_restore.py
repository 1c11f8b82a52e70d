"""Recovery from memory sends each unit to the ranks that hold it, not to the whole world (issue 30: at 16,384 ranks
a broadcast of every unit over every rank had each rank receive the whole 9.39 TB state, ~579 s a fault)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from trainee import TINY, Trainee, every_step_config

from moc_lightning.engine.slots import is_state_key
from moc_lightning.memory.restoring import MemoryRestore
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology

N = TINY.num_experts


def _engine(trainee: Trainee, root: str, rank: int) -> TwoLevelCheckpointer:
    """Every unit in every snapshot."""
    pec = trainee.engine(every_step_config(N, N), Path(root, "ckpt").as_uri())
    return TwoLevelCheckpointer(pec, SnapshotStore(Path(root, "shm", f"rank{rank}")))


def _restore_counting_broadcasts(rank: int, world_size: int, root: str, zero: bool) -> dict[str, Any]:
    """Snapshots of steps 1 and 2 under EP 2 of 4 ranks (the experts of EP rank p on ranks p and p + 2), then a fresh
    model (another seed) recovers step 2 from memory while every broadcast of the restore is recorded. ``zero``:
    under ZeRO-2, each unit's optimizer state kept by one of its holders."""
    topology = ExpertParallelTopology.from_process_group(2)
    trainee = Trainee(topology, zero=zero)
    engine = _engine(trainee, root, rank)
    for step in (1, 2):
        trainee.step(step)
        engine.pec.record_tokens(trainee.model.moe_layers())
        engine.snapshot(step, {}, may_persist=False)  # in memory alone (a persist's collectives would run beside
        engine.wait_snapshot()  # the next step's on the default group)
    engine.finish()
    expected = trainee.snapshot()

    fresh = Trainee(topology, seed=1, zero=zero)
    restarted = _engine(fresh, root, rank)
    sent: list[tuple[int, int]] = []
    broadcast, restore = dist.broadcast, MemoryRestore.restore

    def recording(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
        sent.append((dist.get_world_size(group), tensor.numel() * tensor.element_size()))
        return broadcast(tensor, src, group=group, **kw)

    def counted(self: MemoryRestore, *args: Any, **kw: Any) -> None:
        with mock.patch.object(dist, "broadcast", recording):
            restore(self, *args, **kw)

    with mock.patch.object(MemoryRestore, "restore", counted):
        report = restarted.recover()
    got = fresh.snapshot()
    return {
        "resume": report.resume_step if report else None,
        "levels": sorted({s["level"] for s in report.sources.values()}) if report else [],
        "differs": sorted(k for k in expected if not torch.equal(got[k], expected[k])),
        "keys": (sorted(expected) == sorted(got)),
        "held_bytes": sum(t.numel() * t.element_size() for t in expected.values()),
        "kept_state_bytes": sum(t.numel() * t.element_size() for k, t in expected.items() if is_state_key(k)),
        "sent": sent,
    }


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero2"])
def test_a_memory_recovery_sends_each_unit_to_its_holders_only(tmp_path: Path, zero: bool) -> None:
    """Each rank takes part in the broadcasts of what it keeps, and nothing else. Under DDP every holder keeps a unit's
    optimizer state too. Under ZeRO only the state's owner keeps it, and that owner took the unit's snapshot: the
    state is restored from its own slot, and no other rank receives it.

    Under DDP, failed on bd7b678: every rank took part in the broadcast of every unit (rank 0: 8,218,040 B, holding
    5,041,464 B; at 16,384 ranks with EP 64, every expert where it holds 1/64 of them). Under ZeRO, failed on ffb3f2a:
    every holder received the optimizer state its owner keeps (at 16,384 ranks, 383 GB a rank where 55 GB is kept)."""
    for rank, run in enumerate(run_ranks(_restore_counting_broadcasts, 4, tmp_path, str(tmp_path), zero)):
        assert run["resume"] == 2 and set(run["levels"]) <= {"memory_local", "memory_peer"}, run["levels"]
        assert run["keys"] and run["differs"] == [], f"rank {rank}: not restored bitwise: {run['differs']}"
        taken = sum(nbytes for _, nbytes in run["sent"])
        kept = run["held_bytes"] - (run["kept_state_bytes"] if zero else 0)
        assert taken == kept, f"rank {rank} took part in broadcasts of {taken:,} B, not the {kept:,} B it keeps" + (
            ", less the optimizer state its own slot restores" if zero else ""
        )
