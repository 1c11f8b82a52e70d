"""Scale report: the control plane at simulated world sizes, calibrated against real gloo runs (issue 30, item 1).

The logic is :mod:`moc_lightning.tools.scale_report`; this prints its markdown table and the targets, and writes JSON.

Usage: ``python recipes/scale_report.py out=FILE [worlds=64,512,4096,16384] [models=gpt350m16e,deepseekv3]
[ks=1,N] [calibrate=0|1] [item_cap=600000]``. JSON: ``rows`` (one per model x world x K, the fields the module
describes; a null field has a ``*_reason``, a null coordinator plan also ``*_estimate`` numbers), ``calibration``
(world, K, measured, simulated). Run it with the repository on the import path (``pip install -e .`` or
``PYTHONPATH=.``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from moc_lightning.tools.cli import parse_key_values
from moc_lightning.tools.scale_report import (
    ITEM_CAP,
    calibrate,
    calibration_markdown,
    markdown,
    report,
    verdicts,
    with_plan_threads,
)


def main(argv: Sequence[str]) -> None:
    args = parse_key_values(
        argv,
        {"out", "worlds", "models", "ks", "calibrate", "item_cap"},
        defaults={
            "worlds": "64,512,4096,16384",
            "models": "gpt350m16e,deepseekv3",
            "ks": "1,N",
            "calibrate": "1",
            "item_cap": str(ITEM_CAP),
        },
        required=["out"],
    )
    log = lambda line: print(line, file=sys.stderr, flush=True)
    rows = report(
        args["models"].split(","),
        [int(w) for w in args["worlds"].split(",")],
        args["ks"].split(","),
        int(args["item_cap"]),
        log,
    )
    log("[scale] where a real engine plans its persists ...")
    with_plan_threads(rows)
    calibration = calibrate(log=log) if args["calibrate"] == "1" else []
    print("# Scale report: the control plane at simulated world sizes (ZeRO-2 + EP, bf16 + fp32 master/moments)\n")
    print(markdown(rows))
    print("\n" + "\n".join(verdicts(rows)))
    if calibration:
        print("\n## Calibration: real gloo runs beside the simulation of the same sizes\n")
        print(calibration_markdown(calibration))
    Path(args["out"]).write_text(json.dumps({"rows": rows, "calibration": calibration}, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
