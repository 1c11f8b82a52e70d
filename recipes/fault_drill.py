"""Fault drill: train the tiny GPT-MoE on 4 ranks (2 simulated nodes of 2) under ``torchrun --max-restarts=1``,
kill a rank with SIGKILL, and report how the restarted job recovered.

    python recipes/fault_drill.py scenario=crash out=drill.json
    python recipes/fault_drill.py scenario=node_loss out=drill.json steps=60 step=33
    python recipes/fault_drill.py scenario=crash mode=replay out=drill.json
    python recipes/fault_drill.py scenario=node_loss mode=replay data_parallel=fsdp2 out=drill.json

Scenarios: ``crash`` (rank 1 dies between snapshots), ``node_loss`` (rank 2 dies and its node's shared
memory is gone when the job comes back), ``crash_in_snapshot`` (rank 1 dies halfway through a snapshot
copy), ``crash_in_persist`` (rank 0 dies after a persist wrote its bytes, before the manifest commit).
``mode`` is ``checkpoint.mode``: ``pec`` (default) or ``replay`` (windows of ``REPLAY_WINDOW`` iterations; only
``crash`` and ``node_loss``, since replay mode takes no snapshots or persists to die in). ``data_parallel`` is
``trainer.data_parallel``: ``ddp`` (default), ``zero2``, ``fsdp2`` or ``hsdp`` (sharded within a node's ranks and
replicated across the nodes).
``out`` gets the faulty rank's recovery report, with ``plt`` and ``replay_iterations`` in either mode (0 under
``pec``: it replays no window): under ``pec`` ``resume_step``, ``sources`` (per unit: ``level`` in
memory_local/memory_peer/storage/none and ``step``), ``recover_seconds``; under ``replay`` ``window_start``,
``resume_step``, ``replay_seconds``; plus ``scenario``, ``mode``, ``data_parallel``, ``faulty_rank`` and every rank's
report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moc_lightning.config import MODES
from moc_lightning.models.causal_lm import DATA_PARALLEL
from moc_lightning.tools.cli import parse_key_values

ROOT = Path(__file__).resolve().parents[1]
EVERY = 5
RANKS = 4
RANKS_PER_NODE = 2
REPLAY_WINDOW = 4
"""``checkpoint.replay.window`` of a replay drill: windows end at steps 4, 8, ..., so a fault at 23 replays 20's."""
SCENARIOS = {
    # name: (faulty rank, phase, node loss, fault step relative to a snapshot step)
    "crash": (1, "train", False, 3),
    "node_loss": (2, "train", True, 3),
    "crash_in_snapshot": (1, "snapshot", False, 0),
    "crash_in_persist": (0, "persist", False, 0),
}


def parse(argv: list[str]) -> dict[str, str]:
    args = parse_key_values(
        argv, {"scenario", "out", "steps", "step", "mode", "data_parallel"},
        defaults={"mode": "pec", "data_parallel": "ddp"}, required=["scenario", "out"],
    )
    if args["scenario"] not in SCENARIOS:
        raise SystemExit(f"scenario={args['scenario']!r} is not one of {', '.join(SCENARIOS)}")
    if args["mode"] not in MODES:
        raise SystemExit(f"mode={args['mode']!r} is not one of {', '.join(MODES)}")
    if args["data_parallel"] not in DATA_PARALLEL:
        raise SystemExit(f"data_parallel={args['data_parallel']!r} is not one of {', '.join(DATA_PARALLEL)}")
    if args["mode"] == "replay" and SCENARIOS[args["scenario"]][1] != "train":
        raise SystemExit(f"scenario={args['scenario']} with mode=replay: replay mode takes no snapshots or persists; "
                         "choose crash or node_loss")
    return args


def drill_result(
    reports: dict[int, dict[str, Any]], scenario: str, rank: int, mode: str, data_parallel: str
) -> dict[str, Any]:
    """What ``out`` holds: the faulty rank's report with ``replay_iterations`` (0 under PEC), and every rank's."""
    if rank not in reports:
        raise SystemExit(f"rank {rank} wrote no recovery report: the restarted job resumed nothing (see its output)")
    report = reports[rank]
    return {
        **report, "replay_iterations": report.get("replay_iterations", 0),
        "scenario": scenario, "mode": mode, "data_parallel": data_parallel, "faulty_rank": rank, "ranks": reports,
    }  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    """One line: where the job resumed, PLT, replayed iterations, and the mode's own figures."""
    line = (f"[fault_drill] {result['mode']} under {result['data_parallel']}: resume_step={result['resume_step']} "
            f"plt={result['plt']:.4%} replay_iterations={result['replay_iterations']}")
    if result["mode"] == "replay":
        return f"{line} window_start={result['window_start']} replay_seconds={result['replay_seconds']:.3f}"
    levels: dict[str, int] = {}
    for source in result["sources"].values():
        levels[source["level"]] = levels.get(source["level"], 0) + 1
    return f"{line} recover_seconds={result['recover_seconds']:.3f} sources={levels}"


def command(args: dict[str, str], work: Path, steps: int) -> list[str]:
    """The job: ``torchrun`` of ``recipes/train.py`` on :data:`RANKS` ranks, one restart, its files under ``work``."""
    data_parallel = args["data_parallel"]
    hsdp = [f"trainer.hsdp_shard_size={RANKS_PER_NODE}"] if data_parallel == "hsdp" else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", "--max-restarts=1",
        str(ROOT / "recipes" / "train.py"), f"trainer.devices={RANKS}", "trainer.ep=2", f"trainer.max_steps={steps}",
        f"trainer.data_parallel={data_parallel}", *hsdp,
        "trainer.val_check_interval=1000", "model.block_size=32", "data.batch_size=4",
        f"checkpoint.mode={args['mode']}", f"checkpoint.replay.window={REPLAY_WINDOW}",
        f"checkpoint.every_n_train_steps={EVERY}", "checkpoint.persist_every_n_snapshots=2",
        "checkpoint.k_snapshot=4", "checkpoint.k_persist=1", f"checkpoint.ranks_per_node={RANKS_PER_NODE}",
        f"checkpoint.storage.url={(work / 'ckpt').as_uri()}", f"checkpoint.shm_root={work / 'shm'}",
        f"hydra.run.dir={work / 'run'}",
    ]  # fmt: skip


def main(argv: list[str]) -> None:
    args = parse(argv)
    rank, phase, node_loss, offset = SCENARIOS[args["scenario"]]
    steps = int(args.get("steps", 40))
    # persists happen every 2nd snapshot starting with the first: steps 5, 15, 25, ...
    default_step = 15 if phase == "persist" else 20 + offset
    step = int(args.get("step", default_step))
    work = Path(tempfile.mkdtemp(prefix="moc_drill_"))
    fault = f"rank={rank},step={step},phase={phase},node_loss={int(node_loss)}"
    env = dict(os.environ, MOC_FAULT=fault, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    print(f"[fault_drill] {args['scenario']} ({args['mode']}, {args['data_parallel']}): MOC_FAULT={fault}; "
          f"work dir {work}")
    subprocess.run(command(args, work, steps), cwd=ROOT, env=env, check=True)
    reports = {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in (work / "run" / "moc_recovery").glob("rank*.json")
    }
    result = drill_result(reports, args["scenario"], rank, args["mode"], args["data_parallel"])
    Path(args["out"]).write_text(json.dumps(result, indent=1))
    print(f"{summary(result)} -> {args['out']}")


if __name__ == "__main__":
    main(sys.argv[1:])
