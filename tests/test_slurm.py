"""A real SLURM cluster on localhost: plain ``sbatch``, requeue, and the recipe through Hydra's submitit launcher.

The cluster comes from ``scripts/slurm/start_cluster.sh`` (Debian's slurm-wlm + munge, one node, no systemd).
Policy, decided by the ``MOC_SLURM`` environment variable:

* ``MOC_SLURM=1`` (CI sets it): the session fixture runs ``start_cluster.sh`` (root needed: it installs the
  packages and starts the daemons). If the cluster cannot start, every test here ERRORS with the script's
  output -- CI asked for SLURM, so a skip would be a silent pass.
* unset or ``0`` (a developer's quick run): the tests are skipped, with the reason in pytest's summary.

Daemons started by the fixture are stopped at the end of the session (``stop_cluster.sh``); a cluster that
was already up before the session is left running.

There is no accounting database (slurmdbd), so ``sacct`` does not work: job states come from
``scontrol show job`` (slurm.conf keeps finished jobs for an hour), and submitit -- which polls ``sacct`` and
logs "Bypassing sacct error" -- learns that a job ended from the result pickle the job writes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moc_lightning.engine.manifest import Manifest, ManifestError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "slurm"
PARTITION = "debug"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one worker holds the session's cluster


def _run(cmd: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _cluster_answers() -> bool:
    """slurmctld answers and the test partition exists."""
    if shutil.which("sinfo") is None:
        return False
    try:
        proc = _run(["sinfo", "-h", "-p", PARTITION, "-o", "%T"], timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """A running single-node cluster with an idle partition ``debug``; see the module docstring for the policy."""
    if os.environ.get("MOC_SLURM", "0") != "1":
        pytest.skip(
            "SLURM tests need MOC_SLURM=1 (as root: starts a local cluster with scripts/slurm/start_cluster.sh)"
        )
    was_up = _cluster_answers()
    if os.geteuid() != 0:
        # start_cluster.sh needs root; without it, use a cluster someone started already.
        if not was_up:
            pytest.fail("MOC_SLURM=1 but not root and no cluster answers: run scripts/slurm/start_cluster.sh as root")
        yield
        return
    t0 = time.monotonic()
    proc = _run(["bash", str(SCRIPTS / "start_cluster.sh")], timeout=900)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(
            f"MOC_SLURM=1 but the SLURM cluster did not start (start_cluster.sh exited {proc.returncode} "
            f"after {took:.0f} s):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    print(f"\n[slurm] cluster ready in {took:.1f} s ({'already up' if was_up else 'started'})")
    yield
    if not was_up:
        _run(["bash", str(SCRIPTS / "stop_cluster.sh")], timeout=60)


# ------------------------------------------------------------------------------------------------------------
# Job helpers (scontrol, since there is no sacct).
# ------------------------------------------------------------------------------------------------------------
def _job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, ...)."""
    proc = _run(["scontrol", "show", "job", "-o", job_id])
    assert proc.returncode == 0, f"scontrol show job {job_id}: {proc.stderr}"
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def _wait_state(job_id: str, states: set[str], timeout: float) -> dict[str, str]:
    """Poll until the job is in one of ``states``; fail (and cancel it) on timeout or another final state."""
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id)
        state = fields.get("JobState", "")
        if state in states:
            return fields
        if state in FINISHED:
            pytest.fail(f"job {job_id} ended {state}, expected {sorted(states)}: {fields}")
        time.sleep(0.5)
    _run(["scancel", job_id])
    pytest.fail(f"job {job_id} not {sorted(states)} after {timeout:.0f} s: {fields}")


def _sbatch(tmp_path: Path, script: str, *args: str) -> str:
    proc = _run(["sbatch", "--parsable", f"--partition={PARTITION}", f"--chdir={tmp_path}", *args, "--wrap", script])
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


# ------------------------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------------------------
def test_sbatch_wrap_job_completes(slurm_cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job_id = _sbatch(tmp_path, 'echo "hello from $SLURM_JOB_ID on $SLURMD_NODENAME"', f"--output={out}", "--mem=100M")
    fields = _wait_state(job_id, {"COMPLETED"}, timeout=60)
    assert fields["ExitCode"] == "0:0"
    assert out.read_text().strip().startswith(f"hello from {job_id} on ")


def test_scontrol_requeue_restarts_a_running_job(slurm_cluster: None, tmp_path: Path) -> None:
    """The mechanism a preempted training job relies on: ``scontrol requeue`` kills and re-runs the batch script.

    A requeued job is PENDING (Reason=BeginTime) for slurm's credential lifetime before it may run again:
    120 s by default, 10 s on the test cluster (``AuthInfo=cred_expire=10`` in start_cluster.sh), so here it
    restarts by itself within ~15 s, as a job that requeues itself (submitit, Lightning) needs.
    ``scontrol update JobId=.. StartTime=now`` would lift the wait at once. ``SLURM_RESTART_COUNT`` tells the
    re-run that it is one.
    """
    runs = tmp_path / "runs.txt"  # not the job's output file: slurmstepd writes its cancel notice there
    marker = tmp_path / "started"
    script = f'echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {runs}; touch {marker}; sleep 60'
    job_id = _sbatch(tmp_path, script, f"--output={tmp_path / 'job.out'}", "--requeue", "--mem=100M")
    _wait_state(job_id, {"RUNNING"}, timeout=60)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the job never started its script"
    marker.unlink()

    assert _run(["scontrol", "requeue", job_id]).returncode == 0
    fields = _wait_state(job_id, {"PENDING"}, timeout=60)
    assert fields["Restarts"] == "1"
    _wait_state(job_id, {"RUNNING"}, timeout=60)  # no manual release: the cluster restarts it
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    _run(["scancel", job_id])
    assert runs.read_text().split() == ["run", "0", "run", "1"]


def _read_metrics(run_dir: Path) -> list[dict[str, str]]:
    files = list(run_dir.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {run_dir}, found {files}"
    with files[0].open() as f:
        return list(csv.DictReader(f))


def _job_logs(sweep_dir: Path) -> str:
    """Every submitit log of the sweep, for failure messages."""
    parts = []
    for log in sorted((sweep_dir / ".submitit").rglob("*_log.*")):
        parts.append(f"----- {log} -----\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _cancel_sweep_jobs(sweep_dir: Path) -> None:
    """scancel the jobs a sweep submitted (their ids are the folder names under .submitit)."""
    ids = [p.name for p in (sweep_dir / ".submitit").glob("*") if p.is_dir() and re.fullmatch(r"[0-9_]+", p.name)]
    if ids:
        _run(["scancel", *ids])


@pytest.mark.parametrize(
    ("devices", "cpus_per_task"),
    [
        pytest.param(1, 2, id="1task"),
        pytest.param(2, 1, id="2tasks-ddp"),  # two srun tasks -> Lightning's SLURMEnvironment -> DDP over gloo
    ],
)
def test_train_recipe_through_hydra_submitit_launcher(
    slurm_cluster: None, tmp_path: Path, devices: int, cpus_per_task: int
) -> None:
    """``recipes/train.py -m hydra/launcher=slurm`` submits, waits for the job and finds its results."""
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,  # the job runs `sys.executable -m submitit.core._submit`: this venv's Python
        "recipes/train.py",
        "-m",
        "hydra/launcher=slurm",
        f"trainer.devices={devices}",  # the launcher's tasks_per_node follows trainer.devices
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        "checkpoint.every_n_train_steps=5",
        f"checkpoint.shm_root={tmp_path / 'shm'}",
        f"hydra.sweep.dir={sweep_dir}",
        # Fit the launcher's cluster defaults to the one small CPU node:
        f"hydra.launcher.partition={PARTITION}",
        "hydra.launcher.gpus_per_node=0",
        f"hydra.launcher.cpus_per_task={cpus_per_task}",
        "hydra.launcher.mem_gb=4",
        "hydra.launcher.timeout_min=10",
    ]
    t0 = time.monotonic()
    try:
        proc = _run(cmd, timeout=300, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        _cancel_sweep_jobs(sweep_dir)
        pytest.fail(f"the sweep did not finish in 300 s:\n{exc.stdout}\n{exc.stderr}\n{_job_logs(sweep_dir)}")
    took = time.monotonic() - t0
    detail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{_job_logs(sweep_dir)}"
    assert proc.returncode == 0, detail
    print(f"\n[slurm] {devices}-task sweep finished in {took:.1f} s")

    # One SLURM job, run as `devices` tasks, each of which finished the Hydra job.
    job_dirs = [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
    assert len(job_dirs) == 1, job_dirs
    job_id = job_dirs[0].name
    # The launcher returns once every task wrote its result pickle; SLURM may still be tearing the job down.
    assert _wait_state(job_id, {"COMPLETED"}, timeout=60)["ExitCode"] == "0:0"
    for rank in range(devices):
        log = (job_dirs[0] / f"{job_id}_{rank}_log.out").read_text()
        assert "Job completed successfully" in log, detail
    rank0 = (job_dirs[0] / f"{job_id}_0_log.out").read_text()
    assert "finished 20 steps" in rank0, detail
    if devices > 1:
        err = "".join((job_dirs[0] / f"{job_id}_{r}_log.err").read_text() for r in range(devices))
        for rank in range(devices):
            assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{devices}" in err, detail

    # The Hydra job's output dir: CSV metrics and MoC checkpoints (persists at steps 5 and 15, and all of step 20
    # when fit ends).
    run_dir = sweep_dir / "0"
    rows = _read_metrics(run_dir)
    assert [float(r["val_loss"]) for r in rows if r.get("val_loss")], "validation loss is logged"
    manifest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    assert [r["step"] for r in manifest["records"]] == [5, 15, 20]
    for record in manifest["records"]:
        assert (run_dir / "checkpoints" / record["name"] / ".metadata").is_file()


def _persisted(manifest: Path) -> bool:
    """Whether the manifest lists a checkpoint (a run commits an empty one, its lineage, when it starts)."""
    try:
        return bool(manifest.exists() and Manifest.from_json(manifest.read_bytes()).records)
    except (OSError, ManifestError):
        return False


def test_requeued_job_resumes_from_the_moc_checkpoint(slurm_cluster: None, tmp_path: Path) -> None:
    """Requeue a running training job: SLURM kills and reruns it, and the rerun resumes instead of restarting."""
    sweep_dir = tmp_path / "sweep"
    run_dir = sweep_dir / "0"
    cmd = [
        sys.executable, "recipes/train.py", "-m", "hydra/launcher=slurm", "trainer.devices=1",
        "trainer.max_steps=150", "trainer.val_check_interval=100", "checkpoint.every_n_train_steps=10",
        f"checkpoint.shm_root={tmp_path / 'shm'}", f"hydra.sweep.dir={sweep_dir}",
        f"hydra.launcher.partition={PARTITION}", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=2",
        "hydra.launcher.mem_gb=4", "hydra.launcher.timeout_min=10",
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        manifest = run_dir / "checkpoints" / "manifest.json"
        deadline = time.monotonic() + 180
        while not _persisted(manifest) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.5)
        assert _persisted(manifest), f"no persist before the requeue:\n{_job_logs(sweep_dir)}"
        job_id = next(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())
        _run(["scontrol", "requeue", job_id])
        output, _ = launcher.communicate(timeout=300)
    except BaseException:
        launcher.kill()
        _cancel_sweep_jobs(sweep_dir)
        raise
    detail = f"{output[-3000:]}\n{_job_logs(sweep_dir)}"
    assert launcher.returncode == 0, detail
    assert _job_fields(job_id).get("Restarts") == "1", detail
    report = json.loads((run_dir / "moc_recovery" / "rank0.json").read_text())
    assert report["resume_step"] >= 10, detail
    assert "finished 150 steps" in (sweep_dir / ".submitit" / job_id / f"{job_id}_0_log.out").read_text(), detail
    print(f"\n[slurm] requeued job resumed at step {report['resume_step']}")
