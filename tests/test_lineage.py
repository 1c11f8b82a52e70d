"""Runs do not mix: every restart resumes its own lineage's newest consistent state, or starts over cleanly.

Each test is an ordinary situation (a crash and a restart, ``resume=never``, a deleted run directory, a
damaged only checkpoint after a node loss, a finished run) checked against the state captured by a separate
callback at the steps that matter, never against what MoC reports about itself alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_run import DrainPersists, FailFirstCommit, Recorder, check_sources, fit_or_crash, moc_config
from storage_faults import flip_middle_byte
from trainee import TINY, Trainee, every_step_config

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.lineage import Lineage, Segment, fingerprint
from moc_lightning.engine.manifest import Manifest
from moc_lightning.lightning.shared_memory import check_shm_root
from moc_lightning.lightning.start import SET_ASIDE
from moc_lightning.memory.snapshot import NUM_SLOTS
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.write_plan import model_units
from moc_lightning.storage import make_storage


def _config(tmp_path: Path, **kw: Any) -> CheckpointConfig:
    return moc_config(tmp_path, **{"every_n_train_steps": 5, "persist_every_n_snapshots": 2, **kw})


def _slots(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "shm").rglob("meta.json"))


def test_resume_never_starts_a_new_lineage_and_sets_the_old_one_aside(tmp_path: Path) -> None:
    """Failed on 7dbc115: the new run's persists failed as "not newer" until it passed the old run's step."""
    fit_or_crash(tmp_path, _config(tmp_path), 20, Recorder())
    old_manifest = (tmp_path / "ckpt" / "manifest.json").read_bytes()
    fresh = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path, resume="never"), 12, fresh)
    assert fresh.start_step == 0 and moc.recovery is None
    assert moc.engine.stats.failed_persists == 0 and moc.engine.stats.persists >= 1
    manifest = moc.engine.pec.read_manifest()
    assert [r.step for r in manifest.records] == [5, 12]
    aside = list((tmp_path / "ckpt" / SET_ASIDE).iterdir())
    assert len(aside) == 1 and (aside[0] / "manifest.json").read_bytes() == old_manifest, "the old lineage is kept"
    assert manifest.lineage.run_id != Lineage.from_json(json.loads(old_manifest)["lineage"]).run_id


def test_deleted_run_directory_starts_fresh_instead_of_resuming_old_slots(tmp_path: Path) -> None:
    """Failed on 7dbc115: the restart resumed silently from the old run's shared-memory slots."""
    first = Recorder(crash_after=17)
    fit_or_crash(tmp_path, _config(tmp_path), 30, first)
    assert _slots(tmp_path), "a crashed run leaves its slots"
    shutil.rmtree(tmp_path / "ckpt")
    again = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path), 6, again)
    assert again.start_step == 0 and moc.recovery is None
    assert again.start.keys() == first.start.keys()
    assert all(torch.equal(t, first.start[k]) for k, t in again.start.items()), "not the initial state"


def test_restart_resumes_its_own_lineage_bitwise(tmp_path: Path) -> None:
    first = Recorder(at=(5, 10, 15), crash_after=17)
    fit_or_crash(tmp_path, _config(tmp_path), 30, first)
    resumed = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path), 20, resumed)
    assert moc.recovery.resume_step == 15 and resumed.start_step == 15
    check_sources(first, resumed, moc.recovery.sources)
    assert [s.start_step for s in moc.engine.pec.read_manifest().lineage.segments] == [0, 15]


def test_unrecoverable_state_starts_over_instead_of_crash_looping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The only committed checkpoint is damaged and the node is lost: no consistent state survives.

    Failed on 7dbc115: every restart raised "nothing to resume from" (the emptied manifest still made
    ``resume_target()`` answer yes), so the job crash-looped until its restarts ran out.
    """
    fit_or_crash(tmp_path, _config(tmp_path, persist_every_n_snapshots=10), 30, Recorder(crash_after=12))
    flip_middle_byte(next((tmp_path / "ckpt" / "step_000000005").glob("*.distcp")))
    shutil.rmtree(tmp_path / "shm")
    again = Recorder()
    fit_or_crash(tmp_path, _config(tmp_path), 8, again)
    assert again.start_step == 0
    assert "nothing to resume (no consistent state of this run survives" in capsys.readouterr().out
    later = Recorder()
    fit_or_crash(tmp_path, _config(tmp_path), 10, later)
    assert later.start_step == 8, "the next restart resumes the restarted lineage"


def test_a_damaged_manifest_before_the_first_persist_falls_back_to_the_lineage_it_began(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest a run commits at start (its lineage, no checkpoint) is damaged before any persist lands.

    Failed on 27a8ec5 (chaos seed 1146): no ``manifest.previous.json`` existed to fall back to, so every
    restart raised "unreadable and no previous manifest" and the job crash-looped.
    """
    first = Recorder(at=(5,), crash_after=7)
    config = _config(tmp_path, persist_every_n_snapshots=10)
    fit_or_crash(tmp_path, config, 30, first, extra_callbacks=[FailFirstCommit()])
    manifest = tmp_path / "ckpt" / "manifest.json"
    begun = Manifest.from_json(manifest.read_bytes())
    assert not begun.records, "no persist was committed"
    lineage = begun.lineage
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    resumed = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path), 10, resumed)
    assert "manifest.json is unreadable" in capsys.readouterr().out
    assert moc.recovery.resume_step == 5 and resumed.start_step == 5, "the snapshot of its own lineage"
    check_sources(first, resumed, moc.recovery.sources)
    assert moc.engine.pec.read_manifest().lineage.run_id == lineage.run_id


def test_a_failed_attempt_leaves_no_bytes_behind(tmp_path: Path) -> None:
    """Recovery plans step 10, finds its checkpoint damaged, and falls back to step 5: every unit must then
    hold its step-5 (or initial) version, none a byte of step 10 that the failed attempt had loaded.

    Failed on 7dbc115: experts reported as never saved held step-10 weights. The first persist is PEC's here:
    with a complete one every unit would be loaded again from step 5, hiding what the rollback left behind.
    """
    first = Recorder(at=(5,), crash_after=12)
    config = _config(tmp_path, persist_every_n_snapshots=1, k_snapshot=1, k_persist=1, complete_first_persist=False)
    fit_or_crash(tmp_path, config, 30, first, [DrainPersists()])  # step 10's persist lands before the crash
    shutil.rmtree(tmp_path / "shm")
    data = next((tmp_path / "ckpt" / "step_000000010").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # the last item: the ones before it load before the damage is found
    data.write_bytes(bytes(raw))
    again = Recorder()
    moc = fit_or_crash(tmp_path, config, 14, again)
    assert moc.recovery.resume_step == 5
    check_sources(first, again, moc.recovery.sources)


def test_finished_run_removes_its_snapshots_unless_told_to_keep_them(tmp_path: Path) -> None:
    """Failed on 7dbc115: finished runs left their slots in /dev/shm for ever."""
    fit_or_crash(tmp_path, _config(tmp_path), 10, Recorder())
    assert not _slots(tmp_path) and not any((tmp_path / "shm").iterdir())
    fit_or_crash(tmp_path / "kept", _config(tmp_path / "kept", remove_snapshots_on_fit_end=False), 10, Recorder())
    assert _slots(tmp_path / "kept")


def test_run_ending_by_max_epochs_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """Failed on 7dbc115: the last step had been persisted partially, and the final persist was skipped."""
    moc = fit_or_crash(
        tmp_path, _config(tmp_path, persist_every_n_snapshots=1), -1, Recorder(), [DrainPersists()],
        max_epochs=1, limit_train_batches=10,
    )
    manifest = moc.engine.pec.read_manifest()
    newest = manifest.latest
    assert newest.step == 10 and set(newest.units) == {u.key for u in moc.engine.pec.layout.units}
    assert newest.name == "step_000000010_final", "the partial persist of step 10 is superseded"
    stored = {p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")}
    assert stored == {r.name for r in manifest.records}, "the superseded partial checkpoint is deleted"


def test_user_k_wins_over_the_restored_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Failed on 7dbc115: the restored engine state overwrote the K given at resume."""
    fit_or_crash(tmp_path, _config(tmp_path, k_snapshot=2, k_persist=1), 30, Recorder(crash_after=12))
    moc = fit_or_crash(tmp_path, _config(tmp_path, k_snapshot=4, k_persist=2), 14, Recorder())
    assert (moc.engine.pec.dynamic_k.k_snapshot, moc.engine.pec.dynamic_k.k_persist) == (4, 2)
    assert "k_snapshot/k_persist" in capsys.readouterr().out


def test_shm_check_counts_every_local_ranks_reusable_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart of a job that fitted is never refused. Failed on 7dbc115: only this rank's slots counted."""
    recorder = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path, remove_snapshots_on_fit_end=False), 5, recorder)
    pec = moc.engine.pec
    per_slot = pec.snapshot_share_bytes(with_optimizer_state=True)
    complete = pec.snapshot_share_bytes(with_optimizer_state=True, complete=True)  # the first snapshot's slot
    node = tmp_path / "node"
    for rank in range(2):
        for slot in range(NUM_SLOTS):
            (node / f"rank{rank}" / f"slot{slot}").mkdir(parents=True)
            with open(node / f"rank{rank}" / f"slot{slot}" / "data", "wb") as f:
                f.truncate(complete if slot == 0 else per_slot)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    config = _config(tmp_path, ranks_per_node=2)
    check_shm_root(config, pec, node)  # the two ranks' slots are there already
    with pytest.raises(ValueError, match="snapshot slots need"):
        check_shm_root(config, pec, node / "rank0")  # one rank's slots are not enough for two


def test_lineage_admits_only_its_current_timeline() -> None:
    lineage = Lineage("run", "fp", (Segment(0, 0), Segment(1, 10), Segment(2, 30)))
    stamp = {"run_id": "run", "fingerprint": "fp"}
    assert lineage.admits({**stamp, "generation": 0}, 10)  # before the first fork: still on the timeline
    assert not lineage.admits({**stamp, "generation": 0}, 15)  # the run resumed at 10: step 15 of gen 0 is gone
    assert lineage.admits({**stamp, "generation": 1}, 30) and not lineage.admits({**stamp, "generation": 1}, 35)
    assert lineage.admits({**stamp, "generation": 2}, 95)
    assert not lineage.admits({**stamp, "generation": 3}, 5), "a generation this lineage never had"
    assert not lineage.admits({"run_id": "other", "fingerprint": "fp", "generation": 2}, 95)
    assert not lineage.admits({"run_id": "run", "fingerprint": "other", "generation": 2}, 95)
    assert not lineage.admits(None, 5)
    assert Lineage.from_json(lineage.to_json()) == lineage
    with pytest.raises(ValueError, match="segment 1"):
        Lineage.from_json({**lineage.to_json(), "segments": [[0, 0], [2, 5]]})


def test_a_persist_into_another_runs_storage_writes_nothing(tmp_path: Path) -> None:
    """Two runs at one storage URL (the second started with resume=never while the first still trains): the
    first run's next persist is refused before any rank writes, so the second run's checkpoints stay intact."""
    def engine() -> PECCheckpointer:
        topology = ExpertParallelTopology.from_process_group()
        layout = build_layout(Trainee(topology).model, None, num_experts=TINY.num_experts)
        storage = make_storage("filesystem", f"file://{tmp_path}/ckpt")
        pec = PECCheckpointer(every_step_config(1, 1), layout, topology, storage)
        pec.lineage = Lineage.start(fingerprint(layout))
        return pec

    first, second = engine(), engine()
    first.persister.commit_lineage(Manifest(lineage=first.lineage))
    first.persist(1, model_units(first.layout))
    second.persister.commit_lineage(Manifest(lineage=second.lineage))  # the second run takes the URL over
    second.persist(2, model_units(second.layout))
    written = sorted(p.stat().st_mtime_ns for p in (tmp_path / "ckpt" / "step_000000002").rglob("*"))
    with pytest.raises(PersistFailed, match=rf"lineage: LineageError: .* belongs to lineage {second.lineage.run_id}"):
        first.persist(2, model_units(first.layout))
    assert sorted(p.stat().st_mtime_ns for p in (tmp_path / "ckpt" / "step_000000002").rglob("*")) == written
    assert [r.step for r in second.read_manifest().records] == [2]
