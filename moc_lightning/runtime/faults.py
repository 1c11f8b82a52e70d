"""Fault injection for drills: kill a chosen rank at a chosen point of training, checkpointing or recovery.

Configured by the environment variable ``MOC_FAULT`` (so ``torchrun`` passes it to every worker), e.g.
``MOC_FAULT="rank=1,step=30,phase=snapshot,node_loss=1"``. Fields:

- ``rank`` (required): the global rank that dies;
- ``phase``: where (below; default ``train``);
- ``step``: the step the point must be at (omitted: any step);
- ``nth``: die at the ``nth`` matching occurrence, not the first (1-based), so a randomized harness can pick
  a random moment without knowing the schedule's steps;
- ``incarnation``: fire only in the job incarnation whose environment variable ``MOC_INCARNATION`` has this
  value. A harness that relaunches the job itself sets it per launch. Without it the fault fires only in the
  first incarnation of a ``torchrun`` job (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job runs through;
- ``node_loss``: when the job restarts, the ranks of the lost node find their node's shared-memory root
  empty (the drill deletes it before anyone looks).

Phases (SIGKILL at):

- ``train``: the end of train step ``step`` (after that step's snapshot was started);
- ``snapshot``: halfway through copying the snapshot of ``step`` into its slot;
- ``slot_commit``: the background commit of the snapshot of ``step``, before its slot's metadata is written;
- ``persist``: after the persist of ``step`` wrote its bytes, before the manifest commit;
- ``manifest_commit``: inside the coordinator's commit of the persist of ``step``, after the checkpoint's
  self-description and the previous manifest were written, before the new manifest is (only the coordinator
  gets there, so only a plan for rank 0 fires);
- ``recovery``: inside a two-level recovery, after the units from memory were restored, before storage
  loads (``step`` is the resume step);
- ``final_persist``: inside the final persist of ``step`` when ``fit`` ends, after this rank wrote its bytes, before
  the ranks agree on the write (a kill there leaves the last step uncommitted, whatever the mode).

Replay mode's phases (``checkpoint.mode=replay``; ``step`` is the global step after the iteration or window named):

- ``capture``: inside the capture of the iteration ending at ``step``, its copies started, not joined;
- ``handover``: at the hand-over of the window ending at ``step``, the previous window sealed and stored, this one
  not yet given to the background thread (its slot holds its captures, no head);
- ``seal``: in the background seal of the window ending at ``step``, its file complete, before its head is written;
- ``store``: in the storage write of the window ending at ``step`` (also its re-store on resume), its object
  replaced, before its head is written;
- ``restore``: inside a resume, after this rank loaded the window ending at ``step``, before the ranks agree that
  every one did;
- ``replay``: inside a resume's replay, after the replayed optimizer step that reaches ``step``.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

PHASES = (
    "train", "snapshot", "slot_commit", "persist", "manifest_commit", "recovery", "final_persist",
    "capture", "handover", "seal", "store", "restore", "replay",
)
FIELDS = ("rank", "step", "phase", "nth", "incarnation", "node_loss")


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int | None = None
    phase: str = "train"
    node_loss: bool = False
    nth: int = 1
    incarnation: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"MOC_FAULT phase={self.phase!r} is not one of {', '.join(PHASES)}")
        if self.nth < 1:
            raise ValueError(f"MOC_FAULT nth={self.nth} must be >= 1")

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """A plan from its ``key=value,...`` text (the format of ``MOC_FAULT``)."""
        fields = dict(part.split("=", 1) for part in spec.split(",") if part)
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"MOC_FAULT has unknown fields {sorted(unknown)}; allowed: {', '.join(FIELDS)}")
        if "rank" not in fields:
            raise ValueError(f"MOC_FAULT={spec!r} needs rank=<global rank that dies>")
        return cls(
            rank=int(fields["rank"]),
            step=int(fields["step"]) if fields.get("step", "") != "" else None,
            phase=fields.get("phase", "train"),
            node_loss=fields.get("node_loss", "0") in ("1", "true", "yes"),
            nth=int(fields.get("nth", "1")),
            incarnation=int(fields["incarnation"]) if fields.get("incarnation", "") != "" else None,
        )

    def spec(self) -> str:
        """The ``MOC_FAULT`` text of this plan (``parse`` inverts it)."""
        parts = [f"rank={self.rank}", f"phase={self.phase}", f"nth={self.nth}", f"node_loss={int(self.node_loss)}"]
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.incarnation is not None:
            parts.append(f"incarnation={self.incarnation}")
        return ",".join(parts)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get("MOC_FAULT")
        return cls.parse(spec) if spec else None

    def in_this_incarnation(self) -> bool:
        """Whether this process belongs to the incarnation the plan is meant for."""
        if self.incarnation is not None:
            return os.environ.get("MOC_INCARNATION") == str(self.incarnation)
        return restart_count() == 0


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


KILL_LINE = "[moc_lightning] fault injection: SIGKILL"
"""What a rank prints just before it kills itself. A harness tells a kill by it, not by the launcher's report:
torch's elastic agent with multiprocessing ranks (:mod:`moc_lightning.runtime.launch`) names the first failed rank it sees,
which may be a peer that lost its connection to the killed one."""


class FaultInjector:
    """Kills this process when the plan says so; a no-op without a plan, on other ranks, or in other incarnations."""

    def __init__(self, plan: FaultPlan | None, rank: int) -> None:
        active = plan is not None and plan.rank == rank and plan.in_this_incarnation()
        self.plan = plan if active else None
        self.lost_node = plan.node_loss and restart_count() > 0 if plan is not None else False
        self.faulty_rank = plan.rank if plan is not None else None
        self._seen = 0

    def at(self, phase: str, step: int) -> None:
        """Call at each injection point; SIGKILLs the process at the plan's ``nth`` matching occurrence."""
        plan = self.plan
        if plan is None or plan.phase != phase or (plan.step is not None and plan.step != step):
            return
        self._seen += 1
        if self._seen == plan.nth:
            print(f"{KILL_LINE} of rank {plan.rank} at {phase} (step {step})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


_process_injector: FaultInjector | None = None


def fault_point(phase: str, step: int) -> None:
    """An injection point in code that holds no injector (the storage commit): the plan of ``MOC_FAULT`` for
    this process's global rank (``RANK``), created on first use."""
    global _process_injector
    if _process_injector is None:
        _process_injector = FaultInjector(FaultPlan.from_env(), int(os.environ.get("RANK", "0")))
    _process_injector.at(phase, step)
