"""``checkpoint.replay.window=auto`` (issue 14 item 1): the window is the smallest W whose largest per-iteration copy
fits the copy budget of a measured iteration at the measured copy bandwidth; a pure function of those inputs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from dist_utils import run_ranks
from lightning_run import MODEL, cpu_trainer, datamodule, moc_config
from trainee import Trainee

from moc_lightning.callback import MoCCheckpoint
from moc_lightning.config import ReplayConfig
from moc_lightning.layout import UnitBytes, build_layout
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.replay_memory import window_memory
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.units import dense, expert
from moc_lightning.window_choice import COPY_BUDGET, WindowProbe, choose_window, peak_copy_bytes

UNITS = [dense("embed"), dense("blocks.0.attn"), dense("blocks.1.attn"), dense("head")]
UNITS += [expert(layer, e) for layer in (0, 1) for e in range(4)]
SIZES = {u: UnitBytes(weights=100, optimizer=200, weight_numel=25) for u in UNITS}
"""Adam-like units: the optimizer state twice the weights."""
SIZES[dense("embed")] = UnitBytes(weights=400, optimizer=800, weight_numel=100)
PEAKS = {w: peak_copy_bytes(SIZES, w) for w in range(1, len(UNITS) + 1)}


def test_the_peak_copy_falls_with_the_window_towards_the_logged_weights() -> None:
    full = sum(s.total for s in SIZES.values())
    weights = sum(s.weights for s in SIZES.values())
    print({w: PEAKS[w] for w in PEAKS})
    assert PEAKS[1] == full, "W=1 captures every unit whole every iteration"
    assert PEAKS[2] < PEAKS[1] and PEAKS[4] < PEAKS[2]
    assert min(PEAKS.values()) >= weights, "offset 0 logs the weights of every unit it does not capture whole"


def test_auto_takes_the_smallest_window_whose_copy_fits_the_budget() -> None:
    iteration = 1.0
    bandwidth = PEAKS[4] / (COPY_BUDGET * iteration) * (1 + 1e-9)  # W=4's copy takes the budget (and a rounding)
    choice = choose_window(SIZES, copy_bandwidth=bandwidth, iteration_seconds=iteration)
    expected = min(w for w, peak in PEAKS.items() if peak <= PEAKS[4])
    assert choice.window == expected <= 4 and choice.fits
    assert choice.copy_bytes == PEAKS[expected]
    assert choice.copy_seconds <= COPY_BUDGET * iteration
    assert choose_window(SIZES, copy_bandwidth=bandwidth, iteration_seconds=iteration) == choice, "pure"
    line = choice.describe()
    assert f"W={expected}" in line and "GB/s" in line and "iteration" in line and f"{COPY_BUDGET:.0%}" in line


def test_auto_is_one_when_a_full_copy_fits() -> None:
    choice = choose_window(SIZES, copy_bandwidth=1e12, iteration_seconds=1.0)
    assert choice.window == 1 and choice.fits


def test_when_nothing_fits_auto_takes_the_least_copy_and_says_so() -> None:
    choice = choose_window(SIZES, copy_bandwidth=1.0, iteration_seconds=1.0)
    least = min(PEAKS.values())
    assert not choice.fits and choice.copy_bytes == least
    assert choice.window == min(w for w, peak in PEAKS.items() if peak == least)
    assert 1 <= choice.window <= len(UNITS)
    assert "does not fit" in choice.describe()


def test_the_choice_sizes_a_window_as_the_memory_report_and_the_captures_do() -> None:
    """One sizing for all three (:func:`~moc_lightning.replay_memory.window_sizes`): before the optimizer's first
    step too, when a unit's optimizer state is still to come."""
    trainee = Trainee(ExpertParallelTopology.replicated())
    layout = build_layout(trainee.model, trainee.optimizer)
    probe = WindowProbe()
    while not probe.end():
        probe.begin()
    choice = probe.choose(layout)
    print(choice.describe())
    assert choice.copy_bytes == max(window_memory(layout, choice.window).per_iteration)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"copy_bandwidth": 0.0}, "copy bandwidth must be > 0"),
        ({"iteration_seconds": -1.0}, "iteration time must be > 0"),
        ({"budget": 1.5}, "copy budget must be in (0, 1]"),
    ],
)
def test_bad_inputs_are_refused(kwargs: dict, message: str) -> None:
    inputs = {"copy_bandwidth": 1e9, "iteration_seconds": 0.1, **kwargs}
    with pytest.raises(ValueError, match=None) as err:
        choose_window(SIZES, **inputs)
    assert message in str(err.value)
    with pytest.raises(ValueError, match="at least one unit"):
        choose_window({}, copy_bandwidth=1e9, iteration_seconds=0.1)


def _fit_auto(rank: int, world_size: int, root: str) -> dict:
    moc = MoCCheckpoint(moc_config(Path(root), mode="replay", replay=ReplayConfig(window="auto")))
    trainer = cpu_trainer(Path(root) / "run", 8, [moc], devices=world_size)
    trainer.fit(GPTMoEModule(MODEL, ep=2, seed=0), datamodule=datamodule(), ckpt_path=moc.resume_target())
    return {"choice": asdict(moc.window_choice), "window": moc.capture.window}


@pytest.mark.slow
def test_under_ddp_every_rank_captures_windows_of_the_coordinators_choice(tmp_path: Path) -> None:
    """Two ranks (EP=2: each holds other experts) time their own iterations; all take rank 0's W, or their windows
    would end at different steps and no window would be common to all."""
    ranks = run_ranks(_fit_auto, 2, tmp_path, str(tmp_path), init_process_group=False)
    print(ranks)
    assert ranks[0]["choice"] == ranks[1]["choice"] and ranks[0]["window"] == ranks[1]["window"] == ranks[0]["choice"]["window"]
