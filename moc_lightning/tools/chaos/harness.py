"""Chaos trials: draw faults at random (seeded), run the job incarnation by incarnation, check with the oracle.

A trial is one training job of ``max_steps`` on 4 ranks (2 simulated nodes of 2). Incarnation 0 runs with
the first fault; between incarnations the harness applies what a crash leaves behind (a lost node's shared
memory, a damaged stored file); later incarnations run without a fault (or with the trial's second kill),
until one finishes cleanly or the restart budget runs out (a crash loop). Each incarnation is its own
launch (``torchrun --standalone --max-restarts=0``'s agent, :mod:`moc_lightning.tools.chaos.worker`) under a
wall-clock timeout, so a hang is a finding, never a stuck harness.

The uninterrupted reference run gives the sample ids each step must see; it runs once per configuration and is
cached in the work directory. In PEC mode it trains without MoC. In replay mode (``mode=replay``: MoC's
``checkpoint.mode=replay``, windows of ``window`` iterations, every ``persist_windows``-th stored) it is the fault-free
run of the same options, MoC included, and the trial must agree with it bitwise (:mod:`.checks`): kills land inside
window captures, hand-overs, seals, storage writes, the final persist and, in the next incarnation, the resume's
restore and replay; node losses and damaged stored windows come as in PEC mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from moc_lightning.engine.parts import SCOPES
from moc_lightning.export.consolidate import OPTIMIZER_KEY, consolidate
from moc_lightning.replay.driver import WINDOW_PREFIX
from moc_lightning.replay.window_store import WINDOW_SUFFIX, head_object
from moc_lightning.runtime.faults import KILL_LINE, FaultPlan
from moc_lightning.tools.chaos.checks import run_checks
from moc_lightning.tools.chaos.oracle import INCARNATION_ENV, read_records, tensor_digest

if TYPE_CHECKING:  # boto3, which it imports, is in the dev extra: imported where storage=s3 runs
    from moc_lightning.tools.chaos.s3_trials import BucketStore

WORLD = 4
RANKS_PER_NODE = 2
MODES = ("pec", "replay")
"""``checkpoint.mode`` of a trial's job."""
KILL_PHASES = ("train", "snapshot", "slot_commit", "persist", "manifest_commit")
REPLAY_KILL_PHASES = ("train", "capture", "handover", "seal", "store", "final_persist", "manifest_commit")
"""Where incarnation 0 of a replay trial dies (:mod:`moc_lightning.runtime.faults`); ``final_persist`` and
``manifest_commit`` (rank 0's commit) are inside the final persist, replay mode's only one."""
DAMAGE_TARGETS = ("data", "metadata", "moc_json", "manifest")
WINDOW_DAMAGE_TARGETS = ("window", "head")
"""What of a rank's newest stored replay window is damaged: its object, or its head."""
DAMAGE_OPS = ("flip", "truncate", "delete")
SECOND_FAULTS = ("none", "node_loss", "damage", "kill_recovery", "kill_train")
REPLAY_SECOND_FAULTS = ("none", "node_loss", "damage", "node_loss_damage", "kill_restore", "kill_replay", "kill_train")
"""``node_loss_damage``: the node of the rank whose stored window is damaged is lost too, so its resume must read
storage and pass over the damaged copy (with memory intact, a resume reads memory first)."""
CHAOS_MODES = ("ddp", "zero2", "fsdp2")
REPLAY_DATA_PARALLEL = ("ddp", "zero2")
"""``data_parallel`` of replay trials, and of the trials whose final checkpoint is checked (``final_state``): it
compares the consolidated checkpoint's whole tensors with what the ranks hold, which under ``fsdp2`` are shards (the
oracle digests each rank's pieces)."""
HANG_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
STORAGES = ("local", "s3")
"""Where a trial's job keeps its checkpoints: a local directory, or a bucket of a local S3-protocol server behind the
fault proxy, which deals a network fault per trial (:mod:`~moc_lightning.tools.chaos.s3_trials`)."""


@dataclass(frozen=True)
class TrialConfig:
    """What every trial trains; lean on purpose (a trial is a few incarnations of ~20 s each)."""

    max_steps: int = 24
    every: int = 3
    persist_every: int = 2
    k_snapshot: int = 2
    k_persist: int = 1
    restarts: int = 4
    """Restarts after incarnation 0 before the trial counts as a crash loop."""
    incarnation_timeout: float = 180.0
    """Seconds an incarnation may take before it counts as hung."""
    pg_timeout: float = 60.0
    data_parallel: str = "ddp"
    """``trainer.data_parallel`` of the job: ``ddp``, ``zero2`` (each unit's optimizer state on one rank) or ``fsdp2``
    (every weight and optimizer state a DTensor sharded over the ranks, through Lightning's ``ModelParallelStrategy``;
    the oracle digests each rank's pieces)."""
    pec_scope: str = "both"
    """``checkpoint.pec_scope`` of the job: ``both``, ``optimizer`` or ``weights`` (an expert's parts then come
    from different steps, and the ``restore`` check holds each part to its own)."""
    mode: str = "pec"
    """``checkpoint.mode`` of the job: ``pec`` (``every``, ``persist_every``, ``k_*`` and ``pec_scope`` apply) or
    ``replay`` (``window`` and ``persist_windows`` apply)."""
    window: int = 4
    """``checkpoint.replay.window`` (replay mode): W; a ``max_steps`` that is a multiple of it ends the last window at
    the last step, the edge case of a resume with nothing left to train."""
    persist_windows: int = 2
    """``checkpoint.replay.persist_every_n_windows`` (replay mode)."""
    storage: str = "local"
    """One of :data:`STORAGES`; ``s3`` runs PEC trials only."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not allowed; choose one of: {', '.join(MODES)}")
        allowed = REPLAY_DATA_PARALLEL if self.mode == "replay" else CHAOS_MODES
        if self.data_parallel not in allowed:
            raise ValueError(f"data_parallel={self.data_parallel!r} is not allowed; {self.mode} chaos trials run "
                             f"{', '.join(allowed)}")
        if self.pec_scope not in SCOPES:
            raise ValueError(f"pec_scope={self.pec_scope!r} is not allowed; choose one of: {', '.join(SCOPES)}")
        if self.mode == "replay" and not 1 <= self.window <= self.max_steps:
            raise ValueError(f"window={self.window} is not allowed; choose 1 <= window <= max_steps={self.max_steps}")
        if self.persist_windows < 1:
            raise ValueError(f"persist_windows={self.persist_windows} is not allowed; choose an integer >= 1")
        if self.storage not in STORAGES:
            raise ValueError(f"storage={self.storage!r} is not allowed; choose one of: {', '.join(STORAGES)}")
        if self.storage == "s3" and self.mode != "pec":
            raise ValueError(f"storage=s3 runs mode=pec trials, not mode={self.mode!r} (replay windows in a bucket: "
                             "tests/test_replay_lightning.py)")

    @property
    def snapshot_steps(self) -> list[int]:
        return list(range(self.every, self.max_steps, self.every))

    @property
    def persist_steps(self) -> list[int]:
        return self.snapshot_steps[:: self.persist_every]

    @property
    def window_ends(self) -> list[int]:
        """Replay mode: the steps complete windows end at (their hand-overs and seals)."""
        return list(range(self.window, self.max_steps + 1, self.window))

    @property
    def stored_window_ends(self) -> list[int]:
        """Replay mode: the end steps of the windows written to storage (every ``persist_windows``-th, from the
        first)."""
        return self.window_ends[:: self.persist_windows]

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Fault:
    """One drawn fault. ``kind``: ``kill`` (with a MOC_FAULT plan), ``node_loss`` or ``damage``."""

    kind: str
    after: int
    """Kills: the incarnation it fires in; node loss and damage: applied after this incarnation ended."""
    plan: str | None = None
    node: int | None = None
    target: str | None = None
    op: str | None = None
    rank: int | None = None
    """Damage of a replay window: the rank whose newest stored window it is."""
    rule: dict[str, Any] | None = None
    """A ``network`` fault (``storage=s3``): the fault proxy's rule, as :class:`~.s3_proxy.FaultRule`'s arguments."""

    @property
    def label(self) -> str:
        if self.kind == "network":
            return f"net:{_needed(self.rule, self, 'rule')['name']}"
        if self.kind == "kill":
            return f"kill:{FaultPlan.parse(_needed(self.plan, self, 'plan')).phase}"
        if self.kind == "damage":
            return f"damage:{self.target}:{self.op}"
        return self.kind


T = TypeVar("T")


def _needed(value: T | None, fault: Fault, name: str) -> T:
    """``fault``'s field ``name`` (``value``), which its kind needs: the draws below always set it."""
    if value is None:
        raise ValueError(f"a {fault.kind} fault needs its {name}: {fault}")
    return value


def draw_faults(rng: random.Random, cfg: TrialConfig) -> list[Fault]:
    """A kill at a random point of incarnation 0, maybe followed by a second fault; on ``storage=s3`` a network
    fault beside them (drawn last: a local trial's draws stay what they were)."""
    if cfg.mode == "replay":
        return draw_replay_faults(rng, cfg)
    faults = _draw_pec_faults(rng, cfg)
    if cfg.storage == "s3":
        from moc_lightning.tools.chaos.s3_trials import draw_network_fault  # boto3: the dev extra

        faults = [_reached_on_s3(f, cfg) for f in faults]
        faults.append(Fault("network", 0, rule=draw_network_fault(rng)))
    return faults


def _reached_on_s3(fault: Fault, cfg: TrialConfig) -> Fault:
    """A kill moved where a ``storage=s3`` trial reaches it, the draws unchanged:

    - inside a persist or its commit: the first one reached, not the one of a drawn step (a persist over S3 outlasts
      several snapshots, which skip theirs, so a drawn step's persist is mostly never taken and the kill never fired);
    - in training after the resume: its ``nth`` folded into one persist interval (``every * persist_every`` steps).
      Incarnation 0 mostly dies late in a 48-step run, so a resume often had fewer steps left than an ``nth`` up to
      ``max_steps // 2`` and the kill never fired (2 of the first 19 trials of session 28)."""
    plan = FaultPlan.parse(fault.plan) if fault.kind == "kill" and fault.plan else None
    if plan is not None and plan.phase in ("persist", "manifest_commit") and plan.step is not None:
        return replace(fault, plan=replace(plan, step=None, nth=1).spec())
    if plan is not None and plan.phase == "train" and plan.incarnation != 0 and plan.step is None:
        return replace(fault, plan=replace(plan, nth=1 + (plan.nth - 1) % (cfg.every * cfg.persist_every)).spec())
    return fault


def _draw_pec_faults(rng: random.Random, cfg: TrialConfig) -> list[Fault]:
    """PEC mode's kill and second fault."""
    phase = rng.choice(KILL_PHASES)
    rank = 0 if phase == "manifest_commit" else rng.randrange(WORLD)
    if phase == "train":
        step = rng.randrange(1, cfg.max_steps)
    elif phase in ("persist", "manifest_commit"):
        step = rng.choice(cfg.persist_steps)
    else:
        step = rng.choice(cfg.snapshot_steps)
    second = rng.choice(SECOND_FAULTS)
    if second == "kill_recovery":
        step = _after_the_first_commit(phase, step, cfg)
    faults = [Fault("kill", 0, plan=FaultPlan(rank, step, phase, incarnation=0).spec())]
    if second == "node_loss":
        faults.append(Fault("node_loss", 0, node=rng.randrange(WORLD // RANKS_PER_NODE)))
    elif second == "damage":
        faults.append(Fault("damage", 0, target=rng.choice(DAMAGE_TARGETS), op=rng.choice(DAMAGE_OPS)))
    elif second == "kill_recovery":
        faults.append(Fault("kill", 1, plan=FaultPlan(rng.randrange(WORLD), None, "recovery", incarnation=1).spec()))
    elif second == "kill_train":
        faults.append(_second_kill_in_training(rng, cfg))
    return faults


def _after_the_first_commit(phase: str, step: int, cfg: TrialConfig) -> int:
    """``step``, or a later one where a kill there would leave nothing committed to recover from: the next
    incarnation then starts afresh and a kill drawn inside its recovery never fires (2 of session 29's first 6 zero2
    trials). Moved by one snapshot interval, no draw added: the other trials' draws stay what they were."""
    first = cfg.snapshot_steps[0]
    if (phase == "train" and step <= first) or (phase in ("snapshot", "slot_commit") and step == first):
        return step + cfg.every
    return step


def _second_kill_in_training(rng: random.Random, cfg: TrialConfig) -> Fault:
    """A kill of a random rank at the end of a random one of the first ``max_steps // 2`` steps incarnation 1 trains."""
    nth = rng.randrange(1, cfg.max_steps // 2)
    return Fault("kill", 1, plan=FaultPlan(rng.randrange(WORLD), None, "train", nth=nth, incarnation=1).spec())


def draw_replay_faults(rng: random.Random, cfg: TrialConfig) -> list[Fault]:
    """Replay mode: a kill at a random point of incarnation 0 (:data:`REPLAY_KILL_PHASES`, each at a step where it is
    reached), maybe followed by a second fault (:data:`REPLAY_SECOND_FAULTS`)."""
    phase = rng.choice(REPLAY_KILL_PHASES)
    rank = 0 if phase == "manifest_commit" else rng.randrange(WORLD)
    if phase in ("train", "capture"):
        step = rng.randrange(1, cfg.max_steps + 1)
    elif phase in ("handover", "seal"):
        step = rng.choice(cfg.window_ends)
    elif phase == "store":
        step = rng.choice(cfg.stored_window_ends)
    else:  # inside the final persist
        step = cfg.max_steps
    faults = [Fault("kill", 0, plan=FaultPlan(rank, step, phase, incarnation=0).spec())]
    second = rng.choice(REPLAY_SECOND_FAULTS)
    if second in ("damage", "node_loss_damage"):
        damaged = rng.randrange(WORLD)
        faults.append(Fault("damage", 0, target=rng.choice(WINDOW_DAMAGE_TARGETS), op=rng.choice(DAMAGE_OPS),
                            rank=damaged))
        if second == "node_loss_damage":
            faults.append(Fault("node_loss", 0, node=damaged // RANKS_PER_NODE))
    elif second == "node_loss":
        faults.append(Fault("node_loss", 0, node=rng.randrange(WORLD // RANKS_PER_NODE)))
    elif second == "kill_restore":
        faults.append(Fault("kill", 1, plan=FaultPlan(rng.randrange(WORLD), None, "restore", incarnation=1).spec()))
    elif second == "kill_replay":  # after one of the W-1 replayed optimizer steps
        nth = rng.randrange(1, cfg.window) if cfg.window > 1 else 1
        faults.append(Fault("kill", 1, plan=FaultPlan(rng.randrange(WORLD), None, "replay", nth=nth,
                                                      incarnation=1).spec()))
    elif second == "kill_train":
        faults.append(_second_kill_in_training(rng, cfg))
    return faults


def damage(storage: Path, target: str, op: str, rng: random.Random, rank: int | None = None) -> str:
    """Damage one stored file of the newest checkpoint (or the manifest), or of ``rank``'s newest stored replay window
    (``window``, ``head``); says what was done, or why not."""
    checkpoints = sorted(p for p in storage.glob("step_*") if p.is_dir())
    if target in WINDOW_DAMAGE_TARGETS:
        if rank is None:
            raise ValueError(f"damage of a replay {target} needs the rank whose newest stored window it is")
        windows = sorted(storage.glob(f"{WINDOW_PREFIX}rank{rank}.*{WINDOW_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        if not windows:
            return f"rank {rank} has no stored replay window to damage ({target})"
        number = windows[-1].name.removeprefix(f"{WINDOW_PREFIX}rank{rank}.").removesuffix(WINDOW_SUFFIX)
        path = windows[-1] if target == "window" else storage / head_object(rank, int(number))
    elif target == "manifest":
        path = storage / "manifest.json"
    elif not checkpoints:
        return f"no checkpoint to damage ({target})"
    elif target == "data":
        files = sorted(checkpoints[-1].glob("*.distcp"))
        path = rng.choice(files) if files else checkpoints[-1] / "missing.distcp"
    else:
        path = checkpoints[-1] / (".metadata" if target == "metadata" else "moc.json")
    if not path.exists():
        return f"{path} does not exist"
    if op == "delete":
        path.unlink()
    elif op == "truncate":
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        data = bytearray(path.read_bytes())
        if not data:
            return f"{path} is empty"
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"flipped a bit of byte {i} of {path.relative_to(storage)}"
    return f"{op} {path.relative_to(storage)}"


def lose_node(shm_root: Path, node: int) -> str:
    """Delete a simulated node's shared-memory root, as a replacement node would find it."""
    gone = [p for p in shm_root.glob(f"*/node{node}") if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return f"deleted {len(gone)} node{node} root(s)"


def run_incarnation(
    work: Path, shm_root: Path, cfg: TrialConfig, inc: int, fault_plan: str | None, no_moc: bool = False,
    storage: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """One launch of the job; its outcome: exit code, seconds, whether it hung, the last lines of output.
    ``storage``: the run's ``s3://`` URL and the endpoint to reach it by (default: ``work/ckpt``)."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    env[INCARNATION_ENV] = str(inc)
    env.pop("MOC_FAULT", None)
    if fault_plan:
        env["MOC_FAULT"] = fault_plan
    shutil.rmtree(work / "run" / "moc_recovery", ignore_errors=True)
    cmd = [
        sys.executable, "-m", "moc_lightning.tools.chaos.worker", "--work", str(work), "--shm-root", str(shm_root),
        "--max-steps", str(cfg.max_steps), "--every", str(cfg.every), "--persist-every", str(cfg.persist_every),
        "--k-snapshot", str(cfg.k_snapshot), "--k-persist", str(cfg.k_persist), "--pg-timeout", str(cfg.pg_timeout),
        "--data-parallel", cfg.data_parallel, "--pec-scope", cfg.pec_scope, "--mode", cfg.mode,
        "--window", str(cfg.window), "--persist-windows", str(cfg.persist_windows),
    ] + (["--no-moc"] if no_moc else [])  # fmt: skip
    if storage is not None:
        cmd += ["--storage-url", storage[0], "--endpoint", storage[1]]
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"inc{inc}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=cfg.incarnation_timeout)
            hang = None
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            rc = proc.wait()
            hang = f"no exit within {cfg.incarnation_timeout:.0f} s"
    text = log.read_text(errors="replace")
    killed = KILL_LINE in text
    if hang is None and rc != 0 and not killed:  # a killed rank's peers may time out while the agent stops them
        hang = next((f"a collective timed out: {line.strip()[:200]}" for line in text.splitlines()
                     if any(m in line for m in HANG_MARKERS) and "Error" in line), None)
    errors = [line.strip() for line in text.splitlines() if "Error" in line and "Traceback" not in line]
    return {
        "inc": inc,
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        "hang": hang,
        "killed": killed,
        "tail": (errors[-1] if errors else text[-300:])[:400],
    }


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the ranks are children of the launch's fork server, not of the launch)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return [d for c in children for d in (c, *_descendants(c))]


def _kill_tree(pid: int) -> None:
    """SIGKILL a hung launch: ``pid`` and every process it started."""
    for victim in (*_descendants(pid), pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reference_records(root: Path, cfg: TrialConfig) -> dict[int, list[dict[str, Any]]]:
    """The uninterrupted run's records, computed once per configuration under ``root``: without MoC in PEC mode,
    with it (the fault-free run of the trials' options, their oracle) in replay mode."""
    work = root / f"reference-{cfg.key()}"
    if not (work / "done").exists():
        shutil.rmtree(work, ignore_errors=True)
        shm_root = Path(f"/dev/shm/chaos_reference_{os.getpid()}")
        try:
            outcome = run_incarnation(work, shm_root, cfg, 0, None, no_moc=cfg.mode == "pec")
        finally:
            shutil.rmtree(shm_root, ignore_errors=True)
        if outcome["rc"] != 0:
            raise RuntimeError(f"the reference run failed: {outcome}")
        (work / "done").write_text(json.dumps(outcome))
    return {r: read_records(work / "oracle" / f"rank{r}.jsonl") for r in range(WORLD)}


@dataclass
class TrialResult:
    seed: int
    faults: list[dict[str, Any]]
    applied: list[str] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    failures: dict[str, list[str]] = field(default_factory=dict)
    fired: list[bool] = field(default_factory=list)
    """Per drawn fault, whether it happened (a kill planned past the end of training, or damage after a clean
    finish, does not; a network fault whose requests never came)."""
    starts: list[tuple[int, int]] = field(default_factory=list)
    """``(incarnation, step it trained from)`` as rank 0 recorded them: where each recovery landed."""
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        """Every check held."""
        return not any(self.failures.values())

    @property
    def unfired(self) -> list[str]:
        """The kills and network faults drawn that never fired: the trial did not test what it drew."""
        drawn = zip(self.faults, self.fired)
        return [f["label"] for f, fired in drawn if f["kind"] in ("kill", "network") and not fired]

    @property
    def passed(self) -> bool:
        """Every check held and every kill and network fault fired (a trial whose fault never fired is no pass, whatever
        its checks)."""
        return self.held and not self.unfired

    @property
    def verdict(self) -> str:
        if not self.held:
            return "FAIL " + ",".join(check for check, details in self.failures.items() if details)
        return "PASS" if self.passed else "UNFIRED " + ",".join(self.unfired)


def run_trial(
    seed: int, root: Path, cfg: TrialConfig, reference: Mapping[int, list[dict[str, Any]]], keep: bool = False,
    bucket: BucketStore | None = None, faults: Sequence[Fault] | None = None,
) -> TrialResult:
    """Draw the faults of ``seed``, run the trial's incarnations under ``root``, and check them; ``bucket``: the
    server and proxy of ``storage=s3`` trials (:func:`~moc_lightning.tools.chaos.s3_trials.bucket_store`);
    ``faults``: these instead of the draws (a test pins an edge of the loop that the draws do not reach). ``seed``
    still seeds what a damage fault corrupts."""
    rng = random.Random(seed)
    faults = draw_faults(rng, cfg) if faults is None else list(faults)
    result = TrialResult(seed, [asdict(f) | {"label": f.label} for f in faults])
    described = [f.label + (f" ({f.plan or f.rule})" if f.plan or f.rule else "") for f in faults]
    print(f"[chaos] trial seed={seed}: faults {described}", flush=True)
    storage = None
    if cfg.storage == "s3":
        if bucket is None:
            raise ValueError("storage=s3 trials need the bucket store they run against (s3_trials.bucket_store())")
        network = next((f.rule for f in faults if f.kind == "network"), None)
        storage = (bucket.new_trial(seed, network), bucket.proxy.endpoint)
    work = root / f"trial-{seed}"
    shm_root = Path(f"/dev/shm/chaos_{seed}_{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    start = time.monotonic()
    try:
        for inc in range(cfg.restarts + 1):
            plan = next((f.plan for f in faults if f.kind == "kill" and f.after == inc), None)
            outcome = run_incarnation(work, shm_root, cfg, inc, plan, storage=storage)
            result.outcomes.append(outcome)
            if outcome["rc"] == 0 or outcome["hang"]:
                break  # a hang is the finding; restarting into more hangs would only burn the trial's time
            for f in faults:
                if f.after == inc and f.kind == "node_loss":
                    result.applied.append(lose_node(shm_root, _needed(f.node, f, "node")))
                elif f.after == inc and f.kind == "damage":
                    target, op = _needed(f.target, f, "target"), _needed(f.op, f, "op")
                    result.applied.append(
                        damage(work / "ckpt", target, op, rng, f.rank) if bucket is None or storage is None
                        else bucket.damage(storage[0], target, op, rng)
                    )
        records = {r: read_records(work / "oracle" / f"rank{r}.jsonl") for r in range(WORLD)}
        result.fired = [bucket.fired() if f.kind == "network" and bucket is not None else _fired(f, result.outcomes)
                        for f in faults]
        if bucket is not None:
            result.applied.append(f"network: {bucket.dealt()} requests faulted")
        began = "restored" if cfg.mode == "replay" else "start"  # replay mode: where the state after the replay is
        result.starts = [(r["inc"], r["step"]) for r in records[0] if r["kind"] == began]
        final = None
        if cfg.data_parallel in REPLAY_DATA_PARALLEL and storage is None:
            finished = result.outcomes[-1]["rc"] == 0
            final = consolidated_digests(work) if finished else "the job never finished: no final checkpoint"
        result.failures = run_checks(
            records, reference, result.outcomes, cfg.max_steps, WORLD, final, replay=cfg.mode == "replay"
        )
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def consolidated_digests(work: Path) -> dict[str, str] | str:
    """Digests of the trial's final checkpoint consolidated (``moc-consolidate --format lightning``), keyed as
    :func:`~moc_lightning.tools.chaos.checks.consolidated_key` says; or why there are none."""
    out = work / "consolidated.pt"
    try:
        consolidate((work / "ckpt").resolve().as_uri(), out, progress=False)
        dense = torch.load(out, weights_only=True)
    except Exception as err:  # a finding of the trial, not a crash of the harness
        return f"moc-consolidate of the final checkpoint failed: {type(err).__name__}: {err}"
    finally:
        out.unlink(missing_ok=True)
    digests = {f"weights/{name}": tensor_digest(t) for name, t in dense["state_dict"].items()}
    for param, states in dense[OPTIMIZER_KEY].items():
        digests |= {f"optim/{param}/{state}": tensor_digest(t) for state, t in states.items()}
    return digests


def _fired(fault: Fault, outcomes: list[dict[str, Any]]) -> bool:
    """A kill fired when its incarnation lost a rank to SIGKILL; node loss and damage apply when the
    incarnation before them failed."""
    if fault.after >= len(outcomes):
        return False
    outcome = outcomes[fault.after]
    return bool(outcome["killed"]) if fault.kind == "kill" else outcome["rc"] != 0


def tally(results: list[TrialResult]) -> dict[str, Any]:
    """Pass/fail counts per check, overall and per fault kind, and every failing trial's first details."""
    checks: dict[str, Counter] = {}
    by_fault: dict[str, dict[str, Counter]] = {}
    for result in results:
        for check, details in result.failures.items():
            verdict = "fail" if details else "pass"
            checks.setdefault(check, Counter())[verdict] += 1
            for fault in {f["label"] for f, fired in zip(result.faults, result.fired) if fired}:
                by_fault.setdefault(fault, {}).setdefault(check, Counter())[verdict] += 1
    kills: dict[str, Counter] = {}
    network: dict[str, Counter] = {}
    for result in results:
        for f, fired in zip(result.faults, result.fired):
            if f["kind"] == "kill":
                kills.setdefault(f["label"].removeprefix("kill:"), Counter()).update(drawn=1, fired=int(fired))
            elif f["kind"] == "network":
                network.setdefault(f["label"].removeprefix("net:"), Counter()).update(drawn=1, fired=int(fired))
    return {
        "trials": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.held for r in results),
        "unfired": [{"seed": r.seed, "kills": r.unfired} for r in results if r.held and r.unfired],
        "injections": sum(sum(r.fired) for r in results),
        "not_fired": dict(Counter(f["label"] for r in results for f, fired in zip(r.faults, r.fired) if not fired)),
        "kills": {phase: dict(counts) for phase, counts in sorted(kills.items())},
        "network": {kind: dict(counts) for kind, counts in sorted(network.items())},
        "seconds_per_trial": [r.seconds for r in results],
        "checks": {k: dict(v) for k, v in checks.items()},
        "by_fault": {f: {k: dict(v) for k, v in c.items()} for f, c in sorted(by_fault.items())},
        "failures": [
            {
                "seed": r.seed,
                "faults": [f["label"] + (f" ({f['plan']})" if f["plan"] else "") + ("" if fired else " [not fired]")
                           for f, fired in zip(r.faults, r.fired)],
                "applied": r.applied,
                "starts": r.starts,
                "incarnations": [{k: o[k] for k in ("inc", "rc", "seconds", "hang", "killed")} for o in r.outcomes],
                "failed": {check: details[0] for check, details in r.failures.items() if details},
                "details": {check: details for check, details in r.failures.items() if details},
            }
            for r in results
            if not r.held
        ],
    }


def _width(check: str) -> int:
    """A column of the table: wide enough for its check's name and for "NNN fail/NNN", with two spaces."""
    return max(len(check), 12) + 2


def summary_table(summary: Mapping[str, Any]) -> str:
    """The counts as a small text table: one row per check, then one per fault kind."""
    checks = list(summary["checks"])
    unfired = ", ".join(f"seed {u['seed']} ({', '.join(u['kills'])})" for u in summary["unfired"])
    lines = [f"{summary['passed']}/{summary['trials']} trials passed, {summary['failed']} failed, "
             f"{len(summary['unfired'])} held their checks but a kill never fired{': ' + unfired if unfired else ''}",
             f"{summary['injections']} injections (drawn but not fired: {summary['not_fired'] or 'none'})",
             "kill points reached per phase: " + ", ".join(f"{phase} {c.get('fired', 0)}/{c['drawn']}"
                                                           for phase, c in summary["kills"].items()),
             *(["network faults fired per kind: " + ", ".join(f"{kind} {c.get('fired', 0)}/{c['drawn']}"
                                                          for kind, c in summary["network"].items())]
               if summary.get("network") else []),
             f"{'':28}" + "".join(f"{c:>{_width(c)}}" for c in checks)]

    def row(name: str, counts: Mapping[str, Mapping[str, int]]) -> str:
        cells = "".join(f"{counts.get(c, {}).get('fail', 0)} fail/{sum(counts.get(c, {}).values())}".rjust(_width(c))
                        for c in checks)
        return f"{name:28}{cells}"

    lines.append(row("all", summary["checks"]))
    lines += [row(fault, counts) for fault, counts in summary["by_fault"].items()]
    return "\n".join(lines)
