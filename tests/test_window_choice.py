"""``checkpoint.replay.window=auto`` (issue 14 item 1): the window is the smallest W whose largest per-iteration copy
fits the copy budget of a measured iteration at the measured copy bandwidth; a pure function of those inputs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from dist_utils import run_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_run import MODEL, cpu_trainer, datamodule, moc_config
from trainee import Trainee

from moc_lightning.config import ReplayConfig
from moc_lightning.engine.layout import UnitBytes, build_layout
from moc_lightning.engine.units import dense, expert
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import SHARDED_DATA_PARALLEL
from moc_lightning.replay.core import offset_bytes, window_schedule
from moc_lightning.replay.memory import window_memory, window_sizes
from moc_lightning.replay.window_choice import COPY_BUDGET, WindowProbe, choose_window, peak_copy_bytes

UNITS = [dense("embed"), dense("blocks.0.attn"), dense("blocks.1.attn"), dense("head")]
UNITS += [expert(layer, e) for layer in (0, 1) for e in range(4)]
SIZES = {u: UnitBytes(weights=100, optimizer=200, weight_numel=25) for u in UNITS}
"""Adam-like units: the optimizer state twice the weights."""
SIZES[dense("embed")] = UnitBytes(weights=400, optimizer=800, weight_numel=100)
PEAKS = {w: peak_copy_bytes(SIZES, w) for w in range(1, len(UNITS) + 1)}
HALVES = {
    u: UnitBytes(s.weights // 2, s.optimizer // 2, s.weight_numel // 2, buffers=s.buffers) for u, s in SIZES.items()
}
"""One rank's pieces of :data:`SIZES` under FSDP2 on 2 ranks: half of every weight and optimizer tensor."""
HALVES[dense("head")] = SIZES[dense("head")]
"""... but the head whole (a unit of plain tensors, replicated on every rank)."""


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


def test_under_sharding_auto_weighs_the_copy_of_this_ranks_pieces_under_the_schedule_of_whole_units() -> None:
    """Under FSDP2/HSDP a rank copies its pieces of each unit (its local shards), not the whole units its schedule is
    planned from (the same on every rank): the choice weighs what this rank copies at each offset of that schedule."""
    local = {
        w: max(offset_bytes(HALVES, window_schedule(UNITS, w, SIZES), w)) for w in range(1, len(UNITS) + 1)
    }
    iteration = 1.0
    bandwidth = local[2] / (COPY_BUDGET * iteration) * (1 + 1e-9)  # this rank's copy at W=2 takes the budget
    choice = choose_window(SIZES, copy_bandwidth=bandwidth, iteration_seconds=iteration, local=HALVES)
    print(local, choice.describe())
    expected = min(w for w, peak in local.items() if peak <= local[2])
    assert choice.window == expected and choice.fits and choice.copy_bytes == local[expected]
    whole = choose_window(SIZES, copy_bandwidth=bandwidth, iteration_seconds=iteration)
    assert whole.window > choice.window, "sized whole, each offset's copy looks twice as large, and W too"
    assert choose_window(SIZES, copy_bandwidth=bandwidth, iteration_seconds=iteration, local=SIZES) == whole
    with pytest.raises(ValueError, match="the same units"):
        choose_window(SIZES, bandwidth, iteration, local={dense("head"): SIZES[dense("head")]})


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
    """One sizing for all three (:func:`~moc_lightning.replay.memory.window_sizes`): before the optimizer's first
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


def _fit_auto(rank: int, world_size: int, root: str, data_parallel: str = "ddp", ep: int = 2) -> dict:
    moc = MoCCheckpoint(moc_config(Path(root), mode="replay", replay=ReplayConfig(window="auto")))
    kw = {}
    if data_parallel in SHARDED_DATA_PARALLEL:
        kw["strategy"] = ModelParallelStrategy(
            data_parallel_size=world_size, tensor_parallel_size=1, process_group_backend="gloo"
        )
    trainer = cpu_trainer(Path(root) / "run", 8, [moc], devices=world_size, **kw)
    module = GPTMoEModule(MODEL, ep=ep, seed=0, data_parallel=data_parallel)
    trainer.fit(module, datamodule=datamodule(), ckpt_path=moc.resume_target())
    layout = moc.engine.pec.layout
    return {
        "choice": asdict(moc.window_choice),
        "window": moc.capture.window,
        "copied": list(moc.window_memory.per_iteration),
        "whole": [sum(s.total for s in window_sizes(layout, local=local).values()) for local in (False, True)],
    }


@pytest.mark.slow
def test_under_ddp_every_rank_captures_windows_of_the_coordinators_choice(tmp_path: Path) -> None:
    """Two ranks (EP=2: each holds other experts) time their own iterations; all take rank 0's W, or their windows
    would end at different steps and no window would be common to all."""
    ranks = run_ranks(_fit_auto, 2, tmp_path, str(tmp_path), init_process_group=False)
    print(ranks)
    assert ranks[0]["choice"] == ranks[1]["choice"] and ranks[0]["window"] == ranks[1]["window"] == ranks[0]["choice"]["window"]


@pytest.mark.slow
def test_under_fsdp2_the_choice_weighs_each_ranks_shards_and_every_rank_takes_the_coordinators(tmp_path: Path) -> None:
    """Two FSDP2 ranks: each holds half of every unit's weights and optimizer state. The coordinator's W, chosen from
    the copy of its pieces (what its captures copy, :func:`window_memory`), not of whole units, is every rank's."""
    ranks = run_ranks(_fit_auto, 2, tmp_path, str(tmp_path), "fsdp2", 1, init_process_group=False)
    print(ranks)
    choice = ranks[0]["choice"]
    assert ranks[1]["choice"] == choice and ranks[0]["window"] == ranks[1]["window"] == choice["window"]
    whole, local = ranks[0]["whole"]
    assert local < whole, "the units are sharded: a rank holds less than the whole of them"
    assert choice["copy_bytes"] == max(ranks[0]["copied"]), "weighed as its captures copy: its shards"
