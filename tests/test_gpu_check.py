"""``make gpu-check`` cannot rot while no GPU is around: every test and bench method its steps name exists, every test
marked ``cuda`` is run by a step, the recipe and bench overrides compose, the dry run lists the steps the run takes,
the no-GPU path runs nothing, and the report is written from real step results."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moc_lightning.jobs.training import register_configs, to_train_config
from moc_lightning.tools.bench import METHODS, BenchConfig
from moc_lightning.tools.bench import register_configs as register_bench_configs

ROOT = Path(__file__).resolve().parents[1]
PLAN_GPUS = 2
"""Plan for 2 GPUs: every step runs, the FSDP2 recipe included."""


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def _overrides(command: tuple[str, ...]) -> list[str]:
    """A recipe command's Hydra overrides, less those of where it writes."""
    return [arg for arg in command[2:] if not arg.startswith(("hydra.", "out="))]


@pytest.mark.slow
def test_every_cuda_test_exists_and_a_step_runs_it(gpu_check: ModuleType, tmp_path: Path) -> None:
    """The node ids the steps name are exactly the tests pytest collects under ``-m cuda``."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    marked = {line for line in collected.stdout.splitlines() if "::" in line}
    named = [test for step in gpu_check.steps(PLAN_GPUS, tmp_path) for test in step.tests]
    assert len(named) == len(set(named)), "a test is named by two steps"
    assert set(named) == marked, f"named, not marked cuda: {set(named) - marked}; not run: {marked - set(named)}"


def test_the_bench_step_names_known_methods_and_composes(gpu_check: ModuleType, tmp_path: Path) -> None:
    bench = next(step for step in gpu_check.steps(PLAN_GPUS, tmp_path) if step.bench_json is not None)
    assert set(gpu_check.BENCH_METHODS) <= set(METHODS)
    register_bench_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg: BenchConfig = OmegaConf.to_object(compose("bench", overrides=_overrides(bench.command)))
    assert cfg.methods == list(gpu_check.BENCH_METHODS) and cfg.accelerator == "gpu" and cfg.devices == 1


def test_the_recipe_steps_compose_on_trainer_gpu(gpu_check: ModuleType, tmp_path: Path) -> None:
    trains = [step for step in gpu_check.steps(PLAN_GPUS, tmp_path) if step.name.startswith("train-")]
    register_configs()
    modes = []
    for step in trains:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = to_train_config(compose("train", overrides=_overrides(step.command)))
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.process_group_backend == "nccl"
        assert cfg.trainer.max_steps == 100 and cfg.checkpoint.enabled and cfg.trainer.devices == PLAN_GPUS
        modes.append((cfg.trainer.data_parallel, step.min_gpus))
    assert modes == [("ddp", 1), ("fsdp2", 2)]


def test_one_gpus_steps_fit_in_eight_minutes(gpu_check: ModuleType, tmp_path: Path) -> None:
    budget = sum(step.budget_s for step in gpu_check.steps(1, tmp_path) if step.min_gpus <= 1)
    assert budget <= gpu_check.ONE_GPU_BUDGET_S == 480


def test_the_dry_run_lists_the_steps_of_the_run(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--dry-run", "--gpus", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for step in gpu_check.steps(1, tmp_path):
        assert f"- {step.name}: {step.what}; " in printed
        assert gpu_check.shlex.join(step.command) in printed
    assert "train-fsdp2: " in printed and "skipped: needs 2 GPUs" in printed


def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a step was started without a GPU")

    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 0)
    monkeypatch.setattr(gpu_check, "nvidia_gpus_present", lambda: False)
    monkeypatch.setattr(gpu_check.subprocess, "Popen", refuse)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing run"
    ]
    assert not any(tmp_path.iterdir())


def test_the_report_holds_each_steps_and_tests_result_and_the_bench_figures(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``check`` over stand-in steps: a real pytest run (its JUnit results; a test it did not run is
    ``missing``), a bench result file, a step past its budget (killed), a step for more GPUs than there are."""
    passing, absent = "tests/test_snapshot.py::test_buffer_is_reused", "tests/test_snapshot.py::test_torn_slot_is_ignored"
    bench = {
        "speed_of_light": {"copy_gbps": 20.0, "write_fsync_gbps": 2.0}, "baseline_iter_ms": 12.5, "state_bytes": 1000,
        "methods": [{"name": "moc_k1", "stall_ms_mean": 1.5, "snapshot_pct_of_light": 80.0}],
    }  # fmt: skip
    write_bench = f"import json, pathlib; pathlib.Path({str(tmp_path / 'bench.json')!r}).write_text({json.dumps(bench)!r})"
    stand_ins = [
        gpu_check.Step("tests", "a real pytest run", gpu_check._pytest((passing, absent), tmp_path / "t.xml")
                       + ("-k", "reused"), 120, tests=(passing, absent), junit="t.xml"),  # absent: deselected
        gpu_check.Step("bench", "a bench result", (sys.executable, "-c", write_bench), 60, bench_json="bench.json"),
        gpu_check.Step("slow", "past its budget", (sys.executable, "-c", "import time; time.sleep(60)"), 1),
        gpu_check.Step("big", "for 2 GPUs", (sys.executable, "-c", "raise SystemExit(1)"), 5, min_gpus=2),
    ]  # fmt: skip
    monkeypatch.setattr(gpu_check, "steps", lambda gpus, out: stand_ins)
    monkeypatch.setattr(gpu_check, "environment", lambda: {
        "devices": ["Stand-in GPU"], "driver": "0", "torch": "t", "cuda": "c", "nccl": "n", "lightning": "l",
    })  # fmt: skip
    assert gpu_check.check(1, tmp_path) == 1, "a step past its budget fails the check"
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    status = {step["name"]: step["status"] for step in report["steps"]}
    assert status == {"tests": "passed", "bench": "passed", "slow": "timeout", "big": "skipped"}
    tests = report["steps"][0]["tests"]
    assert tests[passing]["result"] == "passed" and tests[absent]["result"] == "missing"
    assert report["bench"]["methods"]["moc_k1"]["snapshot_pct_of_light"] == 80.0
    page = (tmp_path / "gpu_report.md").read_text()
    assert "Stand-in GPU" in page and f"| {passing} | passed |" in page and "| moc_k1 | 1.5 |" in page
    assert (tmp_path / "logs" / "slow.log").exists()


def test_gpus_that_torch_cannot_see_fail_the_check(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU node running the check with the CPU build of torch (the ``.venv``'s) must not pass as "no GPU"."""
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 0)
    monkeypatch.setattr(gpu_check, "nvidia_gpus_present", lambda: True)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "has NVIDIA GPUs but torch" in capsys.readouterr().out and not any(tmp_path.iterdir())
