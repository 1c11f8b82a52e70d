"""Host memory of a save, measured: what a snapshot and a persist add to a rank's resident memory over training.

The design keeps one host copy of the state a snapshot takes: the slots in node-local shared memory
(:mod:`moc_lightning.memory.snapshot`). Everything else a save does (selecting, copying into the slot, writing through
DCP from the slot, committing) should cost the process no more than small, passing allocations. This module
measures that claim, per rank, from ``/proc/self/status``:

- ``RssAnon``: the process's private memory (the model, the optimizer state, activations, anything a save
  would gather, clone or pickle). The save's growth is measured here.
- ``RssShmem``: shared memory mapped by the process, i.e. the snapshot slots this rank has mapped, counted
  separately: they are the design's one host copy, sized before the first snapshot.

A thread samples both every ``interval`` seconds, and once more on entering and leaving each phase, and keeps
the peak of each *phase*: ``train`` (training before the first save: the baseline), ``snapshot_copy`` (the copy
into the slot, on the training thread at a batch end), ``snapshot`` (from taking a snapshot to the wait for its
commit before the next optimizer step, so the next forward and backward with it), ``persist`` (a periodic DCP
write from a slot, on its own thread while training goes on), ``final_persist`` (every unit from the live
tensors once training is over) and ``between`` (training after the first save with none in flight: memory a
save kept would show here).

A phase's *growth* is its peak ``RssAnon`` minus the baseline's, the issue's criterion; the baseline is this
run's ``train`` peak or, better, a control run's (the same steps with no save while training: training's own
``RssAnon`` moves from step to step with the routing and the allocator, which the few steps before the first
save do not cover). Phases with nothing else running, ``snapshot_copy`` and ``final_persist``, also get a
*rise*: the most ``RssAnon`` went above its value on entering the phase, i.e. what the save itself allocated,
which a peak comparison hides when the save runs while training's activations are freed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore

from moc_lightning.data import LMDataModule
from moc_lightning.engine.pieces import piece
from moc_lightning.jobs.training import TrainConfig, build_trainer
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models.lightning import GPTMoEModule

STATUS_FIELDS = ("RssAnon", "RssShmem", "RssFile", "VmRSS")
"""The fields of ``/proc/self/status`` sampled, in kB there, in bytes here."""

PHASES = ("train", "snapshot_copy", "snapshot", "persist", "final_persist", "between")
"""Phases whose peaks are kept; ``train`` and ``between`` are samples with no save in flight, before and after the
first save."""
STACK_STEP = 8 * 2**20
"""A phase's rise growing by more than this many bytes records the threads' stacks (:class:`PhasePeak`)."""

ALONE = ("snapshot_copy", "final_persist")
"""The save phases with nothing else running in the process, whose rise is the save's own allocation."""


def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """The :data:`STATUS_FIELDS` of this process, in bytes."""
    values: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in STATUS_FIELDS:
                values[name] = int(rest.split()[0]) * 1024
    missing = set(STATUS_FIELDS) - set(values)
    if missing:
        raise RuntimeError(f"{path} lacks {sorted(missing)}; this measurement needs Linux 4.5 or later")
    return values


def thread_stacks(depth: int = 8) -> dict[str, list[str]]:
    """The innermost ``depth`` frames of every other thread, by thread name, as ``file:line function``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return {
        names.get(ident, str(ident)): [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-depth:]]
        for ident, frame in sys._current_frames().items()
        if ident != me
    }


@dataclass
class PhasePeak:
    """The highest sample of each field seen during one phase, how many samples it took, and the most ``RssAnon``
    rose above its value on entering the phase (over all occurrences)."""

    samples: int = 0
    peak: dict[str, int] = field(default_factory=dict)
    rise: int = 0
    rise_stacks: dict[str, list[str]] = field(default_factory=dict)
    """What every thread was running when the rise last grew by more than :data:`STACK_STEP`: where it went."""

    def add(self, sample: dict[str, int], entry_anon: int | None) -> None:
        self.samples += 1
        for name, value in sample.items():
            self.peak[name] = max(self.peak.get(name, 0), value)
        if entry_anon is not None and sample["RssAnon"] - entry_anon > self.rise:
            if sample["RssAnon"] - entry_anon > self.rise + STACK_STEP:
                self.rise_stacks = thread_stacks()
            self.rise = sample["RssAnon"] - entry_anon


class RssSampler:
    """Samples :func:`read_status` from a daemon thread and keeps each phase's peak (see the module)."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"sample_interval_ms must be > 0, got {interval * 1000}")
        self.interval = interval
        self.peaks = {phase: PhasePeak() for phase in PHASES}
        self._active: dict[str, int] = {}
        self._entry_anon: dict[str, int] = {}
        self._saved = False
        self.step = 0
        """The training step samples are taken in (set by the probe), for :attr:`step_peaks`."""
        self.step_peaks: dict[int, int] = {}
        """Peak ``RssAnon`` of each training step, whatever was in flight: where memory crept or jumped."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moc-rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count samples taken while the body runs (from any thread) towards ``name``."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def enter(self, name: str) -> None:
        status = read_status()
        with self._lock:
            self._active[name] = self._active.get(name, 0) + 1
            self._entry_anon.setdefault(name, status["RssAnon"])
            self._saved = True
        self.sample()

    def leave(self, name: str) -> None:
        self.sample()
        with self._lock:
            self._active[name] -= 1
            if not self._active[name]:
                del self._active[name]
                del self._entry_anon[name]

    def sample(self) -> None:
        status = read_status()
        with self._lock:
            self.step_peaks[self.step] = max(self.step_peaks.get(self.step, 0), status["RssAnon"])
            idle = "between" if self._saved else "train"
            for phase in self._active or (idle,):
                self.peaks[phase].add(status, self._entry_anon.get(phase))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def wrap(obj: Any, method: str, around: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Run ``obj.method`` inside ``around()`` from now on (on this instance only)."""
    original = getattr(obj, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with around():
            return original(*args, **kwargs)

    setattr(obj, method, wrapped)


@contextlib.contextmanager
def _flagged(flag: threading.Event) -> Iterator[None]:
    """``flag`` set while the body runs: the persist inside ``persist_final`` is then the final one."""
    flag.set()
    try:
        yield
    finally:
        flag.clear()


def held_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of state this rank holds, counted from the module and the optimizer directly: its parameters, buffers
    and optimizer state tensors, of a DTensor (FSDP2) its local piece only (the shard this rank keeps; a DTensor's
    own ``nbytes`` is the whole tensor's)."""
    tensors = [*module.parameters(), *module.buffers()]
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(piece(t).nbytes for t in tensors)


class MemoryProbe(L.Callback):
    """Samples this rank's memory through ``fit`` and marks the save phases of ``moc``'s engine.

    It instruments the engine ``moc`` builds at fit start once training starts, and reports at teardown, after
    ``moc``'s fit end (and so its final persist): Lightning runs checkpoint callbacks last. :attr:`report` is
    this rank's result once fit is over.
    """

    def __init__(self, moc: MoCCheckpoint, interval: float) -> None:
        self.moc = moc
        self.sampler = RssSampler(interval)
        self.report: dict[str, Any] | None = None
        self._snapshots_reaped = 0
        self._slot_bytes = 0

    def _engine(self) -> TwoLevelCheckpointer:
        """``moc``'s engine, which it builds when the fit starts, before any hook of this probe that reads it."""
        if self.moc.engine is None:
            raise RuntimeError(
                "MemoryProbe reads MoCCheckpoint's engine, which a fit builds at its start; this hook ran before that"
            )
        return self.moc.engine

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = self._engine()
        sampler = self.sampler
        wrap(engine.store, "fill", lambda: sampler.phase("snapshot_copy"))
        final = threading.Event()
        wrap(engine, "persist_final", lambda: _flagged(final))
        wrap(engine.pec, "persist", lambda: sampler.phase("final_persist" if final.is_set() else "persist"))
        snapshot, wait = engine.snapshot, engine.wait_snapshot

        def take(*args: Any, **kwargs: Any) -> None:
            sampler.enter("snapshot")  # left when its commit is reaped, below
            try:
                snapshot(*args, **kwargs)
            except BaseException:
                sampler.leave("snapshot")
                raise

        def reap() -> None:
            wait()
            while self._snapshots_reaped < engine.stats.snapshots:
                self._snapshots_reaped += 1
                sampler.leave("snapshot")

        setattr(engine, "snapshot", take)  # on this instance only, as wrap() does
        setattr(engine, "wait_snapshot", reap)
        sampler.start()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.sampler.step = trainer.global_step + 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The slots' size, before ``moc`` removes them at fit end; later samples count as one step past the last."""
        self.sampler.step = trainer.global_step + 1
        self._slot_bytes = sum(f.stat().st_size for f in Path(self._engine().store.root).glob("*/data"))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.report is not None:
            return
        self.sampler.stop()
        engine = self._engine()
        layout = engine.pec.layout
        held = {u: layout.unit_bytes(u, local=True) for u in layout.units}
        stats = engine.stats
        self.report = {
            "rank": trainer.global_rank,
            "state_bytes": held_state_bytes(pl_module, layout.optimizer),
            "layout_state_bytes": sum(b.total for b in held.values()),
            "weight_bytes": sum(b.weights + b.buffers for b in held.values()),
            "optimizer_bytes": sum(b.optimizer for b in held.values()),
            "slot_bytes": self._slot_bytes,
            "snapshots": stats.snapshots,
            "persists": stats.persists + (stats.final_persist is not None),
            "persist_bytes": [r.bytes_written for r in stats.persist_reports]
            + ([stats.final_persist.bytes_written] if stats.final_persist is not None else []),
            "step_peaks": dict(sorted(self.sampler.step_peaks.items())),
            "phases": {p: {"samples": v.samples, "rise": v.rise, "rise_stacks": v.rise_stacks, **v.peak} for p, v in self.sampler.peaks.items()},
        }


def growth_rows(report: dict[str, Any], control: dict[str, Any] | None = None) -> dict[str, dict[str, float | None]]:
    """Each phase's peak ``RssAnon`` and ``RssShmem`` growth over the baseline, and its ``RssAnon`` rise, in bytes
    and as % of the rank's state; ``None`` for a phase that took no sample (not measured, never 0).

    The baseline is the ``train`` peak of ``control`` (the same rank's report of a run without saves during
    training) if given, else of ``report`` itself (training before its first save)."""
    phases, state = report["phases"], report["state_bytes"]
    base = (control or report)["phases"]["train"]
    rows: dict[str, dict[str, float | None]] = {}
    for phase in PHASES[1:]:
        peak = phases[phase]
        if not peak["samples"] or not base["samples"]:
            rows[phase] = dict.fromkeys(("anon_growth", "anon_growth_pct", "shmem_growth", "anon_rise", "anon_rise_pct"))
            continue
        anon = peak["RssAnon"] - base["RssAnon"]
        rows[phase] = {
            "anon_growth": anon,
            "anon_growth_pct": 100 * anon / state,
            "shmem_growth": peak["RssShmem"] - base["RssShmem"],
            "anon_rise": peak["rise"] if phase in ALONE else None,
            "anon_rise_pct": 100 * peak["rise"] / state if phase in ALONE else None,
        }
    return rows


def format_report(reports: list[dict[str, Any]], controls: list[dict[str, Any]] | None = None) -> str:
    """Every rank's figures, one block per rank, in MB (10^6 bytes); growth over ``controls``' ``train`` peaks
    (by rank) when given (:func:`growth_rows`)."""
    mb = 1e6
    lines = []
    for r in reports:
        rank, base = r["rank"], r["phases"]["train"]
        control = controls[rank] if controls else None
        lines.append(
            f"[memory] rank {rank}: state_bytes={r['state_bytes']} ({r['state_bytes'] / mb:.1f} MB: weights "
            f"{r['weight_bytes'] / mb:.1f} + kept optimizer state {r['optimizer_bytes'] / mb:.1f}; layout "
            f"{r['layout_state_bytes'] / mb:.1f}), snapshot slots {r['slot_bytes'] / mb:.1f} MB (shared memory), "
            f"{r['snapshots']} snapshots, {r['persists']} persists "
            f"({', '.join(f'{b / mb:.1f}' for b in r['persist_bytes'])} MB written)"
        )
        steps = ", ".join(f"{step}: {anon / mb:.1f}" for step, anon in r["step_peaks"].items())
        lines.append(f"[memory] rank {rank}: peak RssAnon by step (MB; 0: before the first; last: after training): {steps}")
        lines.append(
            f"[memory] rank {rank}: train (no save yet) peak RssAnon {base['RssAnon'] / mb:.1f} MB, "
            f"RssShmem {base['RssShmem'] / mb:.1f} MB ({base['samples']} samples)"
        )
        if control is not None:
            own = {int(k): v for k, v in r["step_peaks"].items()}
            theirs = {int(k): v for k, v in control["step_peaks"].items()}
            deltas = ", ".join(f"{k}: {(own[k] - theirs[k]) / mb:+.1f}" for k in sorted(own) if k in theirs)
            lines.append(f"[memory] rank {rank}: peak RssAnon by step minus the control run's (MB): {deltas}")
            c = control["phases"]["train"]
            lines.append(
                f"[memory] rank {rank}: baseline: control run's train peak RssAnon {c['RssAnon'] / mb:.1f} MB, "
                f"RssShmem {c['RssShmem'] / mb:.1f} MB ({c['samples']} samples)"
            )
        for phase, row in growth_rows(r, control).items():
            peak = r["phases"][phase]
            growth, shmem = row["anon_growth"], row["shmem_growth"]
            if growth is None or shmem is None:  # both None together: the phase took no sample
                lines.append(f"[memory] rank {rank}: {phase}: no sample taken (not measured)")
                continue
            rise = "" if row["anon_rise"] is None else (
                f" anon_rise={row['anon_rise'] / mb:+.1f} MB anon_rise_pct={row['anon_rise_pct']:+.2f}%"
            )
            lines.append(
                f"[memory] rank {rank}: {phase} peak RssAnon {peak['RssAnon'] / mb:.1f} MB, "
                f"RssShmem {peak['RssShmem'] / mb:.1f} MB ({peak['samples']} samples); "
                f"anon_growth={growth / mb:+.1f} MB anon_growth_pct={row['anon_growth_pct']:+.2f}% "
                f"shmem_growth={shmem / mb:+.1f} MB{rise}"
            )
    return "\n".join(lines)


def gather_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's report on every rank (collective), by rank."""
    if not dist.is_initialized():
        return [report]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, report)
    return sorted(parts, key=lambda r: r["rank"])


@dataclass
class MemoryReportConfig(TrainConfig):
    """Root of the config tree of ``recipes/memory_report.py`` (``conf/memory_report.yaml``): a training run and
    how often to sample its memory."""

    sample_interval_ms: float = 2.0
    """Interval of the background sampler of ``/proc/self/status``, in milliseconds (> 0)."""
    baseline_from: str = ""
    """``memory_report.json`` of a control run (the same config with ``checkpoint.every_n_train_steps`` above
    ``trainer.max_steps``: no save while training); growth is then measured over its ``train`` peaks, rank by
    rank, rather than over this run's steps before its first save, which training's own creep from step to
    step (allocator, logging) inflates. Empty: this run's own baseline."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sample_interval_ms <= 0:
            raise ValueError(f"sample_interval_ms must be > 0, got {self.sample_interval_ms}")
        if self.baseline_from and not Path(self.baseline_from).is_file():
            raise ValueError(f"baseline_from={self.baseline_from!r} is not a file (a control run's memory_report.json)")
        if not self.checkpoint.enabled:
            raise ValueError("checkpoint.enabled must be true: the report measures MoC's saves")


def register_configs() -> None:
    """Register the schema so ``conf/memory_report.yaml`` (``defaults: [memory_report_schema, ...]``) is typed."""
    ConfigStore.instance().store(name="memory_report_schema", node=MemoryReportConfig)


def run_report(cfg: MemoryReportConfig, output_dir: Path) -> list[dict[str, Any]]:
    """Train as ``cfg`` says with a :class:`MemoryProbe`; every rank's report, printed by rank 0 and written to
    ``output_dir/memory_report.json``. A fresh run: nothing is resumed."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    t = cfg.trainer
    module = GPTMoEModule(cfg.model, cfg.optim, ep=t.ep, seed=cfg.seed, data_parallel=t.data_parallel)
    data = LMDataModule(cfg.data, block_size=cfg.model.block_size, vocab_size=cfg.model.vocab_size)
    moc = MoCCheckpoint(cfg.checkpoint)
    probe = MemoryProbe(moc, cfg.sample_interval_ms / 1000)
    trainer = build_trainer(cfg, output_dir, [moc, probe])
    trainer.fit(module, datamodule=data)
    if probe.report is None:
        raise RuntimeError("MemoryProbe has no report: its teardown did not run at the end of the fit")
    reports = gather_reports(probe.report)
    if trainer.is_global_zero:
        controls = json.loads(Path(cfg.baseline_from).read_text())["reports"] if cfg.baseline_from else None
        if controls is not None and len(controls) != len(reports):
            raise ValueError(f"baseline_from={cfg.baseline_from!r} has {len(controls)} ranks, this run {len(reports)}")
        growth = [growth_rows(r, controls[r["rank"]] if controls else None) for r in reports]
        out = output_dir / "memory_report.json"
        out.write_text(json.dumps({"reports": reports, "growth": growth, "baseline_from": cfg.baseline_from}, indent=1))
        print(format_report(reports, controls))
        print(f"[memory] JSON: {out}")
    return reports
