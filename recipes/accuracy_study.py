"""Accuracy study: accumulated PLT and final validation loss under repeated faults (MoC-System 3.1.2, 6.3).

The paper's Figures 5, 13 and 14 ask whether losing expert updates at recovery (PEC) costs model quality.
This recipe asks the same of the tiny reference GPT-MoE (``conf/model/tiny``: 2 MoE layers of N=8 experts)
on the shipped byte corpus, on one CPU process, under these configurations:

- ``no_faults``: every expert checkpointed (K=N), no fault: the reference loss;
- ``full``: K_snapshot = K_persist = N, recovery from storage only: faults cost replayed steps, no tokens;
- ``pec_k1_persist_only``: K_snapshot = K_persist = 1, recovery from storage only (memory lost with the node);
- ``two_level``: the paper's K_snapshot=4, K_persist=1 at N=16 scaled to N experts with
  ``k = max(1, round(k * N / 16))`` (N=8: 2 and 1); the snapshots in memory survive (a process crash);
- ``dynamic_k``: ``pec_k1_persist_only`` with Dynamic-K (K doubles before accumulated PLT passes 3.75%);
- ``replay``: ``checkpoint.mode=replay`` (window ``checkpoint.replay.window``'s default): every fault resumes at
  the end of the newest complete window in storage and replays it, so no token is lost and the final
  validation loss equals ``no_faults``' exactly (same seed; checked, the run fails otherwise).

With ``sweep=1`` it also runs storage-only PEC (``K_snapshot = K_persist = K``) for every K in ``SWEEP_K`` and
snapshot interval in ``SWEEP_INTERVALS`` (the same faults, moved off that interval's snapshot steps): PLT
against K and checkpoint interval. Keep ``steps`` small; it is six more runs per seed.

A fault stops the Trainer at step ``j * fault_every + fault_offset`` (moved one step later if that is a
snapshot step, so the fault always falls between snapshots), drops everything in process (module, Trainer,
callback) and resumes a new Trainer through ``trainer.fit(..., ckpt_path=moc.resume_target())`` up to the
next fault. "Storage only" clears the snapshot root before each resume. The stop is Lightning's own, so a
persist already in flight completes; only the snapshots are lost where the configuration says so.

Every run seeds initialisation and data order the same way; the final validation loss is ``trainer.validate``
over the first ``val_batches`` batches of the (unshuffled) validation split, the same batches for every run.
The ledger's accumulated PLT (eq. 7) is checked against an independent recomputation from router counts
observed at every step and the sources of every recovery (:class:`LostTokenAudit`).

Usage: ``python recipes/accuracy_study.py out=FILE [seeds=1] [steps=300] [fault_every=40] [fault_offset=3]
[every_n_train_steps=10] [persist_every_n_snapshots=2] [val_batches=20] [batch_size=16] [threads=1]
[configs=no_faults,full,...] [sweep=0]``. Prints a markdown table; writes JSON (see docs/analysis.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch

from moc_lightning.config import CheckpointConfig, DynamicKConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.ledger import proportion_lost
from moc_lightning.engine.units import ExpertUnit, parse_unit
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.tools.bench import PAPER_K, scaled_k
from moc_lightning.tools.cli import parse_key_values

MODEL = GPTMoEConfig()
"""``conf/model/tiny.yaml``."""
K_SCALING = "k = max(1, round(k_paper * N / 16)) from the paper's k_snapshot=4, k_persist=1 at N=16"
PLT_TOLERANCE = 1e-9
SWEEP_K = (1, 2, 4)
"""Experts per MoE layer (of N=8) in each checkpoint of the sweep."""
SWEEP_INTERVALS = (5, 10)
"""Snapshot intervals (``every_n_train_steps``) of the sweep."""


@dataclass(frozen=True)
class StudySettings:
    """Everything that shapes a run; written to the JSON beside the results."""

    out: str
    """JSON result file."""
    seeds: int = 1
    """Runs per configuration, seeds 0 .. seeds-1."""
    steps: int = 300
    """Optimizer steps of every run."""
    fault_every: int = 40
    """Steps between faults (faults at j * fault_every + fault_offset, j >= 1, before ``steps``)."""
    fault_offset: int = 3
    """Where a fault falls after its multiple of ``fault_every``; keeps faults off snapshot steps."""
    every_n_train_steps: int = 10
    """Snapshot interval of every configuration."""
    persist_every_n_snapshots: int = 2
    """Persist interval in snapshots: storage lags memory by up to this many snapshots."""
    val_batches: int = 20
    """Validation batches of the final loss (fixed: the validation split is not shuffled)."""
    batch_size: int = 16
    """Sequences per training and validation batch."""
    threads: int = 1
    """Torch intra-op threads (the machine is shared)."""
    configs: str = "no_faults,full,pec_k1_persist_only,two_level,dynamic_k,replay"
    """Comma-separated configurations to run."""
    sweep: int = 0
    """1: also sweep storage-only PEC over ``SWEEP_K`` x ``SWEEP_INTERVALS`` (see :func:`sweep`)."""

    def __post_init__(self) -> None:
        for name in ("seeds", "steps", "fault_every", "every_n_train_steps", "persist_every_n_snapshots",
                     "val_batches", "batch_size", "threads"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fault_offset < 0:
            raise ValueError(f"fault_offset must be >= 0, got {self.fault_offset}")
        if self.sweep not in (0, 1):
            raise ValueError(f"sweep must be 0 or 1, got {self.sweep}")
        unknown = sorted(set(self.config_names) - set(configurations(MODEL.num_experts)))
        if unknown:
            raise ValueError(f"configs {unknown} are unknown; choose among {list(configurations(MODEL.num_experts))}")

    @property
    def config_names(self) -> list[str]:
        return [name for name in self.configs.split(",") if name]

    def fault_steps(self) -> list[int]:
        """Steps at which the Trainer is stopped; never a snapshot step (that snapshot would survive)."""
        steps = []
        for j in range(1, self.steps // self.fault_every + 1):
            step = j * self.fault_every + self.fault_offset
            if step % self.every_n_train_steps == 0:
                step += 1
            if step < self.steps:
                steps.append(step)
        return steps


@dataclass(frozen=True)
class Configuration:
    """One row of the study: PEC sizes, whether faults happen, and what survives them."""

    name: str
    k_snapshot: int
    k_persist: int
    faults: bool = True
    memory_survives: bool = False
    """A process crash (snapshots in shared memory survive) rather than a lost node (storage only)."""
    dynamic_k: bool = False
    mode: str = "pec"
    """``checkpoint.mode``: ``replay`` ignores the K above and recovers every unit to its fault-free state."""


def configurations(num_experts: int) -> dict[str, Configuration]:
    """The study's configurations for ``num_experts`` experts per MoE layer."""
    n = num_experts
    paper_snapshot, paper_persist = (scaled_k(k, n) for k in PAPER_K)
    rows = (
        Configuration("no_faults", n, n, faults=False),
        Configuration("full", n, n),
        Configuration("pec_k1_persist_only", 1, 1),
        Configuration("two_level", paper_snapshot, paper_persist, memory_survives=True),
        Configuration("dynamic_k", 1, 1, dynamic_k=True),
        Configuration("replay", n, n, mode="replay"),
    )
    return {row.name: row for row in rows}


@dataclass(frozen=True)
class _Counted:
    """The audit's state after one recovery: its resume step, lost tokens per MoE layer so far, and from
    which step each restored (layer, expert, version) has been counted."""

    resume_step: int
    lost: tuple[int, ...]
    counted_from: dict[tuple[int, int, int], int]


class LostTokenAudit(L.Callback):
    """Recomputes eq. 7 outside the engine, to check the ledger's accumulated PLT.

    It observes the router counts of every step (replayed steps overwrite the abandoned timeline's) and, at
    each recovery, the resume step and the step every expert was restored from. An expert restored from step
    ``t`` at resume step ``s`` lost the tokens it processed in steps ``(t, s]``, except those an earlier
    recovery already counted for the same version (counting then starts at that recovery's resume step).
    A recovery to a checkpoint taken before an earlier recovery (resume step ``<=`` the earlier one's)
    restores a state in which that earlier recovery never happened, so its losses are forgotten: the
    recoveries form a stack. The denominator is ``T_i * TopK_i`` up to the latest resume step.
    """

    def __init__(self) -> None:
        self.processed: dict[int, list[torch.Tensor]] = {}
        self.assigned: dict[int, list[int]] = {}
        self._stack: list[_Counted] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        layers = pl_module.moe_layers()
        self.processed[trainer.global_step] = [layer.tokens_per_expert.clone() for layer in layers]
        self.assigned[trainer.global_step] = [int(layer.tokens_assigned) for layer in layers]

    def record_recovery(self, resume_step: int, sources: dict[str, dict[str, Any]]) -> None:
        """Account one recovery from its report's resume step and per-unit sources."""
        while self._stack and self._stack[-1].resume_step >= resume_step:
            self._stack.pop()
        before = self._stack[-1] if self._stack else None
        counted_from = dict(before.counted_from) if before else {}
        lost = list(before.lost) if before else [0] * len(self.assigned[resume_step])
        for key, source in sources.items():
            unit = parse_unit(key)
            if not isinstance(unit, ExpertUnit):
                continue
            version = (unit.layer, unit.expert, source["step"])
            start = max(counted_from.get(version, source["step"]), 0)  # NEVER (-1): every step from 1
            steps = range(start + 1, resume_step + 1)
            lost[unit.layer] += sum(int(self.processed[k][unit.layer][unit.expert]) for k in steps)
            counted_from[version] = resume_step
        self._stack.append(_Counted(resume_step, tuple(lost), counted_from))

    def accumulated_plt(self) -> float:
        """Eq. 7 over the recoveries the final state descends from; 0 without any."""
        if not self._stack:
            return 0.0
        latest = self._stack[-1]
        steps = range(1, latest.resume_step + 1)
        assigned = [sum(self.assigned[k][i] for k in steps) for i in range(len(latest.lost))]
        return proportion_lost(latest.lost, assigned)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning and MoC print several lines per segment; show them only when a segment fails.

    Lightning's loggers write to the stream they captured at import, so INFO records are disabled instead.
    """
    buffer = io.StringIO()
    logging.disable(logging.INFO)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield
    except BaseException:
        sys.stderr.write(buffer.getvalue())
        raise
    finally:
        logging.disable(logging.NOTSET)


def checkpoint_config(config: Configuration, settings: StudySettings, work: Path) -> CheckpointConfig:
    return CheckpointConfig(
        mode=config.mode,
        k_snapshot=config.k_snapshot,
        k_persist=config.k_persist,
        every_n_train_steps=settings.every_n_train_steps,
        persist_every_n_snapshots=settings.persist_every_n_snapshots,
        storage=StorageConfig(url=(work / "ckpt").as_uri()),
        shm_root=str(work / "shm"),
        dynamic_k=DynamicKConfig(enabled=config.dynamic_k),
        persist_on_fit_end=False,  # a segment's end stands for a fault here, not for a finished run
        complete_first_persist=False,  # the paper's PEC from the first persist on: the cost this study measures
    )


def trainer(work: Path, callbacks: list[L.Callback], **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(work / "run"),
        callbacks=callbacks,
        **options,
    )


def datamodule(settings: StudySettings) -> LMDataModule:
    return LMDataModule(DataConfig(batch_size=settings.batch_size), MODEL.block_size, MODEL.vocab_size)


def train_until(
    config: Configuration, settings: StudySettings, seed: int, work: Path, stop: int, audit: LostTokenAudit
) -> tuple[MoCCheckpoint, GPTMoEModule]:
    """One process lifetime: a fresh module, Trainer and callback, resumed from what survived, up to ``stop``."""
    moc = MoCCheckpoint(checkpoint_config(config, settings, work))
    module = GPTMoEModule(MODEL, seed=seed)
    with quiet():
        fit = trainer(work, [moc, audit], max_steps=stop, limit_val_batches=0)
        fit.fit(module, datamodule=datamodule(settings), ckpt_path=moc.resume_target())
    return moc, module


def validation_loss(module: GPTMoEModule, settings: StudySettings, work: Path) -> float:
    """Mean LM loss over the first ``val_batches`` validation batches: the same batches for every run."""
    with quiet():
        result = trainer(work, [], limit_val_batches=settings.val_batches).validate(
            module, datamodule=datamodule(settings), verbose=False
        )
    return float(result[0]["val_loss"])


def run(config: Configuration, settings: StudySettings, seed: int) -> dict[str, Any]:
    """Train one configuration with its faults; PLT, faults, final K and validation loss."""
    L.seed_everything(seed, verbose=False)
    stops = (settings.fault_steps() if config.faults else []) + [settings.steps]
    audit = LostTokenAudit()
    recoveries = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"moc_accuracy_{config.name}_s{seed}_") as tmp:
        work = Path(tmp)
        for i, stop in enumerate(stops):
            if i > 0 and not config.memory_survives:
                shutil.rmtree(work / "shm")  # the node's memory is gone; only storage is left
            moc, module = train_until(config, settings, seed, work, stop, audit)
            if moc.recovery is not None:
                audit.record_recovery(moc.recovery.resume_step, moc.recovery.sources)
                recoveries.append(_recovery_summary(moc))
            if moc.replay_report is not None:
                recoveries.append(_replay_summary(moc))
        val_loss = validation_loss(module, settings, work)
    pec = moc.engine.pec
    return {
        "config": config.name,
        "seed": seed,
        "plt": pec.ledger.accumulated_plt,
        "plt_recomputed": audit.accumulated_plt(),
        "faults": len(recoveries),
        "final_k": {"snapshot": pec.dynamic_k.k_snapshot, "persist": pec.dynamic_k.k_persist},
        "val_loss": val_loss,
        "recoveries": recoveries,
        "replay_iterations": sum(r.get("replay_iterations", 0) for r in recoveries),
        "seconds": time.perf_counter() - started,
    }


def sweep(settings: StudySettings) -> Iterator[dict[str, Any]]:
    """Storage-only PEC for every K in ``SWEEP_K`` and snapshot interval in ``SWEEP_INTERVALS``, every seed.

    Each row is a :func:`run` row plus ``k``, ``every_n_train_steps`` and the run's ``fault_steps``.
    """
    for k in SWEEP_K:
        for interval in SWEEP_INTERVALS:
            config = Configuration(f"pec_k{k}_every{interval}", k, k)
            varied = replace(settings, every_n_train_steps=interval)
            for seed in range(settings.seeds):
                row = run(config, varied, seed)
                yield {**row, "k": k, "every_n_train_steps": interval, "fault_steps": varied.fault_steps()}


def _recovery_summary(moc: MoCCheckpoint) -> dict[str, Any]:
    report = moc.recovery
    return {
        "resume_step": report.resume_step,
        "plt": report.plt,
        "accumulated_plt": moc.engine.pec.ledger.accumulated_plt,
        "sources": dict(Counter(source["level"] for source in report.sources.values())),
        "k_after": {"snapshot": moc.engine.pec.dynamic_k.k_snapshot, "persist": moc.engine.pec.dynamic_k.k_persist},
    }


def _replay_summary(moc: MoCCheckpoint) -> dict[str, Any]:
    report = moc.replay_report
    return {
        "resume_step": report.resume_step,
        "plt": report.plt,
        "window_start": report.window_start,
        "replay_iterations": report.replay_iterations,
        "replay_seconds": report.replay_seconds,
    }


def replay_matches(runs: Sequence[dict[str, Any]]) -> bool | None:
    """Whether every ``replay`` run's final validation loss equals (``==``) the ``no_faults`` run's of its seed;
    ``None`` when the study ran no such pair."""
    reference = {r["seed"]: r["val_loss"] for r in runs if r["config"] == "no_faults"}
    pairs = [(r["val_loss"], reference[r["seed"]]) for r in runs if r["config"] == "replay" and r["seed"] in reference]
    return all(got == want for got, want in pairs) if pairs else None


def summary_table(runs: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per configuration, means over seeds, and the loss against ``no_faults`` and ``full``.

    Differences are paired by seed (same initialisation and data order up to the first fault); ``full``
    also shares the fault schedule and the data order after each storage resume, so the difference of the
    storage-only PEC configurations to it isolates the lost expert updates.
    """
    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in runs:
        by_config.setdefault(row["config"], []).append(row)
    lines = [
        "| config | seeds | faults | accumulated PLT | PLT recomputed | final K (snapshot/persist) "
        "| val loss (mean) | val loss range | vs no_faults | vs full | window iterations replayed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in by_config.items():
        losses = [r["val_loss"] for r in rows]
        ks = sorted({f"{r['final_k']['snapshot']}/{r['final_k']['persist']}" for r in rows})
        versus = [_paired_delta(rows, by_config.get(reference, [])) for reference in ("no_faults", "full")]
        lines.append(
            f"| {name} | {len(rows)} | {_mean(r['faults'] for r in rows):g} | {_mean(r['plt'] for r in rows):.3%} "
            f"| {_mean(r['plt_recomputed'] for r in rows):.3%} | {', '.join(ks)} | {_mean(losses):.4f} "
            f"| {min(losses):.4f}-{max(losses):.4f} | {' | '.join(versus)} | {_mean(r['replay_iterations'] for r in rows):g} |"
        )
    return "\n".join(lines)


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (K, snapshot interval) of the sweep, means over seeds."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["k"], row["every_n_train_steps"]), []).append(row)
    lines = [
        "| K (snapshot = persist) | every_n_train_steps | seeds | faults | accumulated PLT | val loss (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for (k, interval), group in groups.items():
        lines.append(
            f"| {k} | {interval} | {len(group)} | {_mean(r['faults'] for r in group):g} "
            f"| {_mean(r['plt'] for r in group):.3%} | {_mean(r['val_loss'] for r in group):.4f} |"
        )
    return "\n".join(lines)


def _paired_delta(rows: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> str:
    """``val_loss - reference val_loss`` per shared seed: mean and range; ``n/a`` without a shared seed.

    The mean equals the difference of the means; the range is the point: without the spread between seeds
    it shows whether a difference is larger than what one run to the next varies.
    """
    base = {r["seed"]: r["val_loss"] for r in reference}
    deltas = [r["val_loss"] - base[r["seed"]] for r in rows if r["seed"] in base]
    if not deltas:
        return "n/a"
    spread = f" ({min(deltas):+.4f}..{max(deltas):+.4f})" if len(deltas) > 1 else ""
    return f"{_mean(deltas):+.4f}{spread}"


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def parse_settings(argv: Sequence[str]) -> StudySettings:
    """``key=value`` arguments, one per :class:`StudySettings` field, typed like the field's default."""
    types = {f.name: (str if f.name in ("out", "configs") else int) for f in fields(StudySettings)}
    values = parse_key_values(argv, types, required=["out"])
    return StudySettings(**{key: types[key](value) for key, value in values.items()})


def progress(row: dict[str, Any]) -> dict[str, Any]:
    """Print one finished run and pass it on."""
    print(f"[accuracy_study] {row['config']} seed {row['seed']}: PLT {row['plt']:.3%}, {row['faults']} faults, "
          f"val loss {row['val_loss']:.4f} ({row['seconds']:.0f} s)", flush=True)
    return row


def main(argv: Sequence[str]) -> None:
    settings = parse_settings(argv)
    torch.set_num_threads(settings.threads)
    table = configurations(MODEL.num_experts)
    started = time.perf_counter()
    runs = [
        progress(run(table[name], settings, seed)) for name in settings.config_names for seed in range(settings.seeds)
    ]
    swept = [progress(row) for row in sweep(settings)] if settings.sweep else []
    mismatched = [r for r in runs + swept if abs(r["plt"] - r["plt_recomputed"]) > PLT_TOLERANCE]
    replay_exact = replay_matches(runs)
    result = {
        "settings": {**asdict(settings), "fault_steps": settings.fault_steps(), "model": asdict(MODEL)},
        "configurations": {name: asdict(table[name]) for name in settings.config_names},
        "k_scaling": K_SCALING,
        "plt_matches_recomputed": not mismatched,
        "replay_equals_no_faults": replay_exact,
        "wall_seconds": time.perf_counter() - started,
        "runs": runs,
        "sweep": swept,
    }
    Path(settings.out).write_text(json.dumps(result, indent=1))
    print(f"\n# Accuracy study: tiny GPT-MoE, {settings.steps} steps, faults at {settings.fault_steps()}\n")
    print(summary_table(runs))
    if swept:
        print(f"\n## Sweep: storage-only PEC, K x snapshot interval\n\n{sweep_table(swept)}")
    print(f"\nledger PLT == recomputed PLT for every run: {not mismatched}; "
          f"wall time {result['wall_seconds']:.0f} s; JSON: {settings.out}")
    if replay_exact is not None:
        print(f"replay's final val loss == no_faults' (same seed) for every seed: {replay_exact}")
    if mismatched:
        raise SystemExit(f"ledger PLT differs from the recomputation in {len(mismatched)} run(s)")
    if replay_exact is False:
        raise SystemExit("replay's final validation loss differs from the no-fault run's: a fault lost state")


if __name__ == "__main__":
    main(sys.argv[1:])
