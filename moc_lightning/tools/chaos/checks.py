"""Pure checks over the oracle's records (:mod:`.oracle`): what a user needs from every recovery.

- ``restore``: after every resume, every restored tensor equals, bitwise, the oracle's digest of it at the
  step its unit reports as its source, and nothing else is there; the learning rate is that of the resume
  step; a fresh start begins from the initial state;
- ``restore_never_saved``: the same for the units reported as never saved (step ``-1``): they are the
  initial state, with no optimizer state (kept apart because one bug there would hide every other);
- ``data``: every step of every incarnation trains on exactly the samples an uninterrupted run trains on at
  that step (no sample replayed or skipped after a resume);
- ``completes``: the final incarnation ends cleanly with every rank at ``max_steps``;
- ``no_hang``: no incarnation ran into the harness's timeout or a collective's timeout.

Replay mode (``checkpoint.mode=replay``) promises more: no state is lost, so its trials are held to the fault-free run
of the same options (with MoC, its oracle), bitwise, instead of ``restore``/``restore_never_saved``:

- ``steps``: the state after every step any incarnation took is the fault-free run's after that step, on that rank;
- ``resume_state``: every fit's first new step begins from the fault-free state at its step (after a resume, once the
  replay has run), and MoC's replay report names that step with PLT 0;
- ``final_state``: the final checkpoint, consolidated, is the fault-free state after ``max_steps``.

A unit's state has two parts, its weights (parameters, buffers) and its optimizer state; under
``checkpoint.pec_scope`` other than ``both`` the report gives an expert's ``parts`` their own sources, and each
part's tensors are checked against the digests of its own step (the learning rates go with the weights).

Units are derived from tensor names here, not by MoC's layout: an expert is ``...experts.<global id>...``
under a MoE layer whose ordinal is its rank among the MoE layers' prefixes; any other parameter belongs to
the module one level below the MoE layer (its router) or below the first integer-indexed module (a
block's attention, FFN, norms), and otherwise to its own module (embeddings, final norm).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

NEVER = -1
TRAINER_UNIT = "trainer"
"""Pseudo-unit of the learning rates: restored from the resume step."""
MAX_DETAILS = 40
PARTS = ("weights", "optimizer")

_EXPERT = re.compile(r"^(?P<layer>.+?)\.experts\.(?P<expert>\d+)\.")
_UNDER_INDEX = re.compile(r"^(?P<module>.*?\.\d+\.[^.]+)\.")

Records = Mapping[int, Sequence[Mapping[str, Any]]]
"""rank -> that rank's records in file order."""


def part_of(key: str) -> str:
    """The part of its unit a digest key belongs to: ``optimizer`` for ``optim/...``, else ``weights``."""
    return "optimizer" if key.startswith("optim/") else "weights"


def claimed_steps(sources: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    """``(unit, part)`` -> the step a recovery report says that part was restored from: the part's own entry
    when the unit has ``parts``, else the unit's step for both parts (``pec_scope=both``: whole units)."""
    return {
        (unit, part): int(source["parts"][part]["step"] if "parts" in source else source["step"])
        for unit, source in sources.items()
        for part in PARTS
    }


def tensor_name(key: str) -> str | None:
    """The module-tree name in a digest key (``param/<fqn>``, ``optim/<fqn>/<state>``); ``None`` for lr keys."""
    kind, _, rest = key.partition("/")
    if kind in ("param", "buffer"):
        return rest
    if kind == "optim":
        return rest.rsplit("/", 1)[0]
    return None


def moe_prefixes(keys: Iterable[str]) -> list[str]:
    """The MoE layers' module prefixes, in ordinal order (natural order of their names)."""
    found = {m["layer"] for key in keys if (name := tensor_name(key)) and (m := _EXPERT.match(name))}
    return sorted(found, key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)])


def unit_of(key: str, prefixes: Sequence[str]) -> str:
    """The MoC unit key owning digest key ``key``, derived from its name alone."""
    name = tensor_name(key)
    if name is None:
        return TRAINER_UNIT
    if m := _EXPERT.match(name):
        return f"expert/L{prefixes.index(m['layer'])}/E{int(m['expert'])}"
    for prefix in prefixes:
        if name.startswith(prefix + "."):
            below = name[len(prefix) + 1 :].split(".")[0]
            return f"dense/{prefix}.{below}"
    if m := _UNDER_INDEX.match(name):
        return f"dense/{m['module']}"
    return "dense/" + (name.rsplit(".", 1)[0] if "." in name else name)


def _expected_state(records: Sequence[Mapping[str, Any]], inc: int, step: int) -> Mapping[str, str] | None:
    """The oracle's digests of the state at ``step`` in the timeline incarnation ``inc`` resumed from: the
    newest earlier incarnation that reached it (``step`` -1: the newest earlier fresh start's initial state)."""
    if step == NEVER:
        starts = [r for r in records if r["kind"] == "start" and r["step"] == 0 and r["inc"] < inc]
        return starts[-1]["digests"] if starts else None
    steps = [r for r in records if r["kind"] == "step" and r["step"] == step and r["inc"] < inc]
    return steps[-1]["digests"] if steps else None


def check_restore(records: Records, never_saved: bool = False) -> list[str]:
    """Every resume restored exactly the state its report claims; every fresh start the initial state.

    ``never_saved``: check only the units reported as never saved; otherwise every other unit."""
    failures: list[str] = []
    for rank, recs in sorted(records.items()):
        initial = next((r["digests"] for r in recs if r["kind"] == "start" and r["step"] == 0), None)
        for start in (r for r in recs if r["kind"] == "start"):
            where = f"rank {rank} incarnation {start['inc']}"
            if start["step"] == 0:
                if not never_saved and initial is not None and start["digests"] != initial:
                    bad = sorted(k for k in set(initial) | set(start["digests"])
                                 if initial.get(k) != start["digests"].get(k))
                    failures.append(f"{where}: a fresh start differs from the initial state in {bad[:3]}")
                continue
            failures += _check_resume(recs, start, where, never_saved)
    return failures


def _check_resume(
    recs: Sequence[Mapping[str, Any]], start: Mapping[str, Any], where: str, never_saved: bool
) -> list[str]:
    report = start.get("report")
    if never_saved and report is None:
        return []
    if report is None:
        return [f"{where}: resumed at step {start['step']} without a recovery report"]
    if report["resume_step"] != start["step"]:
        return [f"{where}: trains from step {start['step']} but the report says {report['resume_step']}"]
    restored: Mapping[str, str] = start["digests"]
    prefixes = moe_prefixes(restored)
    listed = report["sources"]
    claims = claimed_steps(listed) | {(TRAINER_UNIT, part): start["step"] for part in PARTS}
    claims = {claim: step for claim, step in claims.items() if (step == NEVER) == never_saved}
    failures = []
    late = {(_name(claim, listed), step) for claim, step in claims.items() if step > start["step"]}
    for name, step in sorted(late):
        failures.append(f"{where}: {name} reports source step {step}, after the resume step {start['step']}")
    expected_by_step: dict[int, Mapping[str, str] | None] = {}
    keys = set(restored)
    for step in set(claims.values()):
        expected = expected_by_step[step] = _expected_state(recs, start["inc"], step)
        if expected is not None:
            keys |= {k for k in expected if claims.get((unit_of(k, prefixes), part_of(k))) == step}
    wrong: dict[str, list[str]] = {}  # by source: a unit's, or each part's where the report gives parts
    for key in sorted(keys):
        unit = unit_of(key, prefixes)
        if unit not in listed and unit != TRAINER_UNIT:
            if not never_saved:
                failures.append(f"{where}: {key} belongs to {unit}, which the recovery report does not list")
            continue
        claim = (unit, part_of(key))
        if claim not in claims:
            continue
        step = claims[claim]
        expected = expected_by_step[step]
        if expected is None:
            failures.append(f"{where}: {key} claims source step {step}, which no earlier incarnation reached")
        elif expected.get(key) != restored.get(key):
            have = "missing" if key not in restored else "differs"
            want = "absent" if key not in expected else "present"
            source = f"{_name(claim, listed)} (source step {step}, level {_level(claim, listed)})"
            wrong.setdefault(source, []).append(f"{key} {have} (at step {step} it was {want})")
    for source, keys_wrong in wrong.items():
        more = f" and {len(keys_wrong) - 1} more of its tensors" if len(keys_wrong) > 1 else ""
        failures.append(f"{where}: {source}: {keys_wrong[0]}{more}")
    return failures


def _name(claim: tuple[str, str], listed: Mapping[str, Mapping[str, Any]]) -> str:
    """The unit, and the part when the report gives the unit's parts their own sources."""
    unit, part = claim
    return f"{unit} {part}" if "parts" in listed.get(unit, {}) else unit


def _level(claim: tuple[str, str], listed: Mapping[str, Mapping[str, Any]]) -> str:
    """Where the report says the part was restored from (``n/a``: the trainer's learning rates)."""
    unit, part = claim
    source = listed.get(unit, {})
    return source.get("parts", {}).get(part, source).get("level", "n/a")


def _unlike_reference(
    records: Records,
    expected: Callable[[int], Mapping[int, Any]],
    kind: str,
    field: str,
    describe: Callable[[Mapping[str, Any], Mapping[int, Any]], str],
) -> list[str]:
    """The records of ``kind`` whose ``field`` differs from what the reference run had at their step, on their rank:
    ``expected(rank)`` maps a step to it, ``describe(record, that map)`` says how a record
    differs. One detail per rank and incarnation: its first wrong record, and how many were wrong."""
    failures = []
    for rank, recs in sorted(records.items()):
        ref = expected(rank)
        wrong: dict[int, list[str]] = {}
        for r in recs:
            if r["kind"] != kind or ref.get(r["step"]) == r[field]:
                continue
            text = describe(r, ref) if r["step"] in ref else f"step {r['step']} is beyond the reference run"
            wrong.setdefault(r["inc"], []).append(text)
        for inc, texts in sorted(wrong.items()):
            more = f" (and {len(texts) - 1} more {'steps' if kind == 'step' else 'resumes'})" if len(texts) > 1 else ""
            failures.append(f"rank {rank} incarnation {inc}: {texts[0]}{more}")
    return failures


def check_data(records: Records, reference: Records) -> list[str]:
    """Every recorded step trained on the samples of the uninterrupted run's same step, on the same rank."""

    def samples(rank: int) -> dict[int, list[str]]:
        return {r["step"]: r["samples"] for r in reference.get(rank, ()) if r["kind"] == "step"}

    def describe(record: Mapping[str, Any], ref: Mapping[int, list[str]]) -> str:
        other = next((step for step, seen in ref.items() if seen == record["samples"]), None)
        seen = f"the samples of step {other} (a replay or skip)" if other is not None else "other samples"
        return f"step {record['step']} trained on {seen}"

    return _unlike_reference(records, samples, "step", "samples", describe)


def reference_states(reference: Records, rank: int) -> dict[int, Mapping[str, str]]:
    """Step -> the digests of the fault-free run's state on ``rank`` after that step; step 0: the state its first step
    began from (its first ``restored`` record, :class:`~moc_lightning.tools.chaos.oracle.AfterRestore`)."""
    recs = reference.get(rank, ())
    states = {r["step"]: r["digests"] for r in recs if r["kind"] == "step"}
    initial = next((r["digests"] for r in recs if r["kind"] == "restored" and r["step"] == 0), None)
    return states if initial is None else {0: initial, **states}


def _differing(record: Mapping[str, Any], ref: Mapping[int, Mapping[str, str]]) -> str:
    """How a record's digests differ from the fault-free ones of its step: how many tensors, and the first few."""
    want, have = ref[record["step"]], record["digests"]
    bad = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    return f"step {record['step']}: {len(bad)} tensors differ from the fault-free run's, e.g. {bad[:3]}"


def check_steps(records: Records, reference: Records) -> list[str]:
    """Replay mode: the state after every step any incarnation took equals, bitwise, the fault-free run's state after
    the same step on the same rank (every parameter, buffer, optimizer state tensor and learning rate)."""
    return _unlike_reference(records, lambda rank: reference_states(reference, rank), "step", "digests", _differing)


def check_resume_state(records: Records, reference: Records) -> list[str]:
    """Replay mode: every fit's first new step (after a resume: after its replay) begins from, bitwise, the fault-free
    run's state at that step; where MoC reported a resume, its report names that step and lost no token."""
    failures = _unlike_reference(
        records, lambda rank: reference_states(reference, rank), "restored", "digests",
        lambda record, ref: "restored " + _differing(record, ref),
    )
    for rank, recs in sorted(records.items()):
        for r in recs:
            report = r.get("report") if r["kind"] == "restored" else None
            if report is not None and (report.get("resume_step") != r["step"] or report.get("plt") != 0):
                failures.append(f"rank {rank} incarnation {r['inc']}: trains from step {r['step']}, but the replay "
                                f"report says resume_step {report.get('resume_step')} with PLT {report.get('plt')}")
    return failures


def consolidated_key(key: str) -> str | None:
    """The key of a digest key's tensor in a consolidated checkpoint's digests (:func:`check_final_state`):
    ``weights/<name>`` for a parameter or buffer, ``optim/...`` as it is; ``None`` for a learning rate (the
    consolidated checkpoint holds tensors only)."""
    kind, _, rest = key.partition("/")
    if kind in ("param", "buffer"):
        return f"weights/{rest}"
    return key if kind == "optim" else None


def check_final_state(consolidated: Mapping[str, str] | str, reference: Records, max_steps: int) -> list[str]:
    """The final checkpoint, consolidated (``moc-consolidate``), holds bitwise ``reference``'s state after
    ``max_steps``: each tensor as every rank holding it had it, and nothing no rank had. Replay mode: the fault-free
    run's; PEC mode (whose resumes lose tokens): the trial's own, as its last incarnation ended
    (:func:`finished_states`).

    ``consolidated``: digests keyed ``weights/<name>`` and ``optim/<name>/<state>``, or why there are none."""
    if isinstance(consolidated, str):
        return [consolidated]
    failures, held = [], set()
    for rank in sorted(reference):
        final = reference_states(reference, rank).get(max_steps)
        if final is None:
            failures.append(f"rank {rank}: the fault-free run has no state after step {max_steps}")
            continue
        wrong = []
        for key, digest in sorted(final.items()):
            if (name := consolidated_key(key)) is not None:
                held.add(name)
                if consolidated.get(name) != digest:
                    wrong.append(f"{key} {'differs' if name in consolidated else 'is missing'}")
        if wrong:
            more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
            failures.append(f"rank {rank}: the consolidated step {max_steps}: {wrong[0]}{more}")
    extra = sorted(set(consolidated) - held)
    if extra:
        failures.append(f"the consolidated checkpoint holds {len(extra)} tensors no rank had, e.g. {extra[:3]}")
    return failures


def finished_states(records: Records, max_steps: int) -> Records:
    """PEC mode: each rank's state as the last incarnation ended, at ``max_steps`` (after training its last step, or
    restored there with nothing left to train: its ``start`` record), shaped as :func:`check_final_state` reads a
    reference. A rank with no such record gets none, which that check reports."""
    last = max((r["inc"] for recs in records.values() for r in recs), default=0)
    return {
        rank: [{"kind": "step", "step": max_steps, "digests": r["digests"]} for r in recs
               if r["inc"] == last and r["kind"] in ("step", "start") and r["step"] == max_steps][-1:]
        for rank, recs in records.items()
    }


def check_completes(records: Records, outcomes: Sequence[Mapping[str, Any]], max_steps: int, world: int) -> list[str]:
    """The last incarnation exited cleanly and every rank reached ``max_steps``: trained it, or resumed there with
    nothing left to train (its ``start`` record; replay mode's ``restored``)."""
    if not outcomes or outcomes[-1]["rc"] != 0:
        rcs = [o["rc"] for o in outcomes]
        return [f"no clean finish in {len(outcomes)} incarnations (exit codes {rcs}): "
                f"{outcomes[-1].get('tail', '') if outcomes else ''}"]
    last = outcomes[-1]["inc"]
    failures = []
    for rank in range(world):
        steps = [r["step"] for r in records.get(rank, ())
                 if r["kind"] in ("step", "start", "restored") and r["inc"] == last]
        if max(steps, default=0) != max_steps:
            failures.append(f"rank {rank}: the final incarnation {last} ended at step {max(steps, default=0)}, "
                            f"not max_steps={max_steps}")
    return failures


def check_no_hang(outcomes: Sequence[Mapping[str, Any]]) -> list[str]:
    """No incarnation hit the harness's timeout or a process group's timeout."""
    return [f"incarnation {o['inc']} hung ({o['hang']})" for o in outcomes if o.get("hang")]


def run_checks(
    records: Records,
    reference: Records,
    outcomes: Sequence[Mapping[str, Any]],
    max_steps: int,
    world: int,
    consolidated: Mapping[str, str] | str | None = None,
    replay: bool = False,
) -> dict[str, list[str]]:
    """Every check's failure details (an empty list: passed). ``replay``: replay mode's checks, where ``reference`` is
    the fault-free run with MoC and the trial must agree with it bitwise; else PEC mode's. ``consolidated``: the
    digests of the consolidated final checkpoint, or why there are none; ``None``: not checked (``fsdp2``, whose
    oracle digests each rank's pieces; a bucket's checkpoints)."""
    checks = {"no_hang": check_no_hang(outcomes), "completes": check_completes(records, outcomes, max_steps, world)}
    if replay:
        checks["steps"] = check_steps(records, reference)
        checks["resume_state"] = check_resume_state(records, reference)
    else:
        checks["restore"] = check_restore(records)
        checks["restore_never_saved"] = check_restore(records, never_saved=True)
    if consolidated is not None:
        expected = reference if replay else finished_states(records, max_steps)
        checks["final_state"] = check_final_state(consolidated, expected, max_steps)
    checks["data"] = check_data(records, reference)
    return {name: details[:MAX_DETAILS] for name, details in checks.items()}
