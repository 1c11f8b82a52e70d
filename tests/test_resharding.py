"""A checkpoint written with one (world size, EP degree) loads bitwise under another, merging steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import run_ranks
from test_checkpointer import check_round_trip
from trainee import load_fresh, train_and_checkpoint

from moc_lightning.units import parse_unit

pytestmark = pytest.mark.xdist_group("resharding")  # one pytest-xdist worker writes the module's checkpoints once


@pytest.fixture(scope="module", params=["filesystem", "tensorstore"])
def written_by_4_ranks_ep2(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict]:
    """Checkpoints at steps 2 and 4 written by 4 ranks in 2 EP groups of 2; every rank's captured state."""
    root = tmp_path_factory.mktemp("reshard")
    url = (root / "ckpt").as_uri()
    results = run_ranks(train_and_checkpoint, 4, root, url, 2, request.param)
    merged = dict(results[0])
    merged["captured"] = {
        step: {key: t for r in results for key, t in r["captured"][step].items()} for step in (2, 4)
    }
    merged["backend"] = request.param
    return url, merged


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "ep"), [(2, 2), (2, 1), (1, None)])
def test_load_under_another_topology(
    tmp_path: Path, written_by_4_ranks_ep2: tuple[str, dict], world_size: int, ep: int | None
) -> None:
    url, written = written_by_4_ranks_ep2
    backend = written["backend"]
    if world_size == 1:
        loaded = [load_fresh(0, 1, url, None, backend)]
    else:
        loaded = run_ranks(load_fresh, world_size, tmp_path, url, ep, backend)
    for result in loaded:
        check_round_trip(written | result)
    experts = {parse_unit(k).key for r in loaded for k in r["loaded"] if k.startswith("expert/")}
    assert len(experts) == 2 * 8, "every expert of both MoE layers is restored somewhere"
