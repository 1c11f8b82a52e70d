"""``make gpu-check``: prove the CUDA path on a GPU node in one command, and bring its figures back.

    python scripts/gpu_check.py [--out DIR]            # on a GPU node: run every step, write the report
    python scripts/gpu_check.py --dry-run [--gpus N]   # anywhere: list the steps it would run, run nothing

The steps (:func:`steps`) run one after another, each in its own process under its time budget (killed past it):
every test marked ``cuda``, the training recipe on ``trainer=gpu`` with MoC (DDP; FSDP2 with 2 GPUs or more), the
kill-and-resume drill checked bitwise, and the quick bench on device memory against DCP and Lightning. The budgets of
the steps one GPU runs add up to under 8 minutes. ``DIR`` (default ``gpu_check``) gets ``gpu_report.json``,
``gpu_report.md`` and each step's log. Without a GPU it says so in one line and exits 0 having run nothing; the dry run
prints the same list of steps the real run takes. ``tests/test_gpu_check.py`` checks on CPU that every test and
bench method the steps name exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU_BUDGET_S = 480
"""What the steps of a one-GPU node may take together (the issue's 8 minutes)."""
CUDA_TESTS = (
    "tests/test_cuda.py::test_slots_are_pinned_for_the_device_and_a_failed_pin_raises",
    "tests/test_cuda.py::test_each_rank_pins_on_its_own_device_and_touches_no_other",
    "tests/test_cuda.py::test_real_slots_copy_from_the_device_bitwise",
    "tests/test_cuda.py::test_the_side_stream_copy_overlaps_the_next_forward",
    "tests/test_cuda.py::test_the_optimizer_step_waits_for_an_unfinished_copy",
    "tests/test_cuda.py::test_restore_copies_into_the_ranks_own_device_in_place",
    "tests/test_cuda.py::test_nccl_all_to_all_expert_parallel_matches_one_process",
    "tests/test_cuda.py::test_bf16_autocast_trains_with_fp32_master_state_in_the_snapshots",
    "tests/test_cuda.py::test_snapshots_grow_no_device_allocation",
    "tests/test_cuda.py::test_router_counts_on_the_device_are_added_there_and_summed_at_the_mark",
)
"""Every test marked ``cuda`` but the drill (those needing 2 GPUs skip themselves, saying why, on one)."""
DRILL_TEST = "tests/test_fault_drills.py::test_a_killed_gpu_rank_resumes_bitwise_from_the_snapshots"
BENCH_METHODS = ("moc_k1", "moc_replay", "dcp_async", "lightning_async")
FIGURES = (
    "stall_ms_mean", "stall_ms_p95", "stall_overhead_pct", "overhead_pct", "snapshot_gbps", "snapshot_pct_of_light",
    "persist_gbps", "persist_pct_of_light", "recover_seconds", "skipped",
)  # fmt: skip
"""The bench figures the report keeps per method (``docs/bench.md`` defines them)."""


class Step(NamedTuple):
    """One thing the GPU check runs: a command in its own process, under a time budget."""

    name: str
    """Its name in the dry run, the log's file name and the report."""
    what: str
    """One line: what the step proves."""
    command: tuple[str, ...]
    """Run from the repository root."""
    budget_s: int
    """Seconds before the step is killed and counted as failed."""
    min_gpus: int = 1
    """GPUs it needs; with fewer it is skipped, saying so."""
    tests: tuple[str, ...] = ()
    """pytest node ids the step runs (their results go into the report)."""
    junit: str | None = None
    """The step's pytest result file, under the output directory."""
    bench_json: str | None = None
    """The step's bench result file, under the output directory."""


@dataclass
class StepResult:
    """How a step went."""

    name: str
    status: str
    """``passed``, ``failed``, ``timeout`` or ``skipped``."""
    seconds: float = 0.0
    returncode: int | None = None
    reason: str = ""
    log: str = ""
    tests: dict[str, dict[str, str]] = field(default_factory=dict)
    """Node id -> ``{"result": passed|failed|error|skipped, "message": ...}``."""


TMPFS = Path("/dev/shm/moc_gpu_check")
"""The steps' snapshot slots and the tests' temporary folders: the driver page-locks memory-backed files (tmpfs, where
``checkpoint.shm_root``'s default ``/dev/shm`` is) but refuses a file on disk, and a GPU node's ``/tmp`` may be one."""


def _pytest(tests: tuple[str, ...], junit: Path) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}",
        f"--basetemp={TMPFS / junit.stem}", *tests,
    )  # fmt: skip


def _train(out: Path, gpus: int, data_parallel: str) -> tuple[str, ...]:
    """The training recipe on ``trainer=gpu`` with MoC, 100 steps, its files under ``out/train_<mode>``."""
    run = out / f"train_{data_parallel}"
    return (
        sys.executable, "recipes/train.py", "trainer=gpu", f"trainer.devices={gpus}",
        f"trainer.data_parallel={data_parallel}", "trainer.max_steps=100", "trainer.val_check_interval=50",
        "trainer.limit_val_batches=4", "checkpoint=moc", "checkpoint.every_n_train_steps=10",
        f"checkpoint.storage.url={(run / 'ckpt').as_uri()}", f"checkpoint.shm_root={TMPFS / run.name}",
        f"hydra.run.dir={run}",
    )  # fmt: skip


def steps(gpus: int, out: Path) -> list[Step]:
    """The GPU check, in order, for a node with ``gpus`` GPUs writing under ``out``: what the run runs and the dry
    run lists."""
    return [
        Step("cuda-tests", "every test marked cuda but the drill (tests/test_cuda.py)",
             _pytest(CUDA_TESTS, out / "cuda_tests.xml"), 120, tests=CUDA_TESTS, junit="cuda_tests.xml"),
        Step("train-ddp", "recipes/train.py trainer=gpu, 100 steps with MoC, DDP over NCCL, bf16-mixed",
             _train(out, gpus, "ddp"), 75),
        Step("train-fsdp2", "recipes/train.py trainer=gpu, 100 steps with MoC, FSDP2 over NCCL, bf16-mixed",
             _train(out, gpus, "fsdp2"), 75, min_gpus=2),
        Step("drill", "SIGKILL a rank at step 23, resume from the step-20 snapshots, every tensor checked bitwise",
             _pytest((DRILL_TEST,), out / "drill.xml"), 90, tests=(DRILL_TEST,), junit="drill.xml"),
        Step("bench", "quick bench on device memory: stalls, overheads, % of the D2H copy's speed of light",
             (sys.executable, "recipes/bench.py", "preset=quick", "accelerator=gpu",
              f"methods=[{','.join(BENCH_METHODS)}]", f"out={out / 'bench.json'}", f"hydra.run.dir={out / 'bench'}"),
             180, bench_json="bench.json"),
    ]  # fmt: skip


def dry_run(gpus: int, out: Path) -> str:
    """What the check would run on ``gpus`` GPUs, one block per step, in the order it runs them."""
    lines = [f"gpu-check dry run for {gpus} GPU(s), output under {out}:"]
    for step in steps(gpus, out):
        when = f"runs ({step.budget_s} s budget)" if gpus >= step.min_gpus else f"skipped: needs {step.min_gpus} GPUs"
        lines.append(f"- {step.name}: {step.what}; {when}")
        lines.append(f"    {shlex.join(step.command)}")
    total = sum(s.budget_s for s in steps(gpus, out) if gpus >= s.min_gpus)
    lines.append(f"budget of the steps that run: {total} s")
    return "\n".join(lines)


def run_step(step: Step, gpus: int, out: Path) -> StepResult:
    """Run ``step`` in its own process group (all of it is killed past the budget); its output to its log."""
    if gpus < step.min_gpus:
        return StepResult(step.name, "skipped", reason=f"needs {step.min_gpus} GPUs, found {gpus}")
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[gpu-check] {step.name} (budget {step.budget_s} s): {step.what}", flush=True)
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(step.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=step.budget_s)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code, status = None, "timeout"
    result = StepResult(step.name, status, round(time.perf_counter() - start, 1), code, log=str(log.relative_to(out)))
    if step.junit is not None:
        result.tests = test_results(out / step.junit, step.tests)
    print(f"[gpu-check] {step.name}: {status} in {result.seconds} s", flush=True)
    return result


def test_results(junit: Path, tests: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Each named test's result from pytest's JUnit XML (``missing`` when the run ended before writing it)."""
    found: dict[str, dict[str, str]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            found[node] = {
                "result": "passed" if outcome is None else {"failure": "failed"}.get(outcome.tag, outcome.tag),
                "message": "" if outcome is None else (outcome.get("message") or "")[:500],
            }
    return {test: found.get(test, {"result": "missing", "message": "no result written"}) for test in tests}


def environment() -> dict[str, Any]:
    """The node: devices, driver, torch, CUDA, NCCL, Lightning."""
    import lightning
    import torch

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.split("\n")[0].strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        driver = f"unknown ({err})"
    nccl = torch.cuda.nccl.version()
    return {
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def bench_figures(path: Path) -> dict[str, Any] | None:
    """The bench's speed of light and each method's :data:`FIGURES`, from its JSON result."""
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return {
        "speed_of_light": result["speed_of_light"],
        "baseline_iter_ms": result["baseline_iter_ms"],
        "state_bytes": result["state_bytes"],
        "methods": {row["name"]: {k: row.get(k) for k in FIGURES} for row in result["methods"]},
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: the node, each step, each test's result, the bench figures."""
    env = report["environment"]
    lines = [
        "# GPU check", "",
        f"Devices: {', '.join(env['devices'])}; driver {env['driver']}; torch {env['torch']} (CUDA {env['cuda']}); "
        f"NCCL {env['nccl']}; Lightning {env['lightning']}.", "",
        "| step | status | seconds | budget s |", "|---|---|---|---|",
    ]  # fmt: skip
    for step in report["steps"]:
        lines.append(f"| {step['name']} | {step['status']} {step['reason']} | {step['seconds']} | {step['budget_s']} |")
    lines += ["", "| test | result | message |", "|---|---|---|"]
    for step in report["steps"]:
        for test, outcome in step["tests"].items():
            lines.append(f"| {test} | {outcome['result']} | {outcome['message'].splitlines()[0] if outcome['message'] else ''} |")
    bench = report["bench"]
    if bench is not None:
        light = bench["speed_of_light"]
        lines += ["", f"Bench (quick preset, device memory): D2H copy speed of light {light['copy_gbps']} GB/s, "
                  f"write+fsync {light['write_fsync_gbps']} GB/s, iteration {bench['baseline_iter_ms']} ms.", "",
                  "| method | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]  # fmt: skip
        for name, row in bench["methods"].items():
            lines.append(f"| {name} | " + " | ".join("" if row[k] is None else str(row[k]) for k in FIGURES) + " |")
    return "\n".join(lines) + "\n"


def check(gpus: int, out: Path) -> int:
    """Run every step, write the report; 0 when every step that ran passed."""
    out.mkdir(parents=True, exist_ok=True)
    TMPFS.mkdir(parents=True, exist_ok=True)
    planned = steps(gpus, out)
    results = [run_step(step, gpus, out) for step in planned]
    bench = next(s for s in planned if s.bench_json is not None)
    report = {
        "environment": environment(),
        "steps": [{**asdict(r), "budget_s": s.budget_s, "command": shlex.join(s.command)} for s, r in zip(planned, results)],
        "bench": bench_figures(out / bench.bench_json),
    }
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_report.md").write_text(markdown(report))
    print(f"[gpu-check] report: {out / 'gpu_report.md'} and {out / 'gpu_report.json'}")
    return 0 if all(r.status in ("passed", "skipped") for r in results) else 1


def gpu_count() -> int:
    """CUDA devices this process sees (0 without a CUDA build or a driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvidia_gpus_present() -> bool:
    """Whether the NVIDIA driver lists a GPU on this node, whatever torch build runs this script (the ``.venv`` of
    ``requirements/constraints.txt`` holds the CPU build)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check", help="report and logs directory")
    parser.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    parser.add_argument("--gpus", type=int, default=None, help="with --dry-run: plan for this many GPUs")
    args = parser.parse_args(argv)
    found = gpu_count()
    if args.dry_run:
        print(dry_run(args.gpus if args.gpus is not None else max(found, 1), args.out.resolve()))
        return 0
    if found == 0 and nvidia_gpus_present():
        import torch

        print(f"gpu-check: this node has NVIDIA GPUs but torch {torch.__version__} ({sys.executable}) sees none; "
              "run it with a CUDA build of torch: make gpu-check PY=<that python>")
        return 2
    if found == 0:
        print("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing run")
        return 0
    return check(found, args.out.resolve())


if __name__ == "__main__":
    sys.exit(main())
