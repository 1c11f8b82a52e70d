"""The paper's accounting (ZeRO-2 + EP, mixed precision): bytes per rank by hand, and the Figure 10 report."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from moc_lightning.sharding.ownership import ShardingUnit, Topology
from moc_lightning.sharding.paper_accounting import (
    ZERO2_PLANS,
    MixedPrecision,
    eq8_rank_bytes,
    optimizer_partitions,
    zero2_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY = Topology(world_size=4, ep=2)
"""Two EP groups {0, 1} and {2, 3}: expert 0 lives on ranks 0 and 2, expert 1 on ranks 1 and 3."""


def made_up_units(experts: tuple[int, ...]) -> list[ShardingUnit]:
    """A 40-parameter embedding, dense layers of 8 and 4 parameters, experts of 10 and 6 parameters.

    bf16 weights: 80, 16, 8 bytes dense, 20 and 12 bytes experts. Optimizer (12 B/param) partitions: the
    embedding 10 params per rank (120 B), the layers 2 and 1 (24 B, 12 B), expert 0 5 params on ranks 0 and 2
    (60 B), expert 1 3 params on ranks 1 and 3 (36 B).
    """
    params = {0: 10, 1: 6}
    dense = [
        ShardingUnit("dense/emb", "dense", 40, 1, TOPOLOGY.ranks()),
        ShardingUnit("dense/a", "dense", 8, 1, TOPOLOGY.ranks()),
        ShardingUnit("dense/b", "dense", 4, 1, TOPOLOGY.ranks()),
    ]
    selected = [
        ShardingUnit(f"expert/L0/E{e}", "expert", params[e], 1, TOPOLOGY.replicas(e), layer=0, expert=e)
        for e in experts
    ]
    return dense + selected


def test_optimizer_partitions_follow_zero_replica_groups() -> None:
    assert optimizer_partitions(made_up_units((0, 1)), TOPOLOGY, 12) == (216, 192, 216, 192)


# Full checkpoint. deepspeed: rank 0 writes all dense weights (104 B) and expert 0 (20 B), rank 1 expert 1.
# EE+EN: experts halved over replicas (10, 6, 10, 6); emb -> 0, a -> 1, b -> 2 (largest first, fewest dense).
# EE+AN: loads before dense 226, 198, 226, 198; emb -> 1, a -> 3, b -> 3.
# rows: dense share 26 B, the embedding is oversized; a and b whole first, then the embedding poured to the
# line (EN: 26 B of dense on every rank; AN: 238 B in all on every rank, the ideal).
FULL = {
    "deepspeed": (340, 204, 216, 192),
    "EE+EN": (306, 214, 234, 198),
    "EE+AN": (226, 278, 226, 222),
    "EE+EN rows": (252, 224, 252, 224),
    "EE+AN rows": (238, 238, 238, 238),
}
# K=1, expert 0 only: optimizer 216, 156, 216, 156; EE+AN loads 226, 156, 226, 156: emb -> 1, a, b -> 3.
PEC = {"deepspeed": (340, 156, 216, 156), "EE+EN": (306, 172, 234, 156), "EE+AN": (226, 236, 226, 180)}


@pytest.mark.parametrize("plan", ZERO2_PLANS)
def test_full_checkpoint_bytes_per_rank_by_hand(plan: str) -> None:
    checkpoint = zero2_checkpoint(made_up_units((0, 1)), TOPOLOGY, plan, MixedPrecision(2, 12))
    assert checkpoint.rank_bytes == FULL[plan]
    assert checkpoint.optimizer_bytes == (216, 192, 216, 192)  # every rank writes its own partition, whatever the plan
    assert checkpoint.ideal_bytes == 238


@pytest.mark.parametrize("plan", list(PEC))
def test_pec_checkpoint_bytes_per_rank_by_hand(plan: str) -> None:
    checkpoint = zero2_checkpoint(made_up_units((0,)), TOPOLOGY, plan)
    assert checkpoint.rank_bytes == PEC[plan]
    assert checkpoint.busiest_bytes == max(PEC[plan])


def test_eq8_read_with_the_dp_degree_is_the_ideal_and_as_printed_is_not() -> None:
    precision = MixedPrecision(2, 12)
    assert eq8_rank_bytes(52, 16, TOPOLOGY, precision, as_printed=False) == 238
    assert eq8_rank_bytes(52, 16, TOPOLOGY, precision, as_printed=True) == 68 * 12 / 2 + 52 * 2 / 4 + 16 * 2 / 2
    one_group = Topology(world_size=2, ep=2)
    assert eq8_rank_bytes(52, 16, one_group, precision, as_printed=True) == eq8_rank_bytes(
        52, 16, one_group, precision, as_printed=False
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: zero2_checkpoint(made_up_units((0,)), TOPOLOGY, "rank0"), "allowed: deepspeed, EE+EN, EE+AN"),
        (lambda: MixedPrecision(weight_bytes=0), "weight_bytes must be >= 1"),
        (
            lambda: optimizer_partitions([ShardingUnit("dense/x", "dense", 3, 14, TOPOLOGY.ranks())], TOPOLOGY, 12),
            "counted in parameters",
        ),
    ],
)
def test_bad_inputs_name_the_option_and_what_is_allowed(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def sharding_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sharding_report", REPO / "recipes/sharding_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sharding_report", module)
    spec.loader.exec_module(module)
    return module


def test_figure10_report_prints_the_papers_numbers_beside_ours() -> None:
    report = sharding_report()
    figure = report.figure10(report.GptMoeShape(), {"Case2": Topology(world_size=16, ep=16)})
    text = figure.markdown()
    for paper in ("12–28%", "22–29%", "3.7–6.1%"):
        assert paper in text
    assert "eq. 8" in text and "D_dp" in text  # which reading of eq. 8 the code implements, and why
    rows = {(row["k"], row["plan"]): row for row in figure.as_json()["rows"]}
    assert set(rows) == {(k, plan) for k in (16, 1) for plan in ZERO2_PLANS}
    full = rows[16, "EE+EN"]["reduction_vs_deepspeed"]
    assert f"{full:.1%}" in text and 0 < full < 1
    # One EP group: equal expert sharding changes nothing, so the gain at K=N is the dense weights moved off rank 0.
    dense_weights = 2 * sum(params for _, params in report.GptMoeShape().dense_params())
    assert rows[16, "deepspeed"]["busiest_bytes"] - rows[16, "EE+EN"]["busiest_bytes"] <= dense_weights
    assert rows[1, "EE+AN"]["busiest_bytes"] <= rows[1, "EE+EN"]["busiest_bytes"]
