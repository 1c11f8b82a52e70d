"""Sharding report: the busiest rank's checkpoint bytes under each ownership strategy (MoC-System Fig. 10).

For GPT-350M-16E (Table 1) in the three configurations of Table 2, the units are built analytically from
the model's shapes, the experts of each checkpoint come from ``moc_lightning.selection.SequentialSelection``,
and every strategy of ``moc_lightning.sharding`` is scored by the busiest rank's bytes against the ideal
(total bytes over ranks). It also times the plan on simulated topologies of thousands of ranks.

Usage: ``python recipes/sharding_report.py out=FILE [plan_ranks=1024,8192]``. Markdown goes to stdout,
JSON to FILE: ``rows`` (case, strategy, k, busiest_bytes, ideal_bytes, ratio, ...) and ``plan_time``
(ranks, seconds, ...).
Run it with the repository on the import path (``pip install -e .`` or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from moc_lightning.selection import SequentialSelection
from moc_lightning.cli import parse_key_values
from moc_lightning.sharding import STRATEGIES, Ownership, ShardingUnit, Topology, compute_ownership
from moc_lightning.units import DenseUnit, ExpertUnit

WEIGHT_BYTES = 2
"""bf16 weights."""
OPTIMIZER_BYTES = 12
"""Adam in mixed precision: fp32 master weight + exp_avg + exp_avg_sq."""
BYTES_PER_PARAM = WEIGHT_BYTES + OPTIMIZER_BYTES
CASES: dict[str, Topology] = {
    "Case1": Topology(world_size=8, ep=8),
    "Case2": Topology(world_size=16, ep=16),
    "Case3": Topology(world_size=16, ep=8),
}
"""Table 2: the world size is the DP degree; EP groups are consecutive blocks of ``ep`` ranks."""
KS = (16, 1)
TARGET_RATIO = 1.05
PLAN_TIME_LIMIT_S = 1.0
"""DESIGN.md, Scale: a plan for thousands of ranks takes well under a second."""
PLAN_TIMING_EP = 16
PLAN_TIMING_REPEATS = 3


@dataclass(frozen=True)
class GptMoeShape:
    """GPT-350M-16E (Table 1): MoE replaces the FFN of every other layer (layers 1, 3, ..., 23)."""

    layers: int = 24
    hidden: int = 1024
    experts: int = 16
    vocab: int = 50304
    """GPT-2's 50257 padded to a multiple of 128, as Megatron does; the LM head is tied to it."""
    seq_len: int = 2048
    ffn_mult: int = 4

    @property
    def moe_layers(self) -> range:
        return range(1, self.layers, 2)

    @property
    def ffn_params(self) -> int:
        """One GPT FFN (fc + proj, with biases): the size of a dense FFN and of each expert."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        return 2 * h * f + f + h

    def dense_params(self) -> list[tuple[str, int]]:
        """Non-expert modules at layer granularity, in state-dict order, as (name, parameter count)."""
        h = self.hidden
        layer_norm = 2 * h
        modules = [("wte", self.vocab * h), ("wpe", self.seq_len * h)]
        for layer in range(self.layers):
            modules.append((f"layers.{layer}.attn", layer_norm + 4 * h * h + 4 * h))
            if layer in self.moe_layers:
                modules.append((f"layers.{layer}.router", layer_norm + h * self.experts))
            else:
                modules.append((f"layers.{layer}.ffn", layer_norm + self.ffn_params))
        modules.append(("ln_f", layer_norm))
        return modules


def rotation(shape: GptMoeShape, ep: int, k: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Experts each MoE layer persists at every checkpoint of one full rotation (ceil(N/k) checkpoints).

    The rotation then repeats, so its worst checkpoint is the worst of the whole run.
    """
    policy = SequentialSelection(num_experts=[shape.experts] * len(shape.moe_layers), ep_degree=ep)
    for checkpoint in range(math.ceil(shape.experts / k)):
        yield policy.select(checkpoint, k, k).persist


def checkpoint_units(
    shape: GptMoeShape, topology: Topology, selection: Sequence[Sequence[int]]
) -> tuple[ShardingUnit, ...]:
    """All dense units and the selected experts, in state-dict order; one row per parameter."""
    per_rank = shape.experts // topology.ep
    units = []
    for name, params in shape.dense_params():
        units.append(ShardingUnit(DenseUnit(name).key, "dense", params, BYTES_PER_PARAM, topology.ranks()))
        if name.endswith(".router"):
            moe_index = shape.moe_layers.index(int(name.split(".")[1]))
            units.extend(
                ShardingUnit(
                    ExpertUnit(moe_index, e).key,
                    "expert",
                    shape.ffn_params,
                    BYTES_PER_PARAM,
                    topology.replicas(e // per_rank),
                    layer=moe_index,
                    expert=e,
                )
                for e in selection[moe_index]
            )
    return tuple(units)


@dataclass(frozen=True)
class Row:
    """One (case, strategy, K): the busiest rank over a whole rotation of the selection."""

    case: str
    strategy: str
    k: int
    busiest_bytes: int
    ideal_bytes: float
    floor_bytes: float
    """Lowest busiest rank any plan with this strategy's dense pieces can reach (see ``lower_bounds``)."""
    floor_reason: str
    """Which bound sets ``floor_bytes``."""

    @property
    def ratio(self) -> float:
        return self.busiest_bytes / self.ideal_bytes


def dense_pieces(ownership: Ownership) -> list[int]:
    """Bytes of every dense shard: whole units, or the row blocks of an oversized one."""
    return [
        shard.rows * unit.row_bytes
        for unit, shards in zip(ownership.units, ownership.shards)
        if unit.kind == "dense"
        for shard in shards
    ]


def lower_bounds(ownership: Ownership) -> dict[str, float]:
    """Bounds no plan cutting the dense units into these pieces can beat, given the equal expert split.

    The equal split (section 4.1) gives the lowest busiest expert rank: replicas hold the same experts.
    """
    experts = [unit for unit in ownership.units if unit.kind == "expert"]
    expert_bytes = compute_ownership(experts, ownership.topology, "equal").rank_bytes
    piece = max(dense_pieces(ownership))
    return {
        "the ideal": ownership.ideal_bytes,
        "the busiest expert rank alone": max(expert_bytes),
        f"the largest dense piece ({gb(piece)} GB) on the lightest expert rank": min(expert_bytes) + piece,
    }


def score(shape: GptMoeShape, case: str, topology: Topology, strategy: str, k: int) -> Row:
    """Worst checkpoint of one full rotation of the selection, and the worst floor with its reason."""
    busiest, floor, reason, ideal = 0, 0.0, "", 0.0
    for selection in rotation(shape, topology.ep, k):
        ownership = compute_ownership(checkpoint_units(shape, topology, selection), topology, strategy)
        busiest = max(busiest, ownership.busiest_bytes)
        bound_reason, bound = max(lower_bounds(ownership).items(), key=lambda item: item[1])
        if bound > floor:
            floor, reason = bound, bound_reason
        ideal = ownership.ideal_bytes
    return Row(case, strategy, k, busiest, ideal, floor, reason)


def split_dense_units(shape: GptMoeShape, topology: Topology) -> str:
    """Oversized dense units and the blocks ``equal`` pours them into: the same for every selection.

    ``equal`` places dense units ignoring experts; ``adaptive`` pours into the gaps the selection leaves.
    """
    units = checkpoint_units(shape, topology, next(rotation(shape, topology.ep, shape.experts)))
    ownership = compute_ownership(units, topology, "equal")
    share = sum(unit.nbytes for unit in units if unit.kind == "dense") / topology.world_size
    split = [
        f"{unit.key} ({gb(unit.nbytes)} GB) into {len(shards)} blocks of "
        f"<= {gb(max(shard.rows for shard in shards) * unit.row_bytes)} GB"
        for unit, shards in zip(ownership.units, ownership.shards)
        if unit.kind == "dense" and len(shards) > 1
    ]
    return f"dense share {gb(share)} GB; split {', '.join(split) or 'nothing'}"


def plan_time(shape: GptMoeShape, ranks: int, strategy: str) -> dict[str, float | int | str]:
    """Best-of-3 wall time of an uncached plan of a full checkpoint (K = N) on ``ranks`` simulated ranks."""
    topology = Topology(world_size=ranks, ep=PLAN_TIMING_EP)
    units = checkpoint_units(shape, topology, next(rotation(shape, topology.ep, shape.experts)))
    seconds = []
    for _ in range(PLAN_TIMING_REPEATS):
        start = time.perf_counter()
        compute_ownership(units, topology, strategy)
        seconds.append(time.perf_counter() - start)
    pairs = sum(len(unit.holders) for unit in units)
    return {"ranks": ranks, "ep": topology.ep, "strategy": strategy, "unit_replica_pairs": pairs, "seconds": min(seconds)}


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f}"


def markdown(rows: Sequence[Row], baseline: Mapping[tuple[str, int], int]) -> str:
    """The table, each busiest rank compared to ``baseline`` (rank0's busiest bytes per case and K)."""
    lines = [
        "| case | K | strategy | busiest GB | ideal GB | busiest/ideal | floor/ideal | vs rank0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lighter = 1 - row.busiest_bytes / baseline[row.case, row.k]
        lines.append(
            f"| {row.case} | {row.k} | {row.strategy} | {gb(row.busiest_bytes)} | {gb(row.ideal_bytes)} "
            f"| {row.ratio:.3f} | {row.floor_bytes / row.ideal_bytes:.3f} | {lighter:.1%} lighter |"
        )
    return "\n".join(lines)


def is_targeted(row: Row) -> bool:
    """Targets: equal and adaptive within 1.05x of ideal at K=16, adaptive also at K=1."""
    return (row.strategy in ("equal", "adaptive") and row.k == 16) or (row.strategy, row.k) == ("adaptive", 1)


def target_verdict(row: Row) -> str:
    """Met, or missed with the reason: unreachable with these pieces (which bound), or the strategy's fault."""
    head = f"- {row.case} {row.strategy} K={row.k}: {row.ratio:.3f}x ideal"
    floor = row.floor_bytes / row.ideal_bytes
    if row.ratio <= TARGET_RATIO:
        return f"{head}: meets {TARGET_RATIO}x"
    if floor > TARGET_RATIO:
        return f"{head}: misses {TARGET_RATIO}x, unreachable: {row.floor_reason} already gives {floor:.3f}x"
    return f"{head}: misses {TARGET_RATIO}x although its dense pieces allow {floor:.3f}x"


def plan_time_verdict(timings: Sequence[Mapping[str, float | int | str]]) -> str:
    slowest = max(timings, key=lambda timing: timing["seconds"])
    within = "within" if slowest["seconds"] < PLAN_TIME_LIMIT_S else "OVER"
    return (
        f"- plan time: slowest {slowest['seconds']:.3f} s ({slowest['strategy']}, {slowest['ranks']} ranks), "
        f"{within} {PLAN_TIME_LIMIT_S} s"
    )


def as_json(row: Row) -> dict[str, object]:
    return {**asdict(row), "ratio": row.ratio}


def parse_args(argv: Sequence[str]) -> dict[str, str]:
    """``key=value`` arguments: ``out`` (required) and ``plan_ranks`` (comma-separated rank counts)."""
    args = parse_key_values(argv, {"out", "plan_ranks"}, defaults={"plan_ranks": "1024,8192"}, required=["out"])
    return args


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    shape = GptMoeShape()
    dense = sum(params for _, params in shape.dense_params())
    expert = shape.ffn_params * shape.experts * len(shape.moe_layers)
    rows = [
        score(shape, case, topology, strategy, k)
        for case, topology in CASES.items()
        for k in KS
        for strategy in STRATEGIES
    ]
    baseline = {(row.case, row.k): row.busiest_bytes for row in rows if row.strategy == "rank0"}
    timings = [
        plan_time(shape, int(ranks), strategy) for ranks in args["plan_ranks"].split(",") for strategy in STRATEGIES
    ]
    print("# Sharding report: GPT-350M-16E (MoC-System Table 1, Table 2)\n")
    print(
        f"Assumptions: {WEIGHT_BYTES} B/param bf16 weights + {OPTIMIZER_BYTES} B/param Adam state (fp32 master, "
        f"exp_avg, exp_avg_sq), all replicated on every holder (no ZeRO), so a unit is {BYTES_PER_PARAM} B/param. "
        f"Vocab padded to {shape.vocab}, LM head tied. Parameters: dense {dense / 1e6:.1f}M, experts "
        f"{expert / 1e6:.1f}M, total {(dense + expert) / 1e9:.3f}G (Table 1 says 1.7G). Experts are split at "
        f"parameter granularity (one row per parameter). Busiest = worst checkpoint over a full rotation of "
        f"the sequential selection; ideal = total / ranks. floor = the lowest busiest rank any plan with the "
        f"strategy's dense pieces and the equal expert split can reach. dcp_default treats each unit as one "
        f"DCP write item (real DCP sees one item per tensor, a finer grain).\n"
    )
    print("## Oversized dense units (bigger than the dense share): row blocks under equal\n")
    print("\n".join(f"- {case}: {split_dense_units(shape, topology)}" for case, topology in CASES.items()))
    print("\n## Busiest rank\n")
    print(markdown(rows, baseline))
    print("\n## Targets\n")
    print("\n".join([target_verdict(row) for row in rows if is_targeted(row)] + [plan_time_verdict(timings)]))
    print(f"\n## Plan time (uncached, best of {PLAN_TIMING_REPEATS}; 12 MoE layers x 16 experts, K=16, ep={PLAN_TIMING_EP})\n")
    print("| ranks | strategy | (unit, replica) pairs | seconds |\n|---|---|---|---|")
    for timing in timings:
        print(f"| {timing['ranks']} | {timing['strategy']} | {timing['unit_replica_pairs']} | {timing['seconds']:.4f} |")
    report = {
        "assumptions": {"weight_bytes_per_param": WEIGHT_BYTES, "optimizer_bytes_per_param": OPTIMIZER_BYTES},
        "rows": [as_json(row) for row in rows],
        "plan_time": timings,
    }
    Path(args["out"]).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
