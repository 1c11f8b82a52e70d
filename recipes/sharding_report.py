"""Sharding report: the busiest rank's checkpoint bytes under each ownership strategy (MoC-System Fig. 10).

For GPT-350M-16E (Table 1) in the three configurations of Table 2, the units are built analytically from
the model's shapes, the experts of each checkpoint come from a sequential interleaved selection, and every
strategy of ``moc_lightning.sharding`` is scored by the busiest rank's bytes against the ideal (total bytes
over ranks). It also times the plan on simulated topologies of thousands of ranks.

Usage: ``python recipes/sharding_report.py out=FILE [plan_ranks=1024,8192]``. Markdown goes to stdout,
JSON to FILE: ``rows`` (case, strategy, k, busiest_bytes, ideal_bytes, ratio, ...), ``rows_wte_split`` (the
same with the word embedding cut into world-size row blocks) and ``plan_time`` (ranks, seconds, ...).
Run it with the repository on the import path (``pip install -e .`` or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from moc_lightning.sharding import STRATEGIES, ShardingUnit, Topology, compute_ownership
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

    def dense_params(self, wte_blocks: int = 1) -> list[tuple[str, int]]:
        """Non-expert modules at layer granularity, in state-dict order, as (name, parameter count).

        ``wte_blocks > 1`` cuts the word embedding into that many blocks of vocabulary rows, the one
        sub-layer unit that the report tries, because whole it outweighs a rank's fair share.
        """
        h = self.hidden
        layer_norm = 2 * h
        bounds = [block * self.vocab // wte_blocks for block in range(wte_blocks + 1)]
        modules = [("wte", self.vocab * h)] if wte_blocks == 1 else [
            (f"wte.rows[{start}:{stop}]", (stop - start) * h) for start, stop in zip(bounds, bounds[1:])
        ]
        modules.append(("wpe", self.seq_len * h))
        for layer in range(self.layers):
            modules.append((f"layers.{layer}.attn", layer_norm + 4 * h * h + 4 * h))
            if layer in self.moe_layers:
                modules.append((f"layers.{layer}.router", layer_norm + h * self.experts))
            else:
                modules.append((f"layers.{layer}.ffn", layer_norm + self.ffn_params))
        modules.append(("ln_f", layer_norm))
        return modules


def interleaved_selection(shape: GptMoeShape, ep: int, k: int, checkpoint: int) -> tuple[tuple[int, ...], ...]:
    """Experts saved by each MoE layer at ``checkpoint``: sequential, interleaved across layers and EP ranks.

    Position ``p`` in the rotation is expert slot ``p // ep`` of EP rank ``p % ep`` (EP rank ``r`` holds
    experts ``[r*N/ep, (r+1)*N/ep)``), so consecutive positions land on different EP ranks; MoE layer ``i``
    takes positions ``(i + checkpoint) * k + j`` for ``j < k`` (Figure 4), so every expert comes back every
    ceil(N/k) checkpoints and the layers' picks fall on different EP ranks.
    """
    per_rank = shape.experts // ep
    picks = []
    for i in range(len(shape.moe_layers)):
        positions = (((i + checkpoint) * k + j) % shape.experts for j in range(k))
        picks.append(tuple(sorted((p % ep) * per_rank + (p // ep) % per_rank for p in positions)))
    return tuple(picks)


def checkpoint_units(
    shape: GptMoeShape, topology: Topology, selection: Sequence[Sequence[int]], wte_blocks: int = 1
) -> tuple[ShardingUnit, ...]:
    """All dense units and the selected experts, in state-dict order; one row per parameter."""
    per_rank = shape.experts // topology.ep
    units = []
    for name, params in shape.dense_params(wte_blocks):
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
    wte_blocks: int
    busiest_bytes: int
    ideal_bytes: float
    whole_unit_floor_bytes: float
    """Lowest busiest rank any placement of whole dense units can reach, given the equal expert split."""

    @property
    def ratio(self) -> float:
        return self.busiest_bytes / self.ideal_bytes


def whole_unit_floor(units: Sequence[ShardingUnit], topology: Topology) -> float:
    """max(ideal, busiest expert rank, lightest expert rank + largest dense unit): no whole-unit plan beats it."""
    experts = [unit for unit in units if unit.kind == "expert"]
    expert_bytes = compute_ownership(experts, topology, "equal").rank_bytes
    largest_dense = max(unit.nbytes for unit in units if unit.kind == "dense")
    ideal = sum(unit.nbytes for unit in units) / topology.world_size
    return max(ideal, max(expert_bytes), min(expert_bytes) + largest_dense)


def score(shape: GptMoeShape, case: str, topology: Topology, strategy: str, k: int, wte_blocks: int = 1) -> Row:
    """Worst checkpoint of one full rotation (ceil(N/k) checkpoints) of the selection."""
    busiest, floor, ideal = 0, 0.0, 0.0
    for checkpoint in range(math.ceil(shape.experts / k)):
        selection = interleaved_selection(shape, topology.ep, k, checkpoint)
        units = checkpoint_units(shape, topology, selection, wte_blocks)
        ownership = compute_ownership(units, topology, strategy)
        busiest = max(busiest, ownership.busiest_bytes)
        floor = max(floor, whole_unit_floor(units, topology))
        ideal = ownership.ideal_bytes
    return Row(case, strategy, k, wte_blocks, busiest, ideal, floor)


def plan_time(shape: GptMoeShape, ranks: int, strategy: str) -> dict[str, float | int | str]:
    """Best-of-3 wall time of an uncached plan of a full checkpoint (K = N) on ``ranks`` simulated ranks."""
    topology = Topology(world_size=ranks, ep=PLAN_TIMING_EP)
    units = checkpoint_units(shape, topology, interleaved_selection(shape, topology.ep, shape.experts, 0))
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
        "| case | K | strategy | busiest GB | ideal GB | busiest/ideal | whole-unit floor/ideal | vs rank0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lighter = 1 - row.busiest_bytes / baseline[row.case, row.k]
        lines.append(
            f"| {row.case} | {row.k} | {row.strategy} | {gb(row.busiest_bytes)} | {gb(row.ideal_bytes)} "
            f"| {row.ratio:.3f} | {row.whole_unit_floor_bytes / row.ideal_bytes:.3f} | {lighter:.1%} lighter |"
        )
    return "\n".join(lines)


def target_verdicts(rows: Sequence[Row], shape: GptMoeShape) -> list[str]:
    """Targets: equal and adaptive within 1.05x of ideal at K=16, adaptive at K=1; a miss says why."""
    verdicts = []
    for row in rows:
        if not ((row.strategy in ("equal", "adaptive") and row.k == 16) or (row.strategy, row.k) == ("adaptive", 1)):
            continue
        blocks = f", wte in {row.wte_blocks} blocks" if row.wte_blocks > 1 else ""
        head = f"{row.case} {row.strategy} K={row.k}{blocks}: {row.ratio:.3f}x ideal"
        floor = row.whole_unit_floor_bytes / row.ideal_bytes
        if row.ratio <= TARGET_RATIO:
            verdicts.append(f"- {head}: meets {TARGET_RATIO}x")
        elif floor > TARGET_RATIO:
            name, params = max(shape.dense_params(row.wte_blocks), key=lambda module: module[1])
            verdicts.append(
                f"- {head}: misses {TARGET_RATIO}x, unreachable with whole dense units: the largest one ({name}, "
                f"{gb(params * BYTES_PER_PARAM)} GB) on the lightest expert rank already gives {floor:.3f}x; "
                f"this strategy is {row.busiest_bytes / row.whole_unit_floor_bytes:.3f}x that floor"
            )
        else:
            verdicts.append(f"- {head}: misses {TARGET_RATIO}x although whole units allow {floor:.3f}x")
    return verdicts


def as_json(row: Row) -> dict[str, object]:
    return {**asdict(row), "ratio": row.ratio}


def parse_args(argv: Sequence[str]) -> dict[str, str]:
    """``key=value`` arguments: ``out`` (required) and ``plan_ranks`` (comma-separated rank counts)."""
    allowed = {"out", "plan_ranks"}
    args = {"plan_ranks": "1024,8192"}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in allowed:
            raise SystemExit(f"bad argument {arg!r}: expected key=value with key in {sorted(allowed)}")
        args[key] = value
    if "out" not in args:
        raise SystemExit("missing out=FILE")
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
    split_rows = [
        score(shape, case, topology, strategy, k, wte_blocks=topology.world_size)
        for case, topology in CASES.items()
        for k in KS
        for strategy in ("equal", "adaptive")
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
        f"the sequential interleaved selection; ideal = total / ranks. dcp_default treats each unit as one "
        f"DCP write item (real DCP sees one item per tensor, a finer grain).\n"
    )
    print("## Dense units at layer granularity\n")
    print(markdown(rows, baseline))
    print("\n## Word embedding cut into world-size blocks of vocabulary rows (a layout choice)\n")
    print(markdown(split_rows, baseline))
    print("\n## Targets\n")
    print("\n".join(target_verdicts(rows + split_rows, shape)))
    print(f"\n## Plan time (uncached, best of {PLAN_TIMING_REPEATS}; 12 MoE layers x 16 experts, K=16, ep={PLAN_TIMING_EP})\n")
    print("| ranks | strategy | (unit, replica) pairs | seconds |\n|---|---|---|---|")
    for timing in timings:
        print(f"| {timing['ranks']} | {timing['strategy']} | {timing['unit_replica_pairs']} | {timing['seconds']:.4f} |")
    report = {
        "assumptions": {"weight_bytes_per_param": WEIGHT_BYTES, "optimizer_bytes_per_param": OPTIMIZER_BYTES},
        "rows": [as_json(row) for row in rows],
        "rows_wte_split": [as_json(row) for row in split_rows],
        "plan_time": timings,
    }
    Path(args["out"]).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
