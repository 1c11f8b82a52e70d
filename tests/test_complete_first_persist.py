"""Every unit has a stored version from a lineage's first persist on (issue 13, item 3).

With PEC alone, ``k_persist=1`` of 16 experts reaches one expert per MoE layer per persist: a recovery from
storage before 16 persists have landed returns the others to their initial weights, with no optimizer state.
The first persist of a lineage (and the snapshot it is taken from) therefore saves every unit; later ones
are PEC's, and a resume whose first persist landed does not redo it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning_run import FailFirstCommit, Recorder, check_sources, fit, fit_or_crash, moc_config
from storage_faults import fail_first_commit
from trainee import Trainee, every_step_config

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.units import parse_unit
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import ExpertParallelTopology, GPTMoEConfig
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.persist import SaveReport

MODEL_16E = GPTMoEConfig(block_size=32, num_experts=16)
MOE_LAYERS = 2  # n_layer=4, an MoE block every other one


def _config(tmp_path: Path, **kw: Any) -> CheckpointConfig:
    """Snapshots every 5 steps, every second one persisted (steps 5, 15, 25, ...), 1 of 16 experts per layer."""
    settings = {"k_snapshot": 2, "k_persist": 1, "every_n_train_steps": 5, "persist_every_n_snapshots": 2, **kw}
    return moc_config(tmp_path, **settings)


def _experts(units: tuple[str, ...]) -> list[str]:
    return [u for u in units if u.startswith("expert/")]


class SettlePersists(L.Callback):
    """Waits at every step's end for the snapshot and persist in flight: no persist is skipped as still running,
    so which steps persist does not depend on how fast this machine writes."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint)).engine.finish()


def test_no_storage_only_recovery_returns_a_unit_to_its_initial_values(tmp_path: Path) -> None:
    """Persists at steps 5, 15, 25 reach 3 of 16 experts per layer under PEC; the crash after step 27 loses
    the shared memory too, so everything comes from storage.

    Failed on 64f2238: 13 experts per layer were restored at their initial weights (source step -1) with no
    optimizer state (Adam would have started their moments from zero).
    """
    first = Recorder(at=(5, 15, 25), crash_after=27, model=MODEL_16E)
    fit_or_crash(tmp_path, _config(tmp_path), 40, first, [SettlePersists()], model=MODEL_16E)
    shutil.rmtree(tmp_path / "shm")
    resumed = Recorder(model=MODEL_16E)
    moc = fit_or_crash(tmp_path, _config(tmp_path), 36, resumed, [SettlePersists()], model=MODEL_16E)

    sources = moc.recovery.sources
    assert moc.recovery.resume_step == 25
    never = sorted(unit for unit, s in sources.items() if s["step"] < 5)
    assert not never, f"{len(never)} units have no stored version, e.g. {never[:3]}"
    assert {s["level"] for s in sources.values()} == {"storage"}
    check_sources(first, resumed, sources)
    trained = [k for k, t in first.start.items() if not t.equal(first.states[5][k])]
    assert trained, "training changes the weights"
    back_at_start = [k for k in trained if resumed.start[k].equal(first.start[k])]
    assert not back_at_start, f"{len(back_at_start)} tensors are back at their initial values: {back_at_start[:3]}"
    optimizer_state = {k for k in first.states[25] if "/optim/" in k}
    missing = sorted(optimizer_state - set(resumed.start))
    assert not missing, f"{len(missing)} optimizer tensors were not restored, e.g. {missing[:3]}"
    moments = [k for k in optimizer_state if k.endswith("/exp_avg_sq") and k.startswith("expert/")]
    assert len({parse_unit(k) for k in moments}) == MOE_LAYERS * MODEL_16E.num_experts
    assert all(resumed.start[k].any() for k in moments), "an expert's Adam moments are zero"

    # the resumed lineage's first persist had landed (step 5): its next one (step 35) is PEC's
    after = [r for r in moc.engine.pec.read_manifest().records if r.step == 35]
    assert len(after) == 1 and len(_experts(after[0].units)) == MOE_LAYERS


@pytest.mark.parametrize("complete", [True, False])
def test_first_persist_and_its_snapshot_hold_every_unit_then_pec(tmp_path: Path, complete: bool) -> None:
    """Bytes against eq. 5 (every unit) for the first persist, eq. 6 for the next; ``false`` is PEC throughout.

    Failed on 64f2238 (``complete=True``): the option did not exist (``TypeError`` building the config).
    """
    config = _config(tmp_path, complete_first_persist=complete, persist_on_fit_end=False)
    moc = fit(tmp_path, config, 16, [SettlePersists()], model=MODEL_16E)
    stats, size = moc.engine.stats, moc.engine.pec.size_model()
    reports: list[SaveReport] = stats.persist_reports
    assert [r.step for r in reports] == [5, 15]
    print(f"complete_first_persist={complete}: first persist {reports[0].expected_bytes} B "
          f"(eq. 5 {size.c_full():.0f}, eq. 6 K=1 {size.c_pec(1):.0f}), second {reports[1].expected_bytes} B")
    # eq. 5 is exact on the real tensors; eq. 6 spreads the optimizer's per-tensor scalars evenly over parameters
    if complete:
        assert reports[0].expected_bytes == pytest.approx(size.c_full(), rel=1e-9)
    else:
        assert reports[0].expected_bytes == pytest.approx(size.c_pec(1), rel=0.01)
    assert len(_experts(reports[0].units)) == (MOE_LAYERS * MODEL_16E.num_experts if complete else MOE_LAYERS)
    assert reports[1].expected_bytes == pytest.approx(size.c_pec(1), rel=0.01)
    assert len(_experts(reports[1].units)) == MOE_LAYERS
    # one rank: a complete first snapshot holds exactly what its persist wrote; PEC snapshots hold K=2 experts
    assert stats.snapshot_bytes[0] == (reports[0].expected_bytes if complete else stats.snapshot_bytes[1])
    assert stats.snapshot_bytes[1] == pytest.approx(size.c_pec(2), rel=0.01)


def test_a_failed_first_persist_is_retried_complete(tmp_path: Path) -> None:
    """Failed on 64f2238: the persists after the failed one took one expert per layer
    (``[(15, 2), (25, 2)]``), and 15 of 16 experts per layer still had no stored version."""
    config = _config(tmp_path, persist_on_fit_end=False)
    moc = fit(tmp_path, config, 26, [FailFirstCommit(), SettlePersists()], model=MODEL_16E)
    stats = moc.engine.stats
    assert stats.failed_persists == 1
    assert [(r.step, len(_experts(r.units))) for r in stats.persist_reports] == [(15, 32), (25, 2)]


def test_the_engine_alone_retries_a_failed_first_persist_complete(tmp_path: Path) -> None:
    """``PECCheckpointer.checkpoint`` (no Lightning, no snapshots) follows the same rule.

    Failed on 64f2238: ``complete_first_persist`` was an unknown option (``TypeError``).
    """
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(1, 1, complete_first_persist=True), tmp_path.as_uri())
    fail_first_commit(engine)
    trainee.step(1)
    with pytest.raises(PersistFailed):
        engine.checkpoint(1)
    experts = []
    for step in (2, 3):
        trainee.step(step)
        experts.append(len(_experts(engine.checkpoint(step).units)))
    assert experts == [sum(engine.layout.num_experts), len(engine.layout.num_experts)]
