"""Project checkpointing overhead and ETTR of a long run on a large cluster (MoC-System eq. 3/4).

    python recipes/projection.py [bench=BENCH_JSON] [out=FILE] [days=14] [gpus_sweep=1024,4096,16384]
                                 [mtbf=10m,30m,2h,3.1h] [FIELD=VALUE ...]
                                 [scale=SCALE_JSON [world=16384] [model=deepseekv3] [bandwidths=bench|cluster]
                                  [scale.FIELD=VALUE ...]]

The scenario defaults to the paper's GPT-350M-16E (Table 1) trained for ``days`` on 1,024 GPUs; every
``moc_lightning.tools.projection.ClusterScenario`` field can be overridden (``gpus=4096 memory_survival=0.5``).
With ``bench=`` the per-rank bandwidths are the ones ``recipes/bench.py`` measured on this machine (MoC's
snapshot copy of ``moc_paper`` and persist of ``moc_full``, else the bench's speed-of-light bounds); without
it, or when the file is missing, the defaults below. Prints the inputs, one table of eq. 4's terms per
method, and ETTR against cluster size; ``out`` gets the same as JSON (see docs/analysis.md).

With a bench that measured ``moc_full``, ``moc_k1`` and ``moc_replay``, it also prints ETTR against the job's MTBF
(``mtbf``, default 10 min, 30 min, 2 h and Llama 3's 3.1 h) for full checkpoints, PEC with Dynamic-K and replay
mode side by side, from the bench's measured costs on this machine (:mod:`moc_lightning.tools.mtbf_projection` has the
model); ``out`` gets it as ``mtbf_sweep``.

With ``scale=`` (the JSON of ``recipes/scale_report.py``) it also prints ETTR against MTBF at ``world`` ranks (default
16,384, DeepSeek-V3-shaped) for the same three methods: control-plane costs from the scale report (measured, or its
estimate where it could not build one), bytes per rank computed from the model's shape, copy, write and restore speeds
from the bench (``bandwidths=bench``) or assumed for a GPU cluster (``bandwidths=cluster``), and the rest assumed;
every input is printed with its label, and ``scale.FIELD=VALUE`` overrides any field of
:class:`~moc_lightning.tools.scale_projection.ClusterAssumptions` (labelled assumed). ``out`` gets it as
``scale_sweep``; without a scale report the section says so.

Default assumptions (none of them measured here):

- State: 1.7e9 parameters (Table 1) x 14 bytes (bf16 weights, fp32 master weights and two Adam moments),
  86% of it in experts (Figure 2: expert weights 12% + expert optimizer state 74%); N=16, K_snapshot=4,
  K_persist=1 as in the paper's Figure 13.
- MTBF per GPU: 5.07e4 hours, from Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.4):
  419 unexpected interruptions in a 54-day period on 16,384 GPUs (54 x 24 x 16,384 / 419 GPU-hours); on 1,024
  GPUs a fault every ~49 hours. Taken as an assumption, not re-derived from other clusters.
- Iteration 1.0 s, 60% of it forward/backward that a snapshot can overlap; restart 600 s (requeue, start-up,
  process groups); device-to-host copy 10 GB/s per rank; storage 0.1 GB/s per rank (a ~100 GB/s parallel
  file system shared by 1,024 ranks).
- Intervals: full sync and PEC every 250 iterations (about Young's optimum sqrt(2 * save * MTBF) for the full
  checkpoint under these defaults), two-level snapshots every 10 and persists every 50 iterations. Every fault
  loses its node's memory (``memory_survival=0``): the conservative case for two-level recovery.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moc_lightning.tools.cli import parse_key_values
from moc_lightning.tools.mtbf_projection import DEFAULT_MTBFS, CheckpointCosts, MtbfPoint, parse_duration, project_mtbf
from moc_lightning.tools.projection import HOUR, ClusterScenario, Projection, project_all
from moc_lightning.tools.scale_projection import (
    BANDWIDTHS,
    ClusterAssumptions,
    Figure,
    ScaleInputs,
    checkpoint_parts,
    load_inputs,
    replay_parts,
    scale_costs,
)

DAY = 24 * HOUR
PAPER_PARAMS = 1.7e9
BYTES_PER_PARAM = 14
LLAMA3_MTBF_GPU_HOURS = 54 * 24 * 16_384 / 419
DEFAULTS = ClusterScenario(
    gpus=1024,
    total_iterations=int(14 * DAY / 1.0),
    iteration_seconds=1.0,
    full_bytes=PAPER_PARAMS * BYTES_PER_PARAM,
    expert_share=0.86,
    num_experts=16,
    k_snapshot=4,
    k_persist=1,
    mtbf_gpu_hours=LLAMA3_MTBF_GPU_HOURS,
    snapshot_gbps=10.0,
    persist_gbps=0.1,
    restart_seconds=600.0,
    checkpoint_interval=250,
    snapshot_interval=10,
    persist_interval=50,
    overlap_fraction=0.6,
    memory_survival=0.0,
)
MEASURED = {
    "snapshot_gbps": ("moc_paper", "snapshot_gbps", "copy_gbps"),
    "persist_gbps": ("moc_full", "persist_gbps", "write_fsync_gbps"),
}
"""Scenario field <- (bench method, its figure, speed-of-light fallback)."""


def measured_bandwidths(bench: Mapping[str, Any]) -> dict[str, tuple[float, str]]:
    """Per-rank bandwidths from a bench result: the MoC method's figure, else the speed-of-light bound."""
    methods = {row["name"]: row for row in bench.get("methods", [])}
    found = {}
    for field, (method, figure, bound) in MEASURED.items():
        value = methods.get(method, {}).get(figure)
        if value:
            found[field] = (float(value), f"bench {method}.{figure}")
        elif bench.get("speed_of_light", {}).get(bound):
            found[field] = (float(bench["speed_of_light"][bound]), f"bench speed_of_light.{bound}")
    return found


def build_scenario(args: Mapping[str, str]) -> tuple[ClusterScenario, dict[str, str]]:
    """Defaults, then bench figures, then ``FIELD=VALUE`` overrides; and where each value came from."""
    values = dataclasses.asdict(DEFAULTS)
    sources = dict.fromkeys(values, "default")
    bench_path = Path(args["bench"]) if "bench" in args else None
    if bench_path is not None and bench_path.exists():
        for field, (value, source) in measured_bandwidths(json.loads(bench_path.read_text())).items():
            values[field], sources[field] = value, source
    if "days" in args:
        iteration = float(args.get("iteration_seconds", values["iteration_seconds"]))
        values["total_iterations"], sources["total_iterations"] = int(float(args["days"]) * DAY / iteration), "days="
    for field in values.keys() & args.keys():
        values[field], sources[field] = type(values[field])(args[field]), "argument"
    return ClusterScenario(**values), sources


def projection_table(scenario: ClusterScenario, projections: Sequence[Projection]) -> str:
    """Markdown: eq. 4's terms per method, in hours over the whole run, and ETTR."""
    lines = [
        "| method | stall per save (s) | expected faults | save (h) | restart (h) | lost work (h) | O_ckpt (h) "
        "| ETTR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in projections:
        lines.append(
            f"| {p.method} | {p.stall_per_save:.4f} | {p.expected_faults:.2f} | {p.save_seconds / HOUR:.2f} "
            f"| {p.restart_seconds / HOUR:.2f} | {p.lost_seconds / HOUR:.2f} | {p.overhead_seconds / HOUR:.2f} "
            f"| {p.ettr(scenario.useful_seconds):.4f} |"
        )
    return "\n".join(lines)


def gpu_sweep(scenario: ClusterScenario, counts: Sequence[int]) -> list[dict[str, Any]]:
    """ETTR of every method as the same run is spread over more GPUs (more faults, fewer bytes per rank)."""
    rows = []
    for gpus in counts:
        scaled = dataclasses.replace(scenario, gpus=gpus)
        rows.append({"gpus": gpus, **{p.method: p.ettr(scaled.useful_seconds) for p in project_all(scaled)}})
    return rows


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> str:
    methods = [key for key in rows[0] if key != "gpus"]
    lines = ["| GPUs | " + " | ".join(f"ETTR {m}" for m in methods) + " |", "|---" * (len(methods) + 1) + "|"]
    lines += [f"| {row['gpus']} | " + " | ".join(f"{row[m]:.4f}" for m in methods) + " |" for row in rows]
    return "\n".join(lines)


def mtbf_table(costs: CheckpointCosts, table: Sequence[Sequence[MtbfPoint]]) -> str:
    """Markdown: the bench's costs, then :func:`ettr_table`."""
    return "\n".join([
        f"Measured (bench, one process): iteration {costs.iteration_seconds * 1000:.1f} ms; stall per checkpoint "
        f"full {costs.full_stall * 1000:.1f} ms, PEC K=1 {costs.k1_stall * 1000:.1f} ms (N={costs.num_experts}); "
        f"replay {costs.replay_stall_per_iteration * 1000:.1f} ms per iteration (W={costs.replay_window}); recovery "
        f"full {costs.full_recover:.2f} s, K=1 {costs.k1_recover:.2f} s, replay {costs.replay_recover:.2f} s "
        f"(its replay {costs.replay_seconds:.2f} s); restart {costs.restart_seconds:g} s; Dynamic-K threshold "
        f"{costs.plt_threshold:.2%}.",
        "",
        ettr_table(table),
    ])  # fmt: skip


def ettr_table(table: Sequence[Sequence[MtbfPoint]]) -> str:
    """Markdown: per MTBF, each method's ETTR with what it is made of (interval and the floor its background work
    sets, K, PLT, cost of a fault)."""
    lines = [
        "| MTBF | " + " | ".join(f"ETTR {p.method}" for p in table[0]) + " | full: interval (floor) "
        "| pec: K, interval (floor), PLT | replay: s per fault |",
        "|---" * (len(table[0]) + 4) + "|",
    ]
    for full, pec, replay in table:
        lines.append(
            f"| {_duration(full.mtbf_seconds)} | {full.ettr:.4f} | {pec.ettr:.4f} | {replay.ettr:.4f} "
            f"| {full.interval} ({full.interval_floor}) | K={pec.k}, {pec.interval} ({pec.interval_floor}), "
            f"{pec.plt:.2%} | {replay.per_fault_seconds:.2f} |"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / HOUR:g} h" if seconds >= HOUR else f"{seconds / 60:g} min"


def mtbf_sweep(args: Mapping[str, str]) -> tuple[CheckpointCosts, list[list[MtbfPoint]]] | str:
    """The MTBF table from ``bench=``, or why there is none."""
    bench_path = Path(args["bench"]) if "bench" in args else None
    if bench_path is None or not bench_path.exists():
        return "no bench result (bench=FILE): ETTR against MTBF needs the measured costs"
    try:
        costs = CheckpointCosts.from_bench(json.loads(bench_path.read_text()))
    except ValueError as why:
        return str(why)
    return costs, project_mtbf(costs, [parse_duration(d) for d in args["mtbf"].split(",")])


ScaleSweep = tuple[ScaleInputs, CheckpointCosts, list[list[MtbfPoint]]]
SCALE_PREFIX = "scale."
"""Arguments ``scale.FIELD=VALUE`` override :class:`ClusterAssumptions` fields (the scenario above has its own)."""


def scale_sweep(args: Mapping[str, str]) -> ScaleSweep | str:
    """ETTR against MTBF at ``world`` ranks from the scale report (``scale=``) and the bench, or why there is none."""
    overrides = {k.removeprefix(SCALE_PREFIX): v for k, v in args.items() if k.startswith(SCALE_PREFIX)}
    paths = {name: Path(args[name]) if name in args else None for name in ("scale", "bench")}
    try:
        inputs = load_inputs(paths["scale"], paths["bench"], args["model"], int(args["world"]), args["bandwidths"],
                             overrides)  # fmt: skip
    except ValueError as why:
        return str(why)
    costs = scale_costs(inputs)
    return inputs, costs, project_mtbf(costs, [parse_duration(d) for d in args["mtbf"].split(",")])


def _value(figure: Figure) -> str:
    if figure.name.endswith("bytes") or "_bytes[" in figure.name:
        return f"{figure.value / 1e9:,.3f} GB" if figure.value >= 1e7 else f"{figure.value:,.0f} B"
    return f"{figure.value:,.0f}" if figure.value.is_integer() else f"{figure.value:,.4g}"


def scale_tables(inputs: ScaleInputs, table: Sequence[Sequence[MtbfPoint]]) -> str:
    """Markdown: every input with its label, the parts of each method's costs, then :func:`ettr_table`."""
    lines = ["| input | value | label | source |", "|---|---|---|---|"]
    lines += [f"| {f.name} | {_value(f)} | {f.label} | {f.source} |" for f in inputs.figures]
    k1, full, replay = checkpoint_parts(inputs, "1"), checkpoint_parts(inputs, "N"), replay_parts(inputs)
    lines += ["", f"| seconds | K=1 | K=N={inputs.num_experts} |", "|---|---|---|"]
    parts = ("copy_stall", "collective", "plan_on_thread", "stall", "plan_off_thread", "write", "coordinator",
             "metadata_write", "commit", "background", "exchange", "recovery_plan", "restore", "recover")  # fmt: skip
    for part in parts:
        bold = "**" if part in ("stall", "background", "recover") else ""
        lines.append(f"| {bold}{part}{bold} | {getattr(k1, part):,.3f} | {getattr(full, part):,.3f} |")
    lines += [
        "",
        f"Replay (W={int(inputs['replay_window'])}): stall {replay.stall_per_iteration:,.3f} s per iteration; a "
        f"recovery restores its window in {replay.restore:,.1f} s and replays {replay.replay:,.1f} s.",
        "",
        ettr_table(table),
    ]
    return "\n".join(lines)


def scale_json(sweep: ScaleSweep | str) -> dict[str, Any]:
    """The ``out`` file's ``scale_sweep``: inputs, parts, costs and ETTR per MTBF; or why there is none."""
    if isinstance(sweep, str):
        return {"unavailable": sweep}
    inputs, costs, table = sweep
    return {
        "model": inputs.model,
        "world_size": inputs.world_size,
        "inputs": [dataclasses.asdict(f) for f in inputs.figures],
        "parts": {
            "K=1": dataclasses.asdict(checkpoint_parts(inputs, "1")),
            "K=N": dataclasses.asdict(checkpoint_parts(inputs, "N")),
            "replay": dataclasses.asdict(replay_parts(inputs)),
        },
        "costs": dataclasses.asdict(costs),
        "mtbf": _mtbf_json(table),
    }


def _mtbf_json(table: Sequence[Sequence[MtbfPoint]]) -> list[dict[str, Any]]:
    return [
        {"mtbf_seconds": row[0].mtbf_seconds, "methods": {p.method: dataclasses.asdict(p) for p in row}}
        for row in table
    ]


def as_json(
    scenario: ClusterScenario,
    sources: Mapping[str, str],
    projections: Sequence[Projection],
    sweep: Sequence[Mapping[str, Any]],
    mtbf: Sequence[Sequence[MtbfPoint]] = (),
    scale: ScaleSweep | str = "not run",
) -> dict[str, Any]:
    """The ``out`` file (docs/analysis.md)."""
    useful = scenario.useful_seconds
    return {
        "scenario": dataclasses.asdict(scenario),
        "sources": dict(sources),
        "useful_seconds": useful,
        "cluster_mtbf_seconds": scenario.cluster_mtbf_seconds,
        "methods": [
            {**dataclasses.asdict(p), "overhead_seconds": p.overhead_seconds, "ettr": p.ettr(useful)}
            for p in projections
        ],
        "gpu_sweep": list(sweep),
        "mtbf_sweep": _mtbf_json(mtbf),
        "scale_sweep": scale_json(scale),
    }


def parse_args(argv: Sequence[str]) -> dict[str, str]:
    """``key=value`` arguments: ``bench``, ``out``, ``days``, ``gpus_sweep``, ``mtbf``, any scenario field; for the
    projection at scale ``scale``, ``world``, ``model``, ``bandwidths`` and ``scale.FIELD`` of
    :class:`ClusterAssumptions`."""
    allowed = {"bench", "out", "days", "gpus_sweep", "mtbf", "scale", "world", "model", "bandwidths",
               *(f.name for f in dataclasses.fields(ClusterScenario)),
               *(SCALE_PREFIX + f.name for f in dataclasses.fields(ClusterAssumptions))}  # fmt: skip
    defaults = {"gpus_sweep": "1024,4096,16384", "mtbf": ",".join(DEFAULT_MTBFS), "world": "16384",
                "model": "deepseekv3", "bandwidths": BANDWIDTHS[0]}  # fmt: skip
    return parse_key_values(argv, allowed, defaults=defaults)


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    scenario, sources = build_scenario(args)
    projections = project_all(scenario)
    sweep = gpu_sweep(scenario, [int(n) for n in args["gpus_sweep"].split(",")])
    print("# Projection: checkpointing overhead and ETTR (MoC-System eq. 3/4)\n")
    print("| input | value | source |\n|---|---|---|")
    print("\n".join(f"| {k} | {v:g} | {sources[k]} |" for k, v in dataclasses.asdict(scenario).items()))
    print(f"\nUseful training time {scenario.useful_seconds / DAY:.1f} days; cluster MTBF "
          f"{scenario.cluster_mtbf_seconds / HOUR:.1f} h.\n")
    print(projection_table(scenario, projections))
    print("\n## ETTR against cluster size (same run, same per-GPU MTBF)\n")
    print(sweep_table(sweep))
    print("\n## ETTR against the job's MTBF, from this machine's measured costs\n")
    measured = mtbf_sweep(args)
    if isinstance(measured, str):
        print(measured)
        mtbf: list[list[MtbfPoint]] = []
    else:
        costs, mtbf = measured
        print(mtbf_table(costs, mtbf))
    scale = scale_sweep(args)
    print(f"\n## ETTR against MTBF at {int(args['world']):,} ranks (full, PEC + Dynamic-K, replay)\n")
    print(scale if isinstance(scale, str) else scale_tables(scale[0], scale[2]))
    if "out" in args:
        Path(args["out"]).write_text(json.dumps(as_json(scenario, sources, projections, sweep, mtbf, scale), indent=1))
        print(f"\nJSON: {args['out']}")


if __name__ == "__main__":
    main(sys.argv[1:])
