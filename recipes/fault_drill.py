"""Fault drill: train the tiny GPT-MoE on 4 ranks (2 simulated nodes of 2) under ``torchrun --max-restarts=1``,
kill a rank with SIGKILL, and report how the restarted job recovered.

    python recipes/fault_drill.py scenario=crash out=drill.json
    python recipes/fault_drill.py scenario=node_loss out=drill.json steps=60 step=33

Scenarios: ``crash`` (rank 1 dies between snapshots), ``node_loss`` (rank 2 dies and its node's shared
memory is gone when the job comes back), ``crash_in_snapshot`` (rank 1 dies halfway through a snapshot
copy), ``crash_in_persist`` (rank 0 dies after a persist wrote its bytes, before the manifest commit).
``out`` gets the faulty rank's recovery report: ``resume_step``, ``plt``, ``sources`` (per unit: ``level``
in memory_local/memory_peer/storage/none and ``step``), ``recover_seconds``, plus every rank's report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moc_lightning.cli import parse_key_values

ROOT = Path(__file__).resolve().parents[1]
EVERY = 5
SCENARIOS = {
    # name: (faulty rank, phase, node loss, fault step relative to a snapshot step)
    "crash": (1, "train", False, 3),
    "node_loss": (2, "train", True, 3),
    "crash_in_snapshot": (1, "snapshot", False, 0),
    "crash_in_persist": (0, "persist", False, 0),
}


def parse(argv: list[str]) -> dict[str, str]:
    args = parse_key_values(argv, {"scenario", "out", "steps", "step"}, required=["scenario", "out"])
    if args["scenario"] not in SCENARIOS:
        raise SystemExit(f"scenario={args['scenario']!r} is not one of {', '.join(SCENARIOS)}")
    return args


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
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--max-restarts=1",
        str(ROOT / "recipes" / "train.py"), "trainer.devices=4", "trainer.ep=2", f"trainer.max_steps={steps}",
        "trainer.val_check_interval=1000", "model.block_size=32", "data.batch_size=4",
        f"checkpoint.every_n_train_steps={EVERY}", "checkpoint.persist_every_n_snapshots=2",
        "checkpoint.k_snapshot=4", "checkpoint.k_persist=1", "checkpoint.ranks_per_node=2",
        f"checkpoint.storage.url={(work / 'ckpt').as_uri()}", f"checkpoint.shm_root={work / 'shm'}",
        f"hydra.run.dir={work / 'run'}",
    ]  # fmt: skip
    print(f"[fault_drill] {args['scenario']}: MOC_FAULT={fault}; work dir {work}")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    reports = {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in (work / "run" / "moc_recovery").glob("rank*.json")
    }
    result = {**reports[rank], "scenario": args["scenario"], "faulty_rank": rank, "ranks": reports}
    Path(args["out"]).write_text(json.dumps(result, indent=1))
    levels: dict[str, int] = {}
    for source in reports[rank]["sources"].values():
        levels[source["level"]] = levels.get(source["level"], 0) + 1
    print(
        f"[fault_drill] resume_step={result['resume_step']} plt={result['plt']:.4%} "
        f"recover_seconds={result['recover_seconds']:.3f} sources={levels} -> {args['out']}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
