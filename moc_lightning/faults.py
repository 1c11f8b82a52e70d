"""Fault injection for drills: kill a chosen rank at a chosen step and phase, optionally losing its node.

Configured by the environment variable ``MOC_FAULT`` (so ``torchrun`` passes it to every worker), e.g.
``MOC_FAULT="rank=1,step=30,phase=snapshot,node_loss=1"``. It fires only in the first incarnation of the
job (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job runs through. Phases:

- ``train``: SIGKILL at the end of train step ``step`` (after that step's snapshot was started);
- ``snapshot``: SIGKILL halfway through copying the snapshot of ``step`` into its slot;
- ``persist``: SIGKILL after the persist of ``step`` wrote its bytes, before the manifest commit.

Node loss is what a replacement node sees: when the job restarts, the ranks of the lost node find their
node's shared-memory root empty (the drill deletes it before anyone looks).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

PHASES = ("train", "snapshot", "persist")


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    phase: str = "train"
    node_loss: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"MOC_FAULT phase={self.phase!r} is not one of {', '.join(PHASES)}")

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get("MOC_FAULT")
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(",") if part)
        unknown = set(fields) - {"rank", "step", "phase", "node_loss"}
        if unknown:
            raise ValueError(f"MOC_FAULT has unknown fields {sorted(unknown)}; allowed: rank, step, phase, node_loss")
        return cls(
            rank=int(fields["rank"]),
            step=int(fields["step"]),
            phase=fields.get("phase", "train"),
            node_loss=fields.get("node_loss", "0") in ("1", "true", "yes"),
        )


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultInjector:
    """Kills this process when the plan says so; a no-op without a plan or after a restart."""

    def __init__(self, plan: FaultPlan | None, rank: int) -> None:
        self.plan = plan if plan is not None and plan.rank == rank and restart_count() == 0 else None
        self.lost_node = plan.node_loss and restart_count() > 0 if plan is not None else False
        self.faulty_rank = plan.rank if plan is not None else None

    def at(self, phase: str, step: int) -> None:
        """Call at each injection point; SIGKILLs the process when phase and step match."""
        if self.plan is not None and self.plan.phase == phase and self.plan.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
