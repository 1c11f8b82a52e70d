"""Randomized fault trials with an independent oracle (issue 11): SIGKILLs at random points, node losses,
damaged stored files; after every recovery the restored state, the data order and completion are checked.

    python recipes/chaos.py trials=20 out=chaos.json [seed=0] [work=/tmp/moc_chaos] [max_steps=24] [keep=0]
                            [data_parallel=ddp|zero2|fsdp2] [pec_scope=both|optimizer|weights]
    python recipes/chaos.py seeds=111,118 out=chaos.json      # rerun chosen trials

Trial ``i`` draws its faults from seed ``seed + i``; ``seeds`` runs exactly those (a failing trial's seed
reproduces its faults). ``keep=1`` keeps each trial's directory (storage, logs, oracle records) under ``work``.
``out`` gets the pass/fail counts per check and per fault kind and every failing trial's seed, faults and
details; the summary table is printed. Exits 1 when a trial failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moc_lightning.chaos.harness import TrialConfig, reference_records, run_trial, summary_table, tally
from moc_lightning.cli import parse_key_values


def main(argv: list[str]) -> int:
    args = parse_key_values(
        argv, {"trials", "seeds", "out", "seed", "work", "max_steps", "keep", "data_parallel", "pec_scope"},
        defaults={"seed": "0", "work": "/tmp/moc_chaos", "max_steps": "24", "keep": "0", "data_parallel": "ddp",
                  "pec_scope": "both"},
        required=["out"],
    )  # fmt: skip
    if "seeds" in args:
        seeds = [int(s) for s in args["seeds"].split(",") if s]
    elif "trials" in args:
        seeds = [int(args["seed"]) + i for i in range(int(args["trials"]))]
    else:
        raise SystemExit("give trials=N (seeds seed, seed+1, ...) or seeds=a,b,...")
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)  # before the first trial: a bad out= fails now, not after it
    cfg = TrialConfig(
        max_steps=int(args["max_steps"]), data_parallel=args["data_parallel"], pec_scope=args["pec_scope"]
    )
    root = Path(args["work"])
    root.mkdir(parents=True, exist_ok=True)
    reference = reference_records(root, cfg)
    results = []
    for seed in seeds:
        result = run_trial(seed, root, cfg, reference, keep=args["keep"] == "1")
        results.append(result)
        failed = [check for check, details in result.failures.items() if details]
        print(f"[chaos] trial seed={seed} faults={[f['label'] for f in result.faults]} "
              f"incarnations={len(result.outcomes)} {result.seconds:.0f}s: "
              f"{'PASS' if result.passed else 'FAIL ' + ','.join(failed)}", flush=True)
        summary = tally(results)
        out.write_text(json.dumps(summary, indent=1))
    print(summary_table(summary))
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
