"""What each method costs a job of 16,384 ranks, from the scale report and the bench, every input labelled (issue 30,
item 4); :mod:`moc_lightning.tools.mtbf_projection` turns the costs into ETTR against MTBF.

Inputs, each a :class:`Figure` labelled by where it comes from:

- **measured**: the control plane, from the scale report's rows of the model at that world size with K=1 and K=N
  (:mod:`moc_lightning.tools.scale_report`: the library's own functions on simulated ranks, in one process): one rank's
  write plan, the coordinator's global plan and ``.metadata``, the manifest commit, the recovery exchange and plan, the
  snapshot's collective. With the bench's bandwidths, the copy, write and restore speeds are measured too, on this
  machine (CPU, gloo, one process per rank: ``recipes/bench.py``).
- **estimated**: a coordinator plan too large to build here: the scale report's linear extrapolation in write items
  (``coordinator_plan_s_estimate``, ``metadata_bytes_estimate``). A report without one is refused, never guessed.
- **computed**: bytes from the model's shape as the engine places it (ZeRO-2 + EP, bf16 weights with fp32 master and
  moments): :func:`~moc_lightning.tools.scale_report.rank_bytes` and
  :func:`~moc_lightning.tools.scale_report.replay_bytes`. A synchronous job waits for its busiest rank: the maxima.
- **assumed**: what nothing here can measure, :class:`ClusterAssumptions` (each default's source is in its field's
  docstring); and any figure given as an argument, a bandwidth included.

The model, per checkpoint of K experts per layer (PEC with Dynamic-K interpolates linearly between K=1 and K=N, as the
MTBF projection does; full checkpoints are K=N), in seconds:

- **Stall** (the training thread): the busiest rank's snapshot copy less what the next forward and backward hide
  (``max(0, snapshot_max / copy - overlap * iteration)``; on this machine nothing hides it, on a GPU the copy runs on a
  side stream), the snapshot's one all-reduce (``latency + 2 * bytes / network``, a ring's traffic), and the rank's
  write plan where the scale report says it runs on the training thread.
- **Background** (the persist thread; at most one persist in flight, so the least interval between checkpoints, which
  floors Young's): the write plan where it runs off the training thread, the write (the busiest rank's bytes at a
  rank's write speed, or every rank's at the file system's aggregate, whichever is slower), the coordinator's global
  plan and its ``.metadata`` write, and the manifest commit.
- **Recovery**: the inventory exchange (``latency + exchange bytes / network``), the recovery plan, and the restore
  from memory *as implemented* (:mod:`moc_lightning.memory.restoring`): unit after unit, its owner reads it from its
  slot and broadcasts it to the unit's holders only (every rank for a dense unit, an expert's replicas for an
  expert; the replica groups' broadcasts run side by side), and a unit's ZeRO owner restores its optimizer state from
  its own slot. So the busiest rank copies in the weights of the units it holds and the state it keeps
  (``restored / restore + restored / network + held units * latency``, a bound: the kept state does not cross the
  network).
- **Replay** (window W): each iteration copies what :func:`~moc_lightning.tools.scale_report.replay_bytes` says the
  busiest rank copies at that offset, less the overlap, plus the snapshot's all-reduce, averaged over the window; a
  recovery restores the busiest rank's window at the restore speed and replays W-1 iterations at the iteration time.
  Its window written to storage every few windows is not in the model.

Restart is a fixed assumed time per fault; faults, lost work and Dynamic-K are :mod:`mtbf_projection`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moc_lightning.tools.mtbf_projection import CheckpointCosts
from moc_lightning.tools.projection import GB
from moc_lightning.tools.scale_report import MODELS, RankBytes, ReplayBytes, rank_bytes, replay_bytes

MEASURED, ESTIMATED, COMPUTED, ASSUMED = "measured", "estimated", "computed", "assumed"
BENCH = "measured on this machine (CPU, gloo)"
BANDWIDTHS = ("bench", "cluster")
"""Where the copy, write and restore speeds come from: the bench's figures, or :class:`ClusterAssumptions`'."""


@dataclass(frozen=True)
class Figure:
    """One input of the projection, with where it comes from."""

    name: str
    """What it is, with ``[K=1]``/``[K=N]`` where it depends on K, ``[t=..]`` on replay's offset."""
    value: float
    """In seconds, bytes, GB/s or a count, as the name says."""
    label: str
    """:data:`MEASURED`, :data:`ESTIMATED`, :data:`COMPUTED` or :data:`ASSUMED`."""
    source: str
    """Where it comes from: the report's row and field, the bench's figure, the shape, an argument or a default."""


@dataclass(frozen=True)
class ClusterAssumptions:
    """What the projection at scale assumes; every default has its source here."""

    iteration_seconds: float = 2.49
    """One training iteration at that scale: DeepSeek-V3's own pace (14.8 T tokens in 2.664 M H800 GPU-hours of
    pre-training, about 1,540 tokens per GPU-second; its final batch of 15,360 sequences of 4,096 tokens) spread over
    16,384 ranks: 62.9 M / (1,543 x 16,384) s."""
    restart_seconds: float = 600.0
    """Fixed cost of a fault before recovery (rescheduling, start-up, process groups): the same 600 s as
    :mod:`recipes/projection.py`'s cluster scenario. A runtime with standby machines reports ~20 s at 1,024 GPUs
    (TrainMover, OSDI'26)."""
    network_gbps: float = 50.0
    """A rank's network bandwidth, GB/s: 400 Gb/s per GPU, as Llama 3's training cluster has; DeepSeek-V3's report
    gives its InfiniBand as 50 GB/s."""
    collective_latency_seconds: float = 1e-3
    """Latency of one small collective over the whole job: order of magnitude of NCCL's tree all-reduce at 16,384
    ranks (2 log2(16,384) = 28 hops of a few microseconds, plus launch)."""
    storage_gbps: float = 2000.0
    """The parallel file system's aggregate write bandwidth, GB/s: Llama 3's Tectonic sustains 2 TB/s (Llama 3 paper,
    section 3.3.1); every rank's persist together shares it."""
    copy_gbps: float = 25.0
    """``bandwidths=cluster``: a rank's device-to-host snapshot copy, GB/s: PCIe Gen4 x16's practical ~25 GB/s (the
    8 x A800-SXM4 nodes the paper ran on; Gen5 doubles it)."""
    write_gbps: float = 6.25
    """``bandwidths=cluster``: a rank's write to the file system, GB/s: a node's 400 Gb/s storage network shared by its
    8 GPUs."""
    restore_gbps: float = 25.0
    """``bandwidths=cluster``: a rank's host-to-device restore from its snapshot slot, GB/s: as the copy."""
    overlap_fraction: float = 0.6
    """``bandwidths=cluster``: share of an iteration (its forward and backward) a side-stream copy hides behind:
    :mod:`recipes/projection.py`'s default (paper, section 2.3.1). With the bench's bandwidths it is 0: the bench's
    copies ran on the training thread."""
    replay_window: int = 8
    """Replay mode's W: the bench's default window."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "overlap_fraction":
                if not 0 <= value <= 1:
                    raise ValueError(f"ClusterAssumptions.overlap_fraction must be in [0, 1], got {value}")
            elif field.name == "collective_latency_seconds" or field.name == "restart_seconds":
                if value < 0:
                    raise ValueError(f"ClusterAssumptions.{field.name} must be >= 0, got {value}")
            elif value <= 0:
                raise ValueError(f"ClusterAssumptions.{field.name} must be > 0, got {value}")


@dataclass(frozen=True)
class ScaleInputs:
    """Everything the projection at scale takes, labelled."""

    model: str
    """The model's name in the scale report."""
    world_size: int
    """Ranks of the job."""
    num_experts: int
    """N, experts per MoE layer (K=N is a full checkpoint)."""
    figures: tuple[Figure, ...]

    def __getitem__(self, name: str) -> float:
        """The value of the input named ``name``."""
        return self.figure(name).value

    def figure(self, name: str) -> Figure:
        """The input named ``name``, with its label and source."""
        for figure in self.figures:
            if figure.name == name:
                return figure
        raise KeyError(f"no input named {name!r}")


def scale_rows(report: Mapping[str, Any], model: str, world_size: int) -> dict[str, Mapping[str, Any]]:
    """The scale report's rows of ``model`` at ``world_size`` with K=1 and K=N, keyed ``1`` and ``N``; a clear error
    naming the command that makes a missing one."""
    spec = MODELS[model]
    found: dict[str, Mapping[str, Any]] = {}
    for key, k in (("1", 1), ("N", spec.shape.experts)):
        wanted = (spec.name, world_size, k)
        rows = [r for r in report.get("rows", []) if (r["model"], r["world_size"], r["k"]) == wanted]
        if not rows:
            raise ValueError(
                f"the scale report has no row of {spec.name} at {world_size:,} ranks with K={k}: run "
                f"recipes/scale_report.py models={model} worlds={world_size} ks=1,N"
            )
        found[key] = rows[0]
    return found


def control_plane(rows: Mapping[str, Mapping[str, Any]]) -> list[Figure]:
    """The scale report's figures at K=1 and K=N: measured, or the report's estimate where it could not build one."""
    figures = []
    for key, row in rows.items():
        where = f"scale report, {row['world_size']:,} ranks, K={row['k']}"
        for field in ("plan_s", "commit_s", "recovery_exchange_bytes", "recovery_plan_s", "snapshot_collective_bytes"):
            figures.append(Figure(f"{field}[K={key}]", float(row[field]), MEASURED, f"{where}: {field}"))
        for field in ("coordinator_plan_s", "metadata_bytes"):
            figures.append(_measured_or_estimated(row, field, key, where))
        on_thread = row["plan_on_training_thread"]
        name = f"plan_on_training_thread[K={key}]"
        if on_thread is None:  # the report could not tell: the code path's answer, labelled so
            source = f"{where}: unknown ({row.get('plan_thread', 'no reason given')}); taken as off the thread"
            figures.append(Figure(name, 0.0, ASSUMED, source))
        else:
            figures.append(Figure(name, float(on_thread), MEASURED, f"{where}: plan_on_training_thread"))
    return figures


def _measured_or_estimated(row: Mapping[str, Any], field: str, key: str, where: str) -> Figure:
    if row[field] is not None:
        return Figure(f"{field}[K={key}]", float(row[field]), MEASURED, f"{where}: {field}")
    estimate = row.get(f"{field}_estimate")
    if estimate is None:
        raise ValueError(
            f"{where}: {field} is null and the report gives no {field}_estimate (a report from before the estimate "
            "fields, or nothing measured to extrapolate from): rerun recipes/scale_report.py"
        )
    reason = row.get("coordinator_plan_reason", "linear in write items")
    return Figure(f"{field}[K={key}]", float(estimate), ESTIMATED, f"{where}: {field}_estimate ({reason})")


def shape_bytes(model: str, world_size: int, window: int) -> list[Figure]:
    """Bytes per rank from the model's shape as the engine places it, at K=1 and K=N, and replay's window."""
    spec = MODELS[model]
    where = f"{spec.name} on {world_size:,} ranks, ZeRO-2 + EP {spec.ep}"
    figures = []
    for key, k in (("1", 1), ("N", spec.shape.experts)):
        placed: RankBytes = rank_bytes(spec, world_size, k)
        for field in ("snapshot_max", "persist_max", "persist_total"):
            figures.append(Figure(f"{field}_bytes[K={key}]", float(getattr(placed, field)), COMPUTED, where))
    figures.append(Figure("state_total_bytes", float(placed.state_total), COMPUTED, f"{where}: every unit, restored"))
    busiest_holder = f"{where}: the busiest rank"
    figures.append(Figure(
        "restore_bytes", float(placed.restore_max), COMPUTED,
        f"{busiest_holder}, the weights of the units it holds and the optimizer state it keeps",
    ))
    figures.append(
        Figure("restore_units", float(placed.restore_units_max), COMPUTED, f"{busiest_holder}, a broadcast a unit")
    )
    replay: ReplayBytes = replay_bytes(spec, world_size, window)
    busiest = f"{where}, W={window}: busiest rank"
    for t, nbytes in enumerate(replay.capture_max):
        figures.append(Figure(f"replay_capture_bytes[t={t}]", float(nbytes), COMPUTED, busiest))
    figures.append(Figure("replay_window_bytes", float(replay.window_max), COMPUTED, busiest))
    return figures


def bench_bandwidths(bench: Mapping[str, Any]) -> list[Figure]:
    """A rank's copy, write and restore speeds as the bench measured them: ``moc_full``'s snapshot and persist, and
    ``moc_replay``'s restore from shared memory; and no overlap (its copies ran on the training thread)."""
    rows = {row["name"]: row for row in bench.get("methods", []) if not row.get("skipped")}
    full, replay = rows.get("moc_full", {}), rows.get("moc_replay", {})
    needed = {
        "moc_full.snapshot_gbps": full.get("snapshot_gbps"),
        "moc_full.persist_gbps": full.get("persist_gbps"),
        "moc_replay.restore_memory_seconds": replay.get("restore_memory_seconds"),
        "moc_replay.restore_memory_bytes": replay.get("restore_memory_bytes"),
    }
    missing = [name for name, value in needed.items() if not value]
    if missing:
        raise ValueError(f"the bench result has no {', '.join(missing)}: run recipes/bench.py with moc_full and "
                         "moc_replay, or take the assumed cluster figures (bandwidths=cluster)")  # fmt: skip
    restore = needed["moc_replay.restore_memory_bytes"] / needed["moc_replay.restore_memory_seconds"] / GB
    return [
        Figure("copy_gbps", float(full["snapshot_gbps"]), MEASURED, f"{BENCH}: moc_full.snapshot_gbps"),
        Figure("write_gbps", float(full["persist_gbps"]), MEASURED, f"{BENCH}: moc_full.persist_gbps"),
        Figure("restore_gbps", restore, MEASURED, f"{BENCH}: moc_replay.restore_memory_bytes / _seconds"),
        Figure("overlap_fraction", 0.0, ASSUMED, "the bench's copies ran on the training thread: nothing hides them"),
    ]


def assumed(assumptions: ClusterAssumptions, overrides: Mapping[str, str], names: Sequence[str]) -> list[Figure]:
    """``names`` of :class:`ClusterAssumptions`, each labelled assumed, with its source (default or argument)."""
    figures = []
    for name in names:
        source = "argument" if name in overrides else "default: see ClusterAssumptions." + name
        figures.append(Figure(name, float(getattr(assumptions, name)), ASSUMED, source))
    return figures


BANDWIDTH_FIELDS = ("copy_gbps", "write_gbps", "restore_gbps", "overlap_fraction")
ALWAYS_ASSUMED = (
    "iteration_seconds", "restart_seconds", "network_gbps", "collective_latency_seconds", "storage_gbps",
    "replay_window",
)  # fmt: skip


def scale_inputs(
    report: Mapping[str, Any],
    bench: Mapping[str, Any] | None,
    model: str = "deepseekv3",
    world_size: int = 16_384,
    bandwidths: str = "bench",
    overrides: Mapping[str, str] | None = None,
) -> ScaleInputs:
    """Every input of the projection, labelled. ``overrides``: :class:`ClusterAssumptions` fields given as arguments
    (a bandwidth given so replaces the bench's and is assumed)."""
    if model not in MODELS:
        raise ValueError(f"model={model!r}: expected one of {sorted(MODELS)}")
    if bandwidths not in BANDWIDTHS:
        raise ValueError(f"bandwidths={bandwidths!r}: expected one of {list(BANDWIDTHS)}")
    overrides = dict(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(ClusterAssumptions)}
    unknown = sorted(overrides.keys() - fields.keys())
    if unknown:
        raise ValueError(f"unknown assumption(s) {unknown}: expected some of {sorted(fields)}")
    values: dict[str, Any] = {name: int(v) if name == "replay_window" else float(v) for name, v in overrides.items()}
    assumptions = dataclasses.replace(ClusterAssumptions(), **values)
    figures = control_plane(scale_rows(report, model, world_size))
    figures += shape_bytes(model, world_size, assumptions.replay_window)
    figures += assumed(assumptions, overrides, ALWAYS_ASSUMED)
    if bandwidths == "bench":
        if bench is None:
            raise ValueError("bandwidths=bench needs a bench result (bench=FILE), or take bandwidths=cluster")
        measured = [f for f in bench_bandwidths(bench) if f.name not in overrides]
        figures += measured + assumed(assumptions, overrides, [n for n in BANDWIDTH_FIELDS if n in overrides])
    else:
        figures += assumed(assumptions, overrides, BANDWIDTH_FIELDS)
    return ScaleInputs(MODELS[model].name, world_size, MODELS[model].shape.experts, tuple(figures))


def load_inputs(
    scale: Path | None, bench: Path | None, model: str, world_size: int, bandwidths: str, overrides: Mapping[str, str]
) -> ScaleInputs:
    """:func:`scale_inputs` from the files of ``recipes/scale_report.py`` and ``recipes/bench.py``; a missing scale
    report is an error that says so (nothing at scale is made up without it), a missing bench is one where its
    bandwidths are asked for."""
    if scale is None or not scale.exists():
        raise ValueError(
            f"no scale report ({'scale=FILE' if scale is None else f'{scale} does not exist'}): the projection at "
            "scale takes its control-plane costs from the JSON of recipes/scale_report.py"
        )
    measured = json.loads(bench.read_text()) if bench is not None and bench.exists() else None
    return scale_inputs(json.loads(scale.read_text()), measured, model, world_size, bandwidths, overrides)


@dataclass(frozen=True)
class CheckpointParts:
    """One checkpoint of K experts per layer at scale, in seconds, by part (the sums :class:`CheckpointCosts` takes)."""

    copy_stall: float
    collective: float
    plan_on_thread: float
    plan_off_thread: float
    write: float
    coordinator: float
    metadata_write: float
    commit: float
    exchange: float
    recovery_plan: float
    restore: float

    @property
    def stall(self) -> float:
        return self.copy_stall + self.collective + self.plan_on_thread

    @property
    def background(self) -> float:
        return self.plan_off_thread + self.write + self.coordinator + self.metadata_write + self.commit

    @property
    def recover(self) -> float:
        return self.exchange + self.recovery_plan + self.restore


def checkpoint_parts(inputs: ScaleInputs, key: str) -> CheckpointParts:
    """The parts of a checkpoint with K=1 (``key="1"``) or K=N (``"N"``); the model is in the module docstring."""

    def at(name: str) -> float:
        return inputs[f"{name}[K={key}]"]

    latency, network = inputs["collective_latency_seconds"], inputs["network_gbps"] * GB
    write, restored = inputs["write_gbps"] * GB, inputs["restore_bytes"]
    hidden = inputs["overlap_fraction"] * inputs["iteration_seconds"]
    plan_on_thread = at("plan_on_training_thread") > 0
    return CheckpointParts(
        copy_stall=max(0.0, at("snapshot_max_bytes") / (inputs["copy_gbps"] * GB) - hidden),
        collective=latency + 2 * at("snapshot_collective_bytes") / network,
        plan_on_thread=at("plan_s") if plan_on_thread else 0.0,
        plan_off_thread=0.0 if plan_on_thread else at("plan_s"),
        write=max(at("persist_max_bytes") / write, at("persist_total_bytes") / (inputs["storage_gbps"] * GB)),
        coordinator=at("coordinator_plan_s"),
        metadata_write=at("metadata_bytes") / write,
        commit=at("commit_s"),
        exchange=latency + at("recovery_exchange_bytes") / network,
        recovery_plan=at("recovery_plan_s"),
        restore=restored / (inputs["restore_gbps"] * GB) + restored / network + inputs["restore_units"] * latency,
    )


@dataclass(frozen=True)
class ReplayParts:
    """Replay mode at scale, in seconds."""

    stall_per_iteration: float
    restore: float
    replay: float


def replay_parts(inputs: ScaleInputs) -> ReplayParts:
    """A capture every iteration (mean over the window's offsets), and a recovery's restore and replay."""
    window = int(inputs["replay_window"])
    hidden = inputs["overlap_fraction"] * inputs["iteration_seconds"]
    copy = inputs["copy_gbps"] * GB
    copies = [max(0.0, inputs[f"replay_capture_bytes[t={t}]"] / copy - hidden) for t in range(window)]
    collective = inputs["collective_latency_seconds"] + 2 * inputs["snapshot_collective_bytes[K=N]"] / (
        inputs["network_gbps"] * GB
    )
    return ReplayParts(
        stall_per_iteration=sum(copies) / window + collective,
        restore=inputs["replay_window_bytes"] / (inputs["restore_gbps"] * GB),
        replay=(window - 1) * inputs["iteration_seconds"],
    )


def scale_costs(inputs: ScaleInputs) -> CheckpointCosts:
    """The per-method costs :func:`~moc_lightning.tools.mtbf_projection.project_mtbf` takes."""
    k1, full, replay = checkpoint_parts(inputs, "1"), checkpoint_parts(inputs, "N"), replay_parts(inputs)
    return CheckpointCosts(
        iteration_seconds=inputs["iteration_seconds"],
        num_experts=inputs.num_experts,
        full_stall=full.stall,
        full_recover=full.recover,
        k1_stall=k1.stall,
        k1_recover=k1.recover,
        replay_stall_per_iteration=replay.stall_per_iteration,
        replay_recover=replay.restore + replay.replay,
        replay_seconds=replay.replay,
        replay_window=int(inputs["replay_window"]),
        restart_seconds=inputs["restart_seconds"],
        full_background=full.background,
        k1_background=k1.background,
    )
