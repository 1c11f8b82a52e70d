"""What checkpointing costs a whole training run on a cluster: MoC-System eq. 3/4 and the effective
training time ratio (ETTR), for a full synchronous checkpoint, PEC, and two-level PEC.

Eq. 4 splits the fault-tolerance overhead of a run into saving and faults::

    O_ckpt ~= O_save * I_total / I_ckpt + N_fault * (O_restart + O_lost),   O_lost ~= I_ckpt / 2 iterations

and ``ETTR = useful / (useful + O_ckpt)`` with ``useful = I_total * iteration time``. The functions here
are pure: a :class:`ClusterScenario` in, a :class:`Projection` per method out. Assumptions:

- **Faults** arrive as a Poisson process over wall-clock time (training, saving, restarting and redoing
  lost work alike) at the cluster rate ``GPUs / MTBF_per_GPU``. The expected count solves
  ``N = (useful + save + N * per_fault) / MTBF_cluster``; when one fault costs as much as the MTBF the run
  never finishes (``N`` is infinite and ETTR 0).
- **Bytes** are spread evenly over the ranks (fully sharded writes, section 4): a rank moves
  ``bytes / GPUs``. A PEC checkpoint holds eq. 6 in the form ``C_full * (1 - s + s * K / N)``, ``s`` the
  experts' share of eq. 5's bytes.
- **Full sync checkpoint** and **PEC** write to storage on the training thread every ``checkpoint_interval``
  iterations (PEC with ``K = k_persist``): each save stalls training for the whole write.
- **Two-level PEC** snapshots ``k_snapshot`` experts into host memory every ``snapshot_interval``
  iterations, overlapped with the next forward/backward: the stall is ``max(0, snapshot time - overlap
  window)``, the window being ``overlap_fraction`` of an iteration (section 2.3.1). It persists
  ``k_persist`` experts every ``persist_interval`` iterations in the background, without stalling; a persist
  cannot start before the previous one ends, so the persist interval is at least the persist time.
- **Lost work** is half an interval of the level recovered from: the snapshot interval when the snapshots
  survive the fault (a process crash: share ``memory_survival`` of faults), the persist or checkpoint
  interval otherwise (the node and its memory are gone).
- **Restart** is a fixed ``restart_seconds`` (rescheduling, start-up, process groups) plus reading every
  rank's share of the full state back from the level recovered from, at that level's bandwidth (reads
  assumed as fast as writes). Lost tokens (PLT) cost accuracy, not time, and do not appear here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
HOUR = 3600.0


@dataclass(frozen=True)
class ClusterScenario:
    """A training run on a cluster, and what its checkpointing methods move and how fast."""

    gpus: int
    """Ranks (one per GPU), each holding ``1 / gpus`` of every checkpoint's bytes."""
    total_iterations: int
    """Iterations of the whole run (``I_total``); a duration ``D`` is ``D / iteration_seconds`` iterations."""
    iteration_seconds: float
    """Time of one training iteration without checkpointing."""
    full_bytes: float
    """Eq. 5: bytes of all weights and optimizer state, all ranks together."""
    expert_share: float
    """Share of eq. 5's bytes in experts, ``P_e / (P_ne + P_e)``, in (0, 1)."""
    num_experts: int
    """Experts per MoE layer (N)."""
    k_snapshot: int
    """Experts per MoE layer in a two-level snapshot."""
    k_persist: int
    """Experts per MoE layer in a two-level persist, and in a (single-level) PEC checkpoint."""
    mtbf_gpu_hours: float
    """Mean time between failures of one GPU (with its share of host, network, software), in hours."""
    snapshot_gbps: float
    """Bandwidth of one rank's copy into host memory (device to host), GB/s (1e9 B/s)."""
    persist_gbps: float
    """Bandwidth of one rank's write to (and read from) persistent storage, GB/s."""
    restart_seconds: float
    """Fixed cost of a restart before any state is read: rescheduling, start-up, process groups."""
    checkpoint_interval: int
    """Iterations between checkpoints of the single-level methods (full sync, PEC)."""
    snapshot_interval: int
    """Iterations between two-level snapshots."""
    persist_interval: int
    """Iterations between two-level persists (at least ``snapshot_interval``)."""
    overlap_fraction: float
    """Share of an iteration (its forward/backward) a snapshot copy can hide behind, in [0, 1]."""
    memory_survival: float = 0.0
    """Share of faults after which the host-memory snapshots are usable (process crash, not a lost node)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "total_iterations", "num_experts", "checkpoint_interval", "snapshot_interval"):
            _require(self, name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("iteration_seconds", "full_bytes", "mtbf_gpu_hours", "snapshot_gbps", "persist_gbps"):
            _require(self, name, getattr(self, name) > 0, "must be > 0")
        _require(self, "restart_seconds", self.restart_seconds >= 0, "must be >= 0")
        _require(self, "expert_share", 0 < self.expert_share < 1, "must be in (0, 1)")
        for name in ("overlap_fraction", "memory_survival"):
            _require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        _require(self, "k_snapshot", 1 <= self.k_snapshot <= self.num_experts,
                 f"must be in [1, num_experts={self.num_experts}]")  # fmt: skip
        _require(self, "k_persist", 1 <= self.k_persist <= self.k_snapshot,
                 f"must be in [1, k_snapshot={self.k_snapshot}]")  # fmt: skip
        _require(self, "persist_interval", self.persist_interval >= self.snapshot_interval,
                 f"must be >= snapshot_interval={self.snapshot_interval}")  # fmt: skip

    @property
    def useful_seconds(self) -> float:
        """Training time without any fault tolerance: ``I_total * iteration time``."""
        return self.total_iterations * self.iteration_seconds

    @property
    def cluster_mtbf_seconds(self) -> float:
        """Mean time between faults anywhere in the cluster: per-GPU MTBF / GPUs."""
        return self.mtbf_gpu_hours * HOUR / self.gpus

    def pec_bytes(self, k: int) -> float:
        """Eq. 6 as a share of eq. 5: all non-expert bytes and ``k / N`` of the experts'."""
        return pec_bytes(self.full_bytes, self.expert_share, k, self.num_experts)

    def rank_seconds(self, total_bytes: float, gbps: float) -> float:
        """Time for one rank to move its even share of ``total_bytes`` at ``gbps``."""
        return total_bytes / self.gpus / (gbps * GB)


def _require(scenario: ClusterScenario, field: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"ClusterScenario.{field}={getattr(scenario, field)!r} {what}")


@dataclass(frozen=True)
class Projection:
    """Eq. 4's terms for one method over the whole run, in seconds, and the ETTR they leave."""

    method: str
    save_seconds: float
    """``O_save * I_total / I_ckpt``: training stalled by saving."""
    expected_faults: float
    """``N_fault``: faults expected over the run's wall-clock time."""
    restart_seconds: float
    """``N_fault * O_restart``."""
    lost_seconds: float
    """``N_fault * O_lost``: work redone after faults."""
    stall_per_save: float
    """Stall of one checkpoint (or snapshot), seconds."""
    recovery_interval: float
    """Mean save interval (iterations) of the level faults recover from; half of it is lost work per fault."""

    @property
    def overhead_seconds(self) -> float:
        """Eq. 4's ``O_ckpt``."""
        return self.save_seconds + self.restart_seconds + self.lost_seconds

    def ettr(self, useful_seconds: float) -> float:
        """ETTR of a run whose fault-free training takes ``useful_seconds``."""
        return ettr(useful_seconds, self.overhead_seconds)


def pec_bytes(full_bytes: float, expert_share: float, k: int, num_experts: int) -> float:
    """Eq. 6 from eq. 5: ``C_full * (1 - s + s * K / N)`` with ``s`` the experts' share of the bytes."""
    return full_bytes * (1 - expert_share + expert_share * k / num_experts)


def save_overhead(stall_per_save: float, total_iterations: int, interval: float) -> float:
    """Eq. 3's first term: ``O_save * I_total / I_ckpt``."""
    return stall_per_save * total_iterations / interval


def lost_work(interval: float, iteration_seconds: float) -> float:
    """Eq. 4's ``O_lost``: on average half an interval of iterations is redone."""
    return interval / 2 * iteration_seconds


def snapshot_stall(snapshot_seconds: float, overlap_seconds: float) -> float:
    """Training waits only for the part of the copy that the forward/backward cannot hide."""
    return max(0.0, snapshot_seconds - overlap_seconds)


def expected_faults(busy_seconds: float, per_fault_seconds: float, mtbf_seconds: float) -> float:
    """Poisson faults over wall-clock time: ``N = (busy + N * per_fault) / MTBF``, ``busy`` the fault-free time.

    Infinite when a fault costs at least an MTBF: restarts then never catch up.
    """
    if per_fault_seconds >= mtbf_seconds:
        return math.inf
    return busy_seconds / (mtbf_seconds - per_fault_seconds)


def ettr(useful_seconds: float, overhead_seconds: float) -> float:
    """Effective training time ratio: useful time over wall-clock time (0 when overhead is infinite)."""
    return useful_seconds / (useful_seconds + overhead_seconds)


@dataclass(frozen=True)
class RecoveryLevel:
    """Where a share of the faults recovers from."""

    share: float
    """Share of faults that recover from this level."""
    interval: float
    """Iterations between the saves of this level (half of it is redone after a fault)."""
    read_seconds: float
    """Time for a rank to read its share of the state back from this level."""


def project(
    scenario: ClusterScenario,
    method: str,
    stall_per_save: float,
    save_interval: float,
    levels: tuple[RecoveryLevel, ...],
) -> Projection:
    """Eq. 4 for one method that stalls ``stall_per_save`` every ``save_interval`` iterations.

    A fault costs the share-weighted mean over ``levels`` of the restart (fixed + read) and the lost work.
    """
    save = save_overhead(stall_per_save, scenario.total_iterations, save_interval)
    interval = sum(level.share * level.interval for level in levels)
    restart = scenario.restart_seconds + sum(level.share * level.read_seconds for level in levels)
    lost = lost_work(interval, scenario.iteration_seconds)
    faults = expected_faults(scenario.useful_seconds + save, restart + lost, scenario.cluster_mtbf_seconds)
    return Projection(
        method=method,
        save_seconds=save,
        expected_faults=faults,
        restart_seconds=_per_fault_total(faults, restart),
        lost_seconds=_per_fault_total(faults, lost),
        stall_per_save=stall_per_save,
        recovery_interval=interval,
    )


def _per_fault_total(faults: float, each: float) -> float:
    """``faults * each``, and 0 for a cost that is 0 even when faults are infinite."""
    return faults * each if each else 0.0


def project_full_sync(scenario: ClusterScenario) -> Projection:
    """Every expert, written to storage on the training thread every ``checkpoint_interval`` iterations."""
    return _single_level(scenario, "full sync checkpoint", scenario.full_bytes)


def project_pec(scenario: ClusterScenario) -> Projection:
    """PEC with ``K = k_persist``, written to storage on the training thread every ``checkpoint_interval``."""
    return _single_level(scenario, f"PEC (K={scenario.k_persist})", scenario.pec_bytes(scenario.k_persist))


def _single_level(scenario: ClusterScenario, method: str, checkpoint_bytes: float) -> Projection:
    stall = scenario.rank_seconds(checkpoint_bytes, scenario.persist_gbps)
    read = scenario.rank_seconds(scenario.full_bytes, scenario.persist_gbps)
    level = RecoveryLevel(1.0, scenario.checkpoint_interval, read)
    return project(scenario, method, stall, scenario.checkpoint_interval, (level,))


def project_two_level(scenario: ClusterScenario) -> Projection:
    """Overlapped snapshots of ``k_snapshot`` experts, background persists of ``k_persist`` of them."""
    snapshot = scenario.rank_seconds(scenario.pec_bytes(scenario.k_snapshot), scenario.snapshot_gbps)
    stall = snapshot_stall(snapshot, scenario.overlap_fraction * scenario.iteration_seconds)
    persist = scenario.rank_seconds(scenario.pec_bytes(scenario.k_persist), scenario.persist_gbps)
    persist_interval = max(scenario.persist_interval, persist / scenario.iteration_seconds)
    from_memory = scenario.rank_seconds(scenario.full_bytes, scenario.snapshot_gbps)
    from_storage = scenario.rank_seconds(scenario.full_bytes, scenario.persist_gbps)
    levels = (
        RecoveryLevel(scenario.memory_survival, scenario.snapshot_interval, from_memory),
        RecoveryLevel(1 - scenario.memory_survival, persist_interval, from_storage),
    )
    method = f"two-level PEC (K={scenario.k_snapshot}/{scenario.k_persist})"
    return project(scenario, method, stall, scenario.snapshot_interval, levels)


def project_all(scenario: ClusterScenario) -> list[Projection]:
    """The three methods of the comparison, in order."""
    return [project_full_sync(scenario), project_pec(scenario), project_two_level(scenario)]
