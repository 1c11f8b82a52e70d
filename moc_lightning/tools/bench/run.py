"""The benchmark's run: the no-checkpoint baseline, every method in turn in the same processes, the speed-of-light
bounds, and the result as a dict (:func:`run_bench`)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moc_lightning.memory.copy_speed import copy_gbps
from moc_lightning.tools.bench.bounds import Bounds
from moc_lightning.tools.bench.config import (
    GB,
    K_SCALING,
    RECOVER_MEASURED,
    SETUP,
    STALL_PHASES,
    BenchConfig,
    MethodUnavailable,
)
from moc_lightning.tools.bench.fitting import Fit, agreed, fit, gather, release_memory, slowest, this_rank
from moc_lightning.tools.bench.methods import (
    Method,
    disk_bytes,
    make_method,
    model_state_bytes,
    model_state_tensors,
    tensor_bytes,
)
from moc_lightning.tools.bench.timing import Baseline, Row

if TYPE_CHECKING:  # imported where it runs: it needs boto3
    from moc_lightning.tools.bench.object_store import ObjectStoreRow


def _mean_ms(values: list[float]) -> float | None:
    return round(statistics.fmean(values) * 1000, 3) if values else None


def _p95_ms(values: list[float]) -> float | None:
    """Nearest-rank 95th percentile (the maximum below 20 samples)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[math.ceil(0.95 * len(ordered)) - 1] * 1000, 3)


def _gbps(nbytes: list[int], seconds: list[float]) -> float | None:
    """Total bytes over total seconds; ``None`` where the method has no such phase."""
    return round(sum(nbytes) / sum(seconds) / GB, 4) if seconds and sum(seconds) > 0 else None


def _pct(value: float | None, bound: float) -> float | None:
    return round(100 * value / bound, 1) if value is not None else None


def measure(method: Method, run: Fit, cfg: BenchConfig, base: Baseline) -> Row:
    """The row of one method's run, recovery aside; its % of the speed of light are set by :func:`against_light`, once
    every trial of the bounds is in."""
    stalls = slowest(method.stalls())
    iterations = run.clock.iteration_seconds(cfg.warmup_steps)
    checkpoints = method.checkpoints()
    on_disk = round(statistics.fmean(map(disk_bytes, checkpoints))) if checkpoints else None
    copied = method.snapshot_bytes(run.trainer)
    persist = _gbps([on_disk or 0] * len(method.persist_seconds()), method.persist_seconds())
    return Row(
        name=method.name,
        checkpoints=len(stalls),
        stall_ms_mean=_mean_ms(stalls),
        stall_ms_p95=_p95_ms(stalls),
        stall_ms_per_iteration=round(sum(stalls) / cfg.steps * 1000, 3) if stalls else None,
        stall_overhead_pct=round(100 * sum(stalls) / cfg.steps / base.iteration_s, 2) if stalls else None,
        bytes_per_iteration=round(sum(copied) / cfg.steps, 1) if copied else None,
        iter_ms_mean=_mean_ms(iterations),
        iter_ms_median=round(statistics.median(iterations) * 1000, 3),
        overhead_pct=_overhead_pct(iterations, base.iteration_s),
        cpu_overhead_pct=_overhead_pct(run.clock.cpu_seconds(cfg.warmup_steps), base.cpu_s),
        bytes_per_checkpoint=on_disk,
        tensor_bytes_per_checkpoint=round(statistics.fmean(map(tensor_bytes, checkpoints))) if checkpoints else None,
        expected_bytes=round(method.expected_bytes(run.trainer)),
        snapshot_gbps=_gbps(copied, method.snapshot_seconds()),
        persist_gbps=persist,
        stall_breakdown_ms=_breakdown_ms(method.stall_phases()),
        blocking_votes=method.blocking_votes(),
        notes=method.notes,
    )


def _breakdown_ms(phases: list[tuple[float, ...]] | None) -> dict[str, float] | None:
    """Mean per snapshot of each phase of the stall (:data:`STALL_PHASES`), each snapshot's phases the slowest
    rank's (the rank whose stall, their sum, was the largest), so that they add up to the row's mean stall."""
    if phases is None:
        return None
    every = gather(phases)
    chosen = [max(ranks, key=sum) for ranks in zip(*every, strict=True)]
    if not chosen:
        return None
    return {name: round(statistics.fmean(p[i] for p in chosen) * 1000, 3) for i, name in enumerate(STALL_PHASES)}


def snapshot_light(method: Method, row: Row, repeats: int = 5) -> None:
    """The copy of the method's own snapshot tensors, measured now (after its run, before its model is freed): the best
    of ``repeats`` copies of exactly the tensors its latest snapshot copied into a reused buffer, and its mean
    snapshot's bytes; :func:`against_light` makes the bound of them. A method that copies the whole state is bounded
    by the state's copy alone."""
    tensors = method.copied_tensors()
    if tensors is None:  # the same on every rank: it is the method's kind
        return
    row.snapshot_bytes_mean = method.snapshot_bytes_mean() or 0.0
    if row.snapshot_bytes_mean:
        row.snapshot_light_gbps = round(copy_gbps(tensors, repeats), 3)


def against_light(row: Row, bounds: Bounds) -> None:
    """``row``'s snapshot and persist throughput as % of their speed of light, once every trial of the bounds is in
    (collective where a row has its own snapshot bytes: the slowest rank's time for them). A snapshot's speed of light
    is the faster of the copy of its own tensors (:func:`snapshot_light`) and the best copy of the whole state of the
    run (a trial at one loaded moment can only make a bound lower, never higher); a persist's, the best write+fsync
    trial of the run."""
    if row.snapshot_gbps is not None or row.snapshot_light_gbps is not None:
        row.snapshot_light_gbps = max(row.snapshot_light_gbps or 0.0, bounds.copy_gbps)
        row.snapshot_pct_of_light = _pct(row.snapshot_gbps, row.snapshot_light_gbps)
    if row.snapshot_bytes_mean is not None:
        gbps = row.snapshot_light_gbps or bounds.copy_gbps
        row.snapshot_light_ms = round(slowest([row.snapshot_bytes_mean / (gbps * GB) * 1000])[0], 3)
    row.persist_pct_of_light = _pct(row.persist_gbps, bounds.write_fsync_gbps)


def _overhead_pct(iterations: list[float], baseline_s: float) -> float:
    return round(100 * (statistics.fmean(iterations) / baseline_s - 1), 2)


def bench_method(name: str, cfg: BenchConfig, work: Path, shm_root: Path, base: Baseline) -> Row:
    """Train with one method, measure it, resume from its newest checkpoint, and delete what it wrote."""
    root = work / name
    _remove_on_rank0(root)  # what an interrupted earlier run left must not be measured
    try:
        method = make_method(name, root, cfg, shm_root)
    except MethodUnavailable as why:
        return Row(name=name, skipped=str(why))
    with method.session():
        beside = no_checkpoint_times(cfg, root / "baseline") if method.paired else None
        run = fit(cfg, root / "run", method.callbacks(), method.attach)
        row = measure(method, run, cfg, base)
        snapshot_light(method, row)
        base.bounds.trial(model_state_tensors(run.trainer), root)  # the bounds again, between the methods' runs
        if beside is not None:
            wall, cpu = beside
            row.paired_baseline_iter_ms = round(wall * 1000, 3)
            row.paired_overhead_pct = _overhead_pct(run.clock.iteration_seconds(cfg.warmup_steps), wall)
            row.paired_cpu_overhead_pct = _overhead_pct(run.clock.cpu_seconds(cfg.warmup_steps), cpu)
        method.release()
        del run
        release_memory()
        method.recover(cfg, row, base)
    _remove_on_rank0(root, shm_root / name)
    return row


def run_bench(cfg: BenchConfig, output_dir: Path) -> dict[str, Any]:
    """The whole benchmark: a no-checkpoint baseline, the speed of light, then every method (collective when
    ``cfg.devices`` > 1: every process of ``torchrun`` calls it, and all return the same result)."""
    with _processes(cfg):
        work = Path(agreed(cfg.work_dir or str(output_dir / "work")))  # rank 0's run dir: Hydra's may differ
        with _shared_tempdir(cfg.shm_root or _tmpfs()) as shm_root:
            return _run(cfg, work, shm_root)


@contextlib.contextmanager
def _processes(cfg: BenchConfig) -> Iterator[None]:
    """The benchmark's own process group over ``torchrun``'s processes, for its agreements (paths, the slowest
    rank's timings); Lightning's strategies find it initialised and train over it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.devices:
        raise ValueError(
            f"devices={cfg.devices} but {world} process(es) run: launch with "
            f"torchrun --standalone --nproc-per-node={cfg.devices} recipes/bench.py devices={cfg.devices}"
        )
    if world == 1:
        yield
        return
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _shared_tempdir(parent: str | None) -> Iterator[Path]:
    """A fresh directory under ``parent`` that every rank uses (rank 0 makes it and removes it at the end)."""
    path = Path(agreed(tempfile.mkdtemp(prefix="moc_bench_", dir=parent) if this_rank() == 0 else ""))
    try:
        yield path
    finally:
        _remove_on_rank0(path)


def _remove_on_rank0(*paths: Path) -> None:
    """Delete ``paths`` once every rank is done with them, and before any rank writes there again."""
    if dist.is_initialized():
        dist.barrier()
    if this_rank() == 0:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def _tmpfs() -> str | None:
    """Where snapshot slots live on a real node: memory, not disk."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def baseline(cfg: BenchConfig, work: Path) -> Baseline:
    """Train without checkpointing, then measure the speed of light for a state of that size.

    A function of its own so that the baseline's model and optimizer are freed before the methods run.
    """
    run = fit(cfg, work / "baseline", [])
    bounds = Bounds()
    bounds.trial(model_state_tensors(run.trainer), work)
    base = Baseline(
        iteration_s=_iteration_s(cfg, run),
        cpu_s=statistics.fmean(run.clock.cpu_seconds(cfg.warmup_steps)),
        state_bytes=model_state_bytes(run.trainer),
        bounds=bounds,
    )
    _remove_on_rank0(work / "baseline")
    return base


def _iteration_s(cfg: BenchConfig, run: Fit) -> float:
    """Mean iteration time after the warm-up."""
    return statistics.fmean(run.clock.iteration_seconds(cfg.warmup_steps))


def no_checkpoint_times(cfg: BenchConfig, run_dir: Path) -> tuple[float, float]:
    """Mean iteration time and CPU time per iteration of a run without checkpointing, trained now (beside a method's
    run)."""
    run = fit(cfg, run_dir, [])
    seconds = _iteration_s(cfg, run), statistics.fmean(run.clock.cpu_seconds(cfg.warmup_steps))
    release_memory()
    return seconds


def _run(cfg: BenchConfig, work: Path, shm_root: Path) -> dict[str, Any]:
    """The result document (``docs/bench.md`` has its schema)."""
    base = baseline(cfg, work)
    measured = []
    for name in cfg.methods:
        release_memory()
        measured.append(bench_method(name, cfg, work, shm_root, base))
    for row in measured:
        against_light(row, base.bounds)
    rows = [asdict(row) for row in measured]
    return {
        "world_size": cfg.devices,
        "devices": cfg.devices,
        "data_parallel": cfg.data_parallel,
        "precision": cfg.precision,
        "accelerator": cfg.accelerator,
        "setup": SETUP,
        "model": asdict(cfg.model),
        "steps": cfg.steps,
        "every_n_train_steps": cfg.every_n_train_steps,
        "replay_window": cfg.replay_window,
        "replay_persist_every_n_windows": cfg.replay_persist_every_n_windows,
        "k_scaling": K_SCALING,
        "state_bytes": base.state_bytes,
        "baseline_iter_ms": round(base.iteration_s * 1000, 3),
        "speed_of_light": {"copy_gbps": base.bounds.copy_gbps, "write_fsync_gbps": base.bounds.write_fsync_gbps},
        "speed_of_light_trials": {"copy_gbps": base.bounds.copy_trials, "write_fsync_gbps": base.bounds.write_trials},
        "recover_measured": RECOVER_MEASURED,
        "methods": rows,
        "storage": cfg.storage,
        "object_store": asdict(_object_store_row(cfg, work)) if cfg.storage == "s3" else None,
    }


def _object_store_row(cfg: BenchConfig, work: Path) -> ObjectStoreRow:
    """The ``storage=s3`` row (:mod:`~moc_lightning.tools.bench.object_store`), imported here only: it needs boto3,
    which only the ``dev`` extra installs (``BenchConfig`` checks it is there)."""
    from moc_lightning.tools.bench.object_store import object_store_row

    release_memory()
    row = object_store_row(cfg, work)
    _remove_on_rank0(work / "object_store")
    return row
