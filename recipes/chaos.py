"""Randomized fault trials with an independent oracle (issue 11): SIGKILLs at random points, node losses,
damaged stored files; after every recovery the restored state, the data order and completion are checked.

    python recipes/chaos.py trials=20 out=chaos.json [seed=0] [work=/tmp/moc_chaos] [max_steps=24] [keep=0]
                            [data_parallel=ddp|zero2|fsdp2] [pec_scope=both|optimizer|weights]
    python recipes/chaos.py mode=replay trials=8 out=chaos.json [window=4] [persist_windows=2] [max_steps=16]
    python recipes/chaos.py seeds=111,118 out=chaos.json      # rerun chosen trials
    python recipes/chaos.py storage=s3 trials=6 out=chaos_s3.json   # checkpoints in a bucket, network faults too

``mode=pec`` (the default) runs ``checkpoint.mode=pec`` and checks each recovery against the steps its report names,
and (``ddp``, ``zero2``) the consolidated final checkpoint against the state the last incarnation ended with.
``mode=replay`` runs ``checkpoint.mode=replay`` (windows of ``window`` iterations, every ``persist_windows``-th
stored; ``max_steps`` defaults to 16, a multiple of W: the last window ends at the last step) and holds every trial
to the fault-free run of the same options, bitwise: every step, the state after each resume, the consolidated final
checkpoint. Kills land inside window captures, hand-overs, seals, storage writes, the final persist, and the next
incarnation's restore and replay (``moc_lightning.tools.chaos.harness``).

``storage=s3`` (PEC trials) keeps each trial's checkpoints in a fresh bucket of a local S3-protocol server (moto, the
``dev`` extra) reached through a fault proxy, and draws a network fault per trial beside the others: ``503
SlowDown``/``500`` answers, slow answers, connections reset mid-upload or mid-read (retried within the trials'
``checkpoint.storage.retries``), or an outage of one control object's writes that fails a persist
(``moc_lightning.tools.chaos.s3_trials``); damage is done to the bucket's objects. A network fault that never fired
leaves its trial unfired. ``max_steps`` defaults to 48 there (:data:`S3_MAX_STEPS`).

Trial ``i`` draws its faults from seed ``seed + i``; ``seeds`` runs exactly those (a failing trial's seed
reproduces its faults). ``keep=1`` keeps each trial's directory (storage, logs, oracle records) under ``work``.
``out`` gets the pass/fail counts per check and per fault kind and every failing trial's seed, faults and
details, and the kill points reached per phase; the summary table is printed. A trial whose drawn kill never fired is
no pass (``UNFIRED``). Exits 1 unless every trial passed.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

from moc_lightning.tools.chaos.harness import TrialConfig, reference_records, run_trial, summary_table, tally
from moc_lightning.tools.cli import parse_key_values

DEFAULT_MAX_STEPS = {"pec": 24, "replay": 16}
"""``max_steps`` by mode when not given: replay's 16 is a multiple of the default W=4, the edge case of a last window
that ends at the last step (a resume there has nothing left to train); ``max_steps=18`` tests the other case."""


S3_MAX_STEPS = 48
"""``max_steps`` of ``storage=s3`` trials when not given: a persist over the local S3 server (a thousand requests)
outlasts most of a 24-step run, so kills in persists landed after training had ended and the next incarnation's kill
never fired (3 of 6 trials at 24 steps, none of 4 at 48)."""


def _integer(args: dict[str, str], key: str) -> int:
    """``args[key]`` as an integer; a ``ValueError`` naming the option otherwise."""
    try:
        return int(args[key])
    except ValueError:
        raise ValueError(f"{key}={args[key]!r} is not allowed; give an integer") from None


def main(argv: list[str]) -> int:
    args = parse_key_values(
        argv, {"trials", "seeds", "out", "seed", "work", "max_steps", "keep", "data_parallel", "pec_scope", "mode",
               "window", "persist_windows", "storage"},
        defaults={"seed": "0", "work": "/tmp/moc_chaos", "keep": "0", "data_parallel": "ddp", "pec_scope": "both",
                  "mode": "pec", "window": "4", "persist_windows": "2", "storage": "local"},
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
    by_mode = DEFAULT_MAX_STEPS.get(args["mode"], DEFAULT_MAX_STEPS["pec"])
    args.setdefault("max_steps", str(S3_MAX_STEPS if args["storage"] == "s3" else by_mode))
    try:
        cfg = TrialConfig(
            max_steps=_integer(args, "max_steps"), data_parallel=args["data_parallel"], pec_scope=args["pec_scope"],
            mode=args["mode"], window=_integer(args, "window"), persist_windows=_integer(args, "persist_windows"),
            storage=args["storage"],
        )
    except ValueError as err:  # names the option and the choices
        raise SystemExit(f"chaos: {err}") from None
    root = Path(args["work"])
    root.mkdir(parents=True, exist_ok=True)
    reference = reference_records(root, cfg)
    results = []
    with ExitStack() as stack:
        bucket = None
        if cfg.storage == "s3":
            from moc_lightning.tools.chaos.s3_trials import bucket_store  # boto3 and moto: the dev extra

            bucket = stack.enter_context(bucket_store())
        for seed in seeds:
            result = run_trial(seed, root, cfg, reference, keep=args["keep"] == "1", bucket=bucket)
            results.append(result)
            print(f"[chaos] trial seed={seed} faults={[f['label'] for f in result.faults]} "
                  f"incarnations={len(result.outcomes)} {result.seconds:.0f}s: {result.verdict}", flush=True)
            summary = tally(results)
            out.write_text(json.dumps(summary, indent=1))
    print(summary_table(summary))
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
