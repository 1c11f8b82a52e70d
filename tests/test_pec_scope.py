"""``checkpoint.pec_scope`` (paper Figure 13a): which part of an expert unit follows PEC.

``both`` ("WO"): weights and optimizer state of K experts per MoE layer per checkpoint; ``optimizer`` ("O"):
every expert's weights every time, the optimizer state of K; ``weights`` ("W"): every expert's optimizer state
every time, the weights of K. A recovery takes each part of each unit from its newest surviving copy, and an
expert loses the tokens since its stalest part. Checked bitwise against the state a separate callback (or the
test itself) recorded at every checkpoint step, never against what MoC reports about itself alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from lightning_run import Recorder, check_sources, fit_or_crash, moc_config
from test_checkpointer import check_round_trip
from trainee import TINY, Trainee, every_step_config, load_fresh, train_and_checkpoint

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.size_model import size_model
from moc_lightning.models import ExpertParallelTopology

SCOPES = ("both", "optimizer", "weights")
"""Under ``optimizer`` and ``weights`` the scope names the part of an expert that only K experts per layer get."""


def test_pec_scope_is_validated_naming_the_option_and_the_choices() -> None:
    assert CheckpointConfig().pec_scope == "both"
    with pytest.raises(ValueError, match=r"checkpoint.pec_scope='wo' is not allowed; choose one of: both, optimizer, weights"):
        CheckpointConfig(pec_scope="wo")


@pytest.mark.parametrize("scope", SCOPES)
def test_persist_bytes_match_eq6_of_the_scope(tmp_path: Path, scope: str) -> None:
    trainee = Trainee(ExpertParallelTopology())
    trainee.step(1)
    engine = trainee.engine(every_step_config(1, 1, pec_scope=scope), tmp_path.as_uri())
    report = engine.checkpoint(1)
    model = size_model(engine.layout)
    print(f"pec_scope={scope} K=1: written {report.bytes_written} B, eq. 6 {model.c_pec(1, scope):.0f} B "
          f"(eq. 5 {model.c_full():.0f} B)")
    assert report.bytes_written == pytest.approx(model.c_pec(1, scope), rel=0.01)
    assert report.bytes_written == report.expected_bytes
    both, optimizer, weights = (model.c_pec(1, s) for s in SCOPES)
    assert both < optimizer < weights < model.c_full(), "every expert's Adam state (2x its weights) makes W the larger"
    assert model.c_pec(TINY.num_experts, scope) == pytest.approx(model.c_full())


@pytest.mark.parametrize("scope", SCOPES)
def test_storage_round_trip_restores_each_part_from_its_step_and_counts_plt_by_hand(
    tmp_path: Path, scope: str
) -> None:
    """Checkpoints at steps 2 and 4 (K=4 of 8, disjoint): dense units and each expert's non-PEC part come from
    step 4; the PEC part of an expert not taken at step 4 from step 2, and its tokens of steps 3-4 are lost."""
    url = tmp_path.as_uri()
    check_round_trip(train_and_checkpoint(0, 1, url, pec_scope=scope) | load_fresh(0, 1, url), scope)


def _config(tmp_path: Path, scope: str) -> CheckpointConfig:
    """Snapshots at 5, 10, 15 (K=2), persists at 5 (complete) and 15 (K=1)."""
    return moc_config(tmp_path, k_snapshot=2, k_persist=1, every_n_train_steps=5, persist_every_n_snapshots=2,
                      pec_scope=scope)


def _mixed(sources: dict[str, dict[str, Any]]) -> list[str]:
    """Experts whose two parts came from different steps."""
    return [u for u, s in sources.items() if "parts" in s and s["parts"]["weights"]["step"] != s["parts"]["optimizer"]["step"]]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("level", ["storage", "memory"])
def test_lightning_recovery_takes_each_part_from_its_newest_copy(tmp_path: Path, scope: str, level: str) -> None:
    first = Recorder(at=(5, 10, 15), crash_after=17)
    crashed = fit_or_crash(tmp_path, _config(tmp_path, scope), 30, first)
    stats, size = crashed.engine.stats, crashed.engine.pec.size_model()
    assert [r.step for r in stats.persist_reports] == [5, 15]
    assert stats.persist_reports[1].expected_bytes == pytest.approx(size.c_pec(1, scope), rel=0.01)
    assert stats.snapshot_bytes[1] == pytest.approx(size.c_pec(2, scope), rel=0.01), "a snapshot follows the scope"
    if level == "storage":
        shutil.rmtree(tmp_path / "shm")
    resumed = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path, scope), 20, resumed)
    sources = moc.recovery.sources
    assert moc.recovery.resume_step == 15 and resumed.start_step == 15
    check_sources(first, resumed, sources)
    levels = {s["level"] for s in sources.values()}
    assert levels == {"storage"} if level == "storage" else "memory_local" in levels
    if scope == "both":
        assert not any("parts" in s for s in sources.values()), "the per-unit format of sources is unchanged"
        return
    mixed = _mixed(sources)
    assert mixed, "some expert's non-PEC part is newer than its PEC part"
    for unit in mixed:
        parts = sources[unit]["parts"]
        assert parts[scope]["step"] < parts[_other(scope)]["step"] == 15
        assert sources[unit]["step"] == parts[scope]["step"], "an expert's step is its stalest part's"


def _other(scope: str) -> str:
    return "weights" if scope == "optimizer" else "optimizer"


def test_a_lineage_written_under_one_scope_resumes_under_another(tmp_path: Path) -> None:
    """Checkpoints written under ``optimizer`` hold single parts; a restart under ``both`` still takes each part
    from its newest copy and reports the parts of the experts whose parts differ."""
    first = Recorder(at=(5, 10, 15), crash_after=17)
    fit_or_crash(tmp_path, _config(tmp_path, "optimizer"), 30, first)
    shutil.rmtree(tmp_path / "shm")
    resumed = Recorder()
    moc = fit_or_crash(tmp_path, _config(tmp_path, "both"), 20, resumed)
    assert moc.recovery.resume_step == 15
    check_sources(first, resumed, moc.recovery.sources)
    assert _mixed(moc.recovery.sources), "the parts written under optimizer are used"
