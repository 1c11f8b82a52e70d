"""Fault drills: 4 ranks (2 simulated nodes of 2) under torch's elastic agent with one restart, a SIGKILLed rank.

Every drill checks the recovery against what ``drill_worker.Capture`` recorded independently of MoC: each
restored tensor is bitwise the version captured at the step its source claims, and the reported PLT equals
eq. 7 computed by hand from the router counts of every step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.parts import PARTS, part_of
from moc_lightning.engine.units import parse_unit

ROOT = Path(__file__).resolve().parents[1]
EVERY, PERSIST_EVERY = 5, 2  # snapshots at 5, 10, 15, ...; persists at 5, 15, 25, ...

pytestmark = pytest.mark.slow
MODES = pytest.mark.parametrize("data_parallel", ["ddp", "zero2", "fsdp2"])
"""The drills the issue names run under DDP, ZeRO-2 (each unit then snapshotted and written whole by the rank keeping
its optimizer state; the capture holds each rank's own share of the optimizer state) and FSDP2 (every rank snapshots
and writes its own pieces of every unit; the capture holds them)."""
SHARDED_MODES = pytest.mark.parametrize("data_parallel", ["zero2", "fsdp2"])
"""Drills whose DDP case the chaos trials already run with the independent oracle (``tests/test_chaos.py``: seed 1
kills a rank inside a snapshot copy, seed 2 in training), so only the sharded modes run them here (issue 12 names
zero2 and fsdp2); ``recipes/fault_drill.py`` still runs them under DDP."""
WHOLE_UNIT_MODES = pytest.mark.parametrize("data_parallel", ["ddp", "zero2"])
"""Modes where a snapshot holds units whole, so a lost node leaves the other node's units in memory (under FSDP2 every
unit has a piece on every node: :func:`test_node_loss_under_fsdp2_takes_every_unit_from_storage`)."""


def launch_drill(
    out: Path, fault: str, max_steps: int = 30, data_parallel: str = "ddp", pec_scope: str = "both", mode: str = "pec",
    drain_persists: bool = False, ranks: int = 4, accelerator: str = "cpu",
) -> subprocess.CompletedProcess[str]:
    """Run the job (4 ranks unless ``ranks``) with the fault to its end; a hang fails the test after 400 s.
    ``drain_persists``: every persist lands before the next snapshot, none is skipped as still in flight (a drill that
    expects the step-15 persist needs it). ``accelerator="gpu"``: one GPU per rank, NCCL."""
    env = dict(os.environ, MOC_FAULT=fault, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "tests/drill_worker.py", "--out", str(out), "--max-steps", str(max_steps),
        "--every", str(EVERY), "--persist-every", str(PERSIST_EVERY), "--data-parallel", data_parallel,
        "--pec-scope", pec_scope, "--mode", mode, "--window", str(EVERY), *(["--drain-persists"] * drain_persists),
        "--ranks", str(ranks), "--accelerator", accelerator,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def run_drill(
    out: Path, fault: str, max_steps: int = 30, data_parallel: str = "ddp", pec_scope: str = "both",
    drain_persists: bool = False, ranks: int = 4, accelerator: str = "cpu",
) -> list[dict]:
    """Run the job with the fault (:func:`launch_drill`); return each rank's recovery report."""
    launch_drill(out, fault, max_steps, data_parallel, pec_scope, drain_persists=drain_persists, ranks=ranks,
                 accelerator=accelerator)
    return [json.loads((out / "run" / "moc_recovery" / f"rank{r}.json").read_text()) for r in range(ranks)]


def _capture(out: Path, rank: int, step: int) -> dict:
    return torch.load(out / "capture" / f"inc0_rank{rank}_step{step}.pt", weights_only=False)


def check_bitwise(out: Path, reports: list[dict]) -> None:
    """Every restored tensor equals the captured version of its source step on the same rank, and every unit
    (each part of it, when the report gives its parts: ``pec_scope``) has exactly the tensors it had then on
    that rank (no optimizer state lost, none made up)."""
    for rank, report in enumerate(reports):
        restored = torch.load(out / "capture" / f"restored_rank{rank}.pt", weights_only=False)
        assert restored["step"] == report["resume_step"]
        captures: dict[int, dict] = {}
        for unit, source in report["sources"].items():
            for part, step in _part_steps(source).items():
                if step == NEVER:
                    continue
                captured = captures.setdefault(step, _capture(out, rank, step)["tensors"])
                expected = {k: t for k, t in captured.items() if parse_unit(k).key == unit and part_of(k) in part}
                got = {k: t for k, t in restored["tensors"].items() if parse_unit(k).key == unit and part_of(k) in part}
                assert sorted(got) == sorted(expected), f"rank {rank}: {unit} holds other tensors than at step {step}"
                for key, tensor in got.items():
                    assert torch.equal(tensor, expected[key]), f"rank {rank}: {key} differs from its version at {step}"


def _part_steps(source: dict) -> dict[tuple[str, ...], int]:
    """The parts of a unit (as a tuple of part names) -> the step they were restored from."""
    if "parts" not in source:
        return {PARTS: source["step"]}
    return {(part, ): s["step"] for part, s in source["parts"].items()}


def plt_by_hand(out: Path, resume: int, source_step: dict[str, int]) -> float:
    """Eq. 7 from the captured router counts: lost tokens of each expert in (t_e, resume] / (T x top-k)."""
    capture = _capture(out, 0, resume)
    counts, assigned = capture["counts"], capture["assigned"]
    layers = len(counts[resume])
    per_layer = []
    for layer in range(layers):
        lost = 0
        for e in range(len(counts[resume][layer])):
            since = source_step[f"expert/L{layer}/E{e}"]
            lost += sum(counts[t][layer][e] for t in counts if since < t <= resume)
        per_layer.append(lost / sum(assigned[t][layer] for t in assigned if t <= resume))
    return sum(per_layer) / layers


def _steps(report: dict) -> dict[str, int]:
    return {unit: source["step"] for unit, source in report["sources"].items()}


@SHARDED_MODES
def test_crash_without_node_loss_recovers_everything_from_memory(tmp_path: Path, data_parallel: str) -> None:
    reports = run_drill(tmp_path, "rank=1,step=23,phase=train", data_parallel=data_parallel)
    for rank, report in enumerate(reports):
        assert report["resume_step"] == 20
        levels = {source["level"] for source in report["sources"].values()}
        assert levels <= {"memory_local", "memory_peer"}, f"rank {rank} used {levels}"
        assert _steps(report) == _steps(reports[0]), "every rank restores the same versions"
    assert any(s["level"] == "memory_local" for s in reports[1]["sources"].values())
    check_bitwise(tmp_path, reports)
    assert reports[1]["plt"] == pytest.approx(plt_by_hand(tmp_path, 20, _steps(reports[1])), rel=1e-9)


@pytest.mark.cuda
def test_a_killed_gpu_rank_resumes_bitwise_from_the_snapshots(tmp_path: Path) -> None:
    """The drill on GPUs (one rank per GPU, up to 2, NCCL, pinned slots, side-stream copies): the last rank is
    SIGKILLed at step 23, the restarted job takes every unit from the in-memory snapshots of step 20, and every
    restored tensor, moved host to device, is bitwise its captured version; PLT by hand."""
    ranks = min(2, torch.cuda.device_count())
    reports = run_drill(tmp_path, f"rank={ranks - 1},step=23,phase=train", ranks=ranks, accelerator="gpu")
    for rank, report in enumerate(reports):
        assert report["resume_step"] == 20
        assert {s["level"] for s in report["sources"].values()} <= {"memory_local", "memory_peer"}, f"rank {rank}"
    check_bitwise(tmp_path, reports)
    faulty = reports[ranks - 1]
    assert faulty["plt"] == pytest.approx(plt_by_hand(tmp_path, 20, _steps(faulty)), rel=1e-9)


@WHOLE_UNIT_MODES
def test_node_loss_takes_the_lost_nodes_units_from_storage(tmp_path: Path, data_parallel: str) -> None:
    reports = run_drill(
        tmp_path, "rank=2,step=23,phase=train,node_loss=1", data_parallel=data_parallel, drain_persists=True
    )
    report = reports[2]
    resume = report["resume_step"]
    assert resume == 15, "dense units of step 20 were partly on the lost node: back to the persisted step"
    levels = [s["level"] for s in report["sources"].values()]
    assert "storage" in levels and any(level.startswith("memory") for level in levels)
    owners = {s["rank"] for s in report["sources"].values() if s["level"].startswith("memory")}
    assert owners <= {0, 1}, f"memory sources must lie on the surviving node, got ranks {owners}"
    check_bitwise(tmp_path, reports)
    assert report["plt"] == pytest.approx(plt_by_hand(tmp_path, resume, _steps(report)), rel=1e-9)

    manifest = Manifest.from_json((tmp_path / "ckpt" / "manifest.json").read_bytes())
    storage_only = {}
    for unit in report["sources"]:
        record = manifest.newest(unit, at_or_before=resume)
        storage_only[unit] = record.step if record else NEVER
    storage_plt = plt_by_hand(tmp_path, resume, storage_only)
    print(f"node loss: two-level PLT {report['plt']:.4%} vs storage-only {storage_plt:.4%}")
    assert report["plt"] < storage_plt


def test_node_loss_takes_each_part_from_its_newest_surviving_copy(tmp_path: Path) -> None:
    """``checkpoint.pec_scope=optimizer``: every snapshot and persist holds every expert's weights, so an expert
    comes back with weights of a newer step than its optimizer state, each from its own newest surviving copy
    (memory on the surviving node, else storage), and loses the tokens since its stalest part. (``weights``
    takes the same path with the parts swapped; ``tests/test_pec_scope.py`` runs every scope in one process.)"""
    reports = run_drill(
        tmp_path, "rank=2,step=23,phase=train,node_loss=1", pec_scope="optimizer", drain_persists=True
    )
    report = reports[2]
    assert report["resume_step"] == 15
    check_bitwise(tmp_path, reports)
    assert report["plt"] == pytest.approx(plt_by_hand(tmp_path, 15, _steps(report)), rel=1e-9)
    assert report["plt"] > 0
    experts = {u: s for u, s in report["sources"].items() if u.startswith("expert/")}
    assert all(s["step"] == min(p["step"] for p in s["parts"].values()) for s in experts.values())
    mixed = [u for u, s in experts.items() if s["parts"]["optimizer"]["step"] < s["parts"]["weights"]["step"]]
    assert mixed, "some expert's non-PEC part is newer than its PEC part"
    levels = {p["level"] for s in experts.values() for p in s["parts"].values()}
    assert "storage" in levels and levels & {"memory_local", "memory_peer"}, levels


def test_node_loss_under_fsdp2_takes_every_unit_from_storage(tmp_path: Path) -> None:
    """FSDP2 shards every unit over both nodes (dense over all 4 ranks, each expert over its 2 replicas, one per node):
    when a node is lost, no unit is whole in memory any more, so every unit comes from storage whole (the persist of
    step 15), none half from the surviving node's slots; bitwise, with PLT by hand and equal to storage-only PLT."""
    reports = run_drill(
        tmp_path, "rank=2,step=23,phase=train,node_loss=1", data_parallel="fsdp2", drain_persists=True
    )
    for report in reports:
        assert report["resume_step"] == 15
        assert {s["level"] for s in report["sources"].values()} <= {"storage", "none"}
        assert _steps(report) == _steps(reports[0])
    check_bitwise(tmp_path, reports)
    assert reports[2]["plt"] == pytest.approx(plt_by_hand(tmp_path, 15, _steps(reports[2])), rel=1e-9)


@SHARDED_MODES
def test_crash_in_the_middle_of_a_snapshot_uses_the_previous_one(tmp_path: Path, data_parallel: str) -> None:
    reports = run_drill(tmp_path, "rank=1,step=20,phase=snapshot", data_parallel=data_parallel)
    assert {r["resume_step"] for r in reports} == {15}, "the torn slot of step 20 is never used"
    assert all(s["step"] <= 15 for r in reports for s in r["sources"].values())
    check_bitwise(tmp_path, reports)
    assert reports[1]["plt"] == pytest.approx(plt_by_hand(tmp_path, 15, _steps(reports[1])), rel=1e-9)


def test_a_torn_first_snapshot_takes_every_rank_down_the_same_path(tmp_path: Path) -> None:
    """Rank 1 dies copying the first snapshot (step 5): its units of step 5 exist nowhere, nothing is persisted.

    On 7dbc115 the ranks that had a slot restored and rank 1 started fresh: the job hung (the drill
    ``recipes/fault_drill.py scenario=crash_in_snapshot step=5``). Now all ranks decide together: no
    consistent state survives, so all start over from step 0, say so, and finish.
    """
    proc = launch_drill(tmp_path, "rank=1,step=5,phase=snapshot", max_steps=12)
    reports = list((tmp_path / "run" / "moc_recovery").glob("rank*.json"))
    assert reports == [], "no rank may claim a recovery: step 5 is incomplete in memory and absent in storage"
    assert "nothing to resume (no consistent state of this run survives" in proc.stdout + proc.stderr
    manifest = Manifest.from_json((tmp_path / "ckpt" / "manifest.json").read_bytes())
    assert manifest.latest is not None and manifest.latest.step == 12, "the restarted job ran to its end"
    assert [s.start_step for s in manifest.lineage.segments] == [0, 0], "one restart, from step 0"


@MODES
def test_crash_in_the_middle_of_a_persist_ignores_the_half_written_checkpoint(tmp_path: Path, data_parallel: str) -> None:
    reports = run_drill(tmp_path, "rank=0,step=15,phase=persist", data_parallel=data_parallel)
    for report in reports:
        stored = {s["step"] for s in report["sources"].values() if s["level"] == "storage"}
        assert 15 not in stored, "the uncommitted checkpoint of step 15 is never read"
    assert (tmp_path / "ckpt" / "step_000000015").exists(), "its bytes were written, but no manifest listed them"
    check_bitwise(tmp_path, reports)
    manifest = Manifest.from_json((tmp_path / "ckpt" / "manifest.json").read_bytes())
    assert [r.step for r in manifest.records] == [5, 25, 30], "the restarted run persisted again at 25 (30: its end)"


def _fault_drill_recipe():
    spec = importlib.util.spec_from_file_location("fault_drill", ROOT / "recipes/fault_drill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drill_report_has_plt_and_replay_iterations_in_either_mode() -> None:
    """``out`` holds the faulty rank's report with ``plt`` and ``replay_iterations`` (0 under PEC, which replays no
    window) beside the scenario, the mode, the data-parallel mode and every rank's report."""
    drill = _fault_drill_recipe()
    pec = {"resume_step": 20, "plt": 0.012, "sources": {"dense/embed": {"level": "memory_local", "step": 20}},
           "recover_seconds": 0.1}  # fmt: skip
    replayed = {"mode": "replay", "window_start": 16, "resume_step": 20, "replay_iterations": 3,
                "replay_seconds": 0.2, "plt": 0.0}  # fmt: skip
    for mode, report, iterations in (("pec", pec, 0), ("replay", replayed, 3)):
        result = drill.drill_result({0: report, 1: report}, "crash", 1, mode, "zero2")
        assert result["plt"] == report["plt"] and result["replay_iterations"] == iterations
        assert (result["scenario"], result["mode"], result["faulty_rank"]) == ("crash", mode, 1)
        assert result["data_parallel"] == "zero2"
        assert set(result["ranks"]) == {0, 1}
        line = drill.summary(result)
        assert f"replay_iterations={iterations}" in line and "plt=" in line and "under zero2" in line
    with pytest.raises(SystemExit, match="rank 2 wrote no recovery report"):
        drill.drill_result({0: pec}, "node_loss", 2, "pec", "ddp")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["scenario=crash_in_persist", "mode=replay"],
         "scenario=crash_in_persist with mode=replay: replay mode takes no snapshots or persists; choose crash or node_loss"),
        (["scenario=crash", "mode=sparse"], "mode='sparse' is not one of pec, replay"),
        (["scenario=crash", "data_parallel=fsdp"], "data_parallel='fsdp' is not one of ddp, zero2, fsdp2, hsdp"),
    ],
)  # fmt: skip
def test_the_drill_refuses_a_mode_it_cannot_run(tmp_path: Path, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        _fault_drill_recipe().parse([*args, f"out={tmp_path / 'drill.json'}"])
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("data_parallel", "overrides"),
    [
        ("ddp", {"trainer.data_parallel=ddp"}),
        ("zero2", {"trainer.data_parallel=zero2"}),
        ("fsdp2", {"trainer.data_parallel=fsdp2"}),
        ("hsdp", {"trainer.data_parallel=hsdp", "trainer.hsdp_shard_size=2"}),
    ],
)
def test_the_drill_trains_under_the_data_parallel_mode_it_is_given(
    tmp_path: Path, data_parallel: str, overrides: set[str]
) -> None:
    """``data_parallel=`` is the job's ``trainer.data_parallel`` (``ddp`` by default); under ``hsdp`` a shard group is
    a simulated node's ranks, so that the other node holds a replica of every piece."""
    drill = _fault_drill_recipe()
    args = drill.parse(["scenario=crash", "mode=replay", f"data_parallel={data_parallel}", f"out={tmp_path / 'd.json'}"])
    command = drill.command(args, tmp_path, steps=40)
    assert overrides <= set(command) and "checkpoint.mode=replay" in command
    assert sum(arg.startswith("trainer.data_parallel=") for arg in command) == 1
    default = drill.parse(["scenario=crash", f"out={tmp_path / 'd.json'}"])
    assert "trainer.data_parallel=ddp" in drill.command(default, tmp_path, steps=40)


@pytest.mark.parametrize(
    ("fault", "faulty", "data_parallel"),
    [("rank=2,step=23,phase=train,node_loss=1", 2, "ddp"), ("rank=2,step=23,phase=train,node_loss=1", 2, "fsdp2")],
    ids=["node_loss", "node_loss_fsdp2"],
)  # a crash without node loss is replayed bitwise, to max_steps, by tests/test_replay_ddp.py at less cost; so are the
# crash and node loss under zero2 in this drill (33 s each on a loaded machine; the fsdp2 case 51-60 s), left out for time
def test_replay_drill_resumes_every_rank_bitwise_at_the_window_end_with_no_lost_tokens(
    tmp_path: Path, fault: str, faulty: int, data_parallel: str
) -> None:
    """``checkpoint.mode=replay`` (window 5, so windows end on the capture steps 5, 10, ...): a crash, or a lost node
    with its shared memory, at step 23 resumes every rank at 20, the newest complete window's end, replays its 4 later
    iterations, and every rank's state is then bitwise what it was at step 20 before the fault; PLT 0. Under FSDP2 a
    rank's state is its pieces of every unit, the lost node's ranks reading theirs from storage."""
    launch_drill(tmp_path, fault, data_parallel=data_parallel, mode="replay")
    reports = [json.loads((tmp_path / "run" / "moc_recovery" / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, report in enumerate(reports):
        assert report["mode"] == "replay" and report["plt"] == 0.0
        assert (report["window_start"], report["resume_step"], report["replay_iterations"]) == (15, 20, EVERY - 1)
        restored = torch.load(tmp_path / "capture" / f"restored_rank{rank}.pt", weights_only=False)
        captured = _capture(tmp_path, rank, 20)["tensors"]
        assert restored["step"] == 20 and sorted(restored["tensors"]) == sorted(captured)
        differ = [k for k, t in captured.items() if not torch.equal(restored["tensors"][k], t)]
        assert differ == [], f"rank {rank} (faulty: {faulty}) after the replay: {differ[:5]}"


def test_node_loss_under_hsdp_takes_every_piece_from_the_other_nodes_replicas(tmp_path: Path) -> None:
    """HSDP with a shard group per node: the surviving node holds a replica of every piece, so losing a node loses
    nothing in memory. Every unit comes from the snapshot of step 20, the lost node's ranks receiving their pieces
    from their replicas on the surviving node (memory_peer from rank r - 2; the dense units, which every rank holds,
    show it); bitwise, with PLT by hand."""
    reports = run_drill(tmp_path, "rank=2,step=23,phase=train,node_loss=1", data_parallel="hsdp")
    for rank, report in enumerate(reports):
        assert report["resume_step"] == 20
        assert {s["level"] for s in report["sources"].values()} <= {"memory_local", "memory_peer"}
        dense = {(s["level"], s["rank"]) for u, s in report["sources"].items() if u.startswith("dense/")}
        assert dense == ({("memory_local", None)} if rank < 2 else {("memory_peer", rank - 2)})
        assert _steps(report) == _steps(reports[0])
    check_bitwise(tmp_path, reports)
    assert reports[2]["plt"] == pytest.approx(plt_by_hand(tmp_path, 20, _steps(reports[2])), rel=1e-9)
