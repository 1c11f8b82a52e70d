"""What MoC tells the user: metrics to Lightning's loggers, a JSON report of each resume, and lines on rank 0.

Metrics of a step's snapshot go straight to the loggers at that step (:func:`log_now`), at the join before its next
optimizer step: ``log_dict``'s machinery there cost 4-48 ms of the training thread per snapshot on the reference
machine (issue 30), more than the snapshot itself. So do events outside ``training_step`` (a persist landing in the
background, a replay, a window choice). A resume writes
``<default_root_dir>/moc_recovery/rank<r>.json`` (fault drills read it), and the end of a fit prints
:func:`fit_summary`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import lightning as L

from moc_lightning.config import CheckpointConfig
from moc_lightning.memory.two_level import CheckpointStats, RecoveryReport, TwoLevelCheckpointer
from moc_lightning.replay.driver import ReplayReport
from moc_lightning.replay.window_store import WindowStore


def log_now(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Hand ``metrics`` straight to the loggers at the current step: they describe events (a persist landing, a
    replay, a window choice) that happen outside ``training_step``, where ``self.log`` would not reach."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def snapshot_metrics(engine: TwoLevelCheckpointer, plt_known: bool) -> dict[str, float]:
    """The latest snapshot's timings and bytes, K, the persists skipped and failed so far, and the accumulated PLT
    (left out where it is unknown, rather than logged as 0)."""
    stats = engine.stats
    metrics = {
        "moc/stall_ms": stats.stall_seconds[-1] * 1000,
        "moc/copy_ms": stats.copy_seconds[-1] * 1000,
        "moc/snapshot_ms": stats.snapshot_seconds[-1] * 1000,
        "moc/snapshot_bytes": float(stats.snapshot_bytes[-1]),
        "moc/k_snapshot": float(engine.pec.dynamic_k.k_snapshot),
        "moc/k_persist": float(engine.pec.dynamic_k.k_persist),
        "moc/skipped_persists": float(stats.skipped_persists),
        "moc/failed_persists": float(stats.failed_persists),
        "moc/storage_retries": float(stats.storage_retries()),
    }
    if plt_known:
        metrics["moc/plt"] = engine.pec.ledger.accumulated_plt
    return metrics


class PersistLog:
    """Logs each persist once, straight to the loggers (as Lightning's ``LearningRateMonitor`` does): a persist
    lands in the background at no step of its own, possibly after the last snapshot or after fit's loop has ended,
    where ``log_dict`` would drop it."""

    def __init__(self) -> None:
        self.logged = 0
        """How many of the fit's persists (periodic ones, then the final one) are logged."""

    def log_new(self, trainer: L.Trainer, stats: CheckpointStats) -> None:
        """Log the persists accounted in ``stats`` since the last call."""
        landed = [*stats.persist_reports, *([stats.final_persist] if stats.final_persist is not None else [])]
        for report in landed[self.logged:]:
            metrics = {
                "moc/persist_step": float(report.step),
                "moc/persist_ms": report.seconds * 1000,
                "moc/persist_bytes": float(report.bytes_written),
            }
            log_now(trainer, metrics)
        self.logged = len(landed)


def report_recovery(trainer: L.Trainer, engine: TwoLevelCheckpointer, report: RecoveryReport) -> None:
    """A two-level recovery: its report, and on rank 0 a line with where the units came from, PLT and K."""
    _write(trainer, engine.rank, report.to_json())
    if engine.rank != 0:
        return
    levels: dict[str, int] = {}
    for source in report.sources.values():
        levels[source["level"]] = levels.get(source["level"], 0) + 1
    plt, accumulated = (
        (f"{report.plt:.4%}", f"{engine.pec.ledger.accumulated_plt:.4%}")
        if report.plt is not None else ("unknown (no router counts)", "unknown")
    )
    print(
        f"[moc_lightning] recovered to step {report.resume_step} in {report.recover_seconds:.2f}s: "
        f"units by source {levels}, PLT of this fault {plt}, accumulated PLT {accumulated}, "
        f"K now {engine.pec.dynamic_k.k_snapshot}/{engine.pec.dynamic_k.k_persist}"
    )


def report_replay(trainer: L.Trainer, rank: int, report: ReplayReport) -> None:
    """A replay-mode resume: its report, its figures to the loggers, and on rank 0 a line with what was restored
    from where and how long the replay took."""
    _write(trainer, rank, {"mode": "replay", **dataclasses.asdict(report)})
    log_now(trainer, {
        "moc/replay_iterations": float(report.replay_iterations), "moc/replay_seconds": report.replay_seconds,
        "moc/restore_seconds": report.restore_seconds, "moc/restore_bytes": float(report.restored_bytes),
        "moc/restore_from_memory": float(report.source == "memory"),
    })
    if rank == 0:
        print(f"[moc_lightning] restored the window from step {report.window_start} "
              f"({report.restored_bytes / 1e6:.1f} MB from {report.source}) in {report.restore_seconds:.3f}s and "
              f"replayed {report.replay_iterations} iterations in {report.replay_seconds:.2f}s; every unit is at "
              f"its fault-free state of step {report.resume_step} (PLT 0)")


def fit_summary(config: CheckpointConfig, engine: TwoLevelCheckpointer, windows: WindowStore | None) -> str:
    """Where the checkpoints are, what was taken, bytes against eq. 5/6, and the mean stall (``windows``: replay
    mode's, which takes no PEC snapshot or persist)."""
    stats, pec = engine.stats, engine.pec
    stall = sum(stats.stall_seconds) / max(1, len(stats.stall_seconds)) * 1000
    at = f" at {config.storage.endpoint}" if config.storage.endpoint else ""
    lines = [f"[moc_lightning] checkpoints: {config.storage.url}{at} (snapshots under {config.shm_root})"]
    if config.storage.url.startswith("s3://") or stats.storage_retries():
        lines.append(f"[moc_lightning] S3 requests retried: {stats.storage_retries()} on this rank "
                     f"({config.storage.retries.describe()})")
    if windows is None:
        lines.append(
            f"[moc_lightning] {stats.snapshots} snapshots, {stats.persists} persists "
            f"({stats.skipped_persists} skipped while one was in flight, {stats.failed_persists} failed), "
            f"mean stall {stall:.2f} ms per snapshot"
        )
    elif stalls := windows.stall_seconds:
        lines.append(
            f"[moc_lightning] {len(stalls)} replay windows handed over to shared memory and storage; hand-over "
            f"{sum(stalls) / len(stalls) * 1000:.2f} ms mean, {max(stalls) * 1000:.2f} ms at most on the training "
            "thread"
        )
    model = pec.size_model()
    if stats.persist_reports:
        report = stats.persist_reports[-1]
        lines.append(
            f"[moc_lightning] bytes per persist {report.expected_bytes / 1e6:.3f} MB; eq. 6 with "
            f"K={pec.dynamic_k.k_persist}: {model.c_pec(pec.dynamic_k.k_persist) / 1e6:.3f} MB; "
            f"eq. 5 (full): {model.c_full() / 1e6:.3f} MB"
        )
    if stats.final_persist is not None:
        lines.append(
            f"[moc_lightning] final persist of step {stats.final_persist.step}: every unit, "
            f"{stats.final_persist.expected_bytes / 1e6:.3f} MB (eq. 5: {model.c_full() / 1e6:.3f} MB)"
        )
    return "\n".join(lines)


def _write(trainer: L.Trainer, rank: int, report: dict[str, Any]) -> None:
    """``<default_root_dir>/moc_recovery/rank<r>.json``: what this rank's resume did (fault drills read it)."""
    directory = Path(trainer.default_root_dir) / "moc_recovery"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
