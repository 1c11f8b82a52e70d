"""The paper's checkpoint accounting: ZeRO-2 data parallelism + expert parallelism in mixed precision.

MoC-System measures Figure 10 under ZeRO-2 DP + EP (section 4, Figure 6), not under the replicated optimizer
that ``moc_lightning.sharding.ownership``'s strategies see in DDP. Every parameter carries bf16 weights (``B_w`` = 2
bytes), replicated on every holder of its unit, and an fp32 master weight with two Adam moments (``B_o`` = 12
bytes), which ZeRO partitions over the holders: a dense unit over all ranks, an expert over its
expert-data-parallel group (the ranks at its EP rank, one in each EP group). Each rank writes its own
optimizer partition of every saved unit (ZeRO-1 and ZeRO-2 look the same to a checkpoint, section 2.2), so
only the replicated weights need an owner, and that is all the plans change:

- ``deepspeed``: DeepSpeed's default ZeRO-2 save (Figure 7a): rank 0 writes the non-expert weights, EP group
  0 (expert-data-parallel rank 0 of each expert) writes the experts' weights.
- ``EE+EN``: equal expert sharding (the experts' weights split equally over their replicas, 4.1, as ownership cuts
  them: an EP rank's experts as one run, :class:`~moc_lightning.sharding.ownership.SplitRun`) and equal non-expert
  sharding (dense weights placed largest first onto the ranks with the fewest dense bytes, 4.2).
- ``EE+AN``: the same expert split; dense weights placed largest first onto the ranks with the fewest bytes
  counting everything else they write: their optimizer partitions and expert weights (adaptive, 4.3).

The paper places non-expert state at layer granularity (whole units); ``EE+EN rows`` and ``EE+AN rows`` use
our row-block pouring of oversized units instead (``moc_lightning.sharding.ownership``).

Assumption: the optimizer state of the units one replica group holds, laid end to end, is cut evenly over the
group (:func:`~moc_lightning.sharding.ownership.split_loads`), as DeepSpeed partitions one flat buffer per parameter
group. Figure 6 draws each unit split evenly over its group instead, which moves the boundaries but not any rank's
share of the whole (beyond a parameter).

Units are counted in parameters: a unit's ``rows`` are its parameters (``row_bytes`` = 1); bytes come from
``MixedPrecision``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from moc_lightning.sharding.ownership import (
    Ownership,
    ShardingUnit,
    Topology,
    compute_ownership,
    equal_experts_ownership,
    split_loads,
)


@dataclass(frozen=True)
class MixedPrecision:
    """Bytes per parameter of Adam training in mixed precision (the paper's setting)."""

    weight_bytes: int = 2
    """bf16 weights: ``B_w``, replicated on every holder."""
    optimizer_bytes: int = 12
    """fp32 master weight + exp_avg + exp_avg_sq: ``B_o``, partitioned by ZeRO over the holders."""

    def __post_init__(self) -> None:
        if self.weight_bytes < 1 or self.optimizer_bytes < 0:
            raise ValueError(
                f"weight_bytes must be >= 1 and optimizer_bytes >= 0; "
                f"got weight_bytes={self.weight_bytes}, optimizer_bytes={self.optimizer_bytes}"
            )


BASELINE = "deepspeed"
_EE_PLANS: Mapping[str, tuple[bool, bool]] = {
    "EE+EN": (False, False),
    "EE+AN": (True, False),
    "EE+EN rows": (False, True),
    "EE+AN rows": (True, True),
}
"""(adaptive non-expert placement, row-block pouring of oversized dense units) of each EE plan."""
ZERO2_PLANS: tuple[str, ...] = (BASELINE, *_EE_PLANS)
"""Names accepted by ``zero2_checkpoint``."""


@dataclass(frozen=True)
class Zero2Checkpoint:
    """What each rank writes for one checkpoint: its share of the replicated weights and its own optimizer partition."""

    plan: str
    weights: Ownership
    """Who writes which parameter rows of the weights (``rank_bytes`` in bytes of ``B_w``)."""
    optimizer_bytes: tuple[int, ...]
    """Each rank's own ZeRO partition of the saved units' optimizer state."""

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        return tuple(w + o for w, o in zip(self.weights.rank_bytes, self.optimizer_bytes, strict=True))

    @property
    def busiest_bytes(self) -> int:
        """The bottleneck rank, which sets how long a blocking checkpoint takes (Figure 10 b-d)."""
        return max(self.rank_bytes)

    @property
    def ideal_bytes(self) -> float:
        """Bytes per rank if the whole checkpoint were spread perfectly evenly."""
        return sum(self.rank_bytes) / len(self.rank_bytes)


def _check_parameter_units(units: Sequence[ShardingUnit]) -> None:
    for unit in units:
        if unit.row_bytes != 1:
            raise ValueError(
                f"unit {unit.key!r}: units must be counted in parameters (row_bytes=1, bytes come from "
                f"MixedPrecision); got row_bytes={unit.row_bytes}"
            )


def optimizer_partitions(units: Sequence[ShardingUnit], topology: Topology, optimizer_bytes: int) -> tuple[int, ...]:
    """Bytes of each rank's ZeRO partition of the units' optimizer state: each set of holders' units cut evenly over
    them."""
    _check_parameter_units(units)
    return tuple(load * optimizer_bytes for load in split_loads(units, topology.world_size))


def zero2_checkpoint(
    units: Sequence[ShardingUnit], topology: Topology, plan: str, precision: MixedPrecision = MixedPrecision()
) -> Zero2Checkpoint:
    """Bytes each rank writes when saving ``units`` (counted in parameters) under ZeRO-2 + EP with ``plan``."""
    if plan not in ZERO2_PLANS:
        raise ValueError(f"unknown ZeRO-2 plan {plan!r}; allowed: {', '.join(ZERO2_PLANS)}")
    optimizer = optimizer_partitions(units, topology, precision.optimizer_bytes)
    weights = tuple(replace(unit, row_bytes=precision.weight_bytes) for unit in units)
    if plan == BASELINE:
        ownership = compute_ownership(weights, topology, "rank0")
    else:
        adaptive, pour = _EE_PLANS[plan]
        ownership = equal_experts_ownership(
            weights, topology, label=plan, base_loads=optimizer if adaptive else None, pour=pour
        )
    return Zero2Checkpoint(plan, ownership, optimizer)


def eq8_rank_bytes(
    dense_params: int, expert_params: int, topology: Topology, precision: MixedPrecision, *, as_printed: bool
) -> float:
    """``C_rank``, the ideal bytes per rank of a full checkpoint (eq. 8), with D_dp = world size, D_ep = ep.

    As printed, (P_ne + P_e) B_o / D_ep + P_ne B_w / D_dp + P_e B_w / D_ep: the optimizer and expert terms
    over the EP degree. That cannot be what was measured: with several EP groups (Case 3, D_dp = 2 D_ep) it
    counts each rank's expert weights whole, so equal expert sharding would gain nothing there, while the
    paper says that is the only case where it gains; and it counts a D_ep-th of the dense optimizer state
    per rank, which ZeRO partitions over all D_dp ranks. Read with D_dp in every term (``as_printed=False``),
    it is the whole checkpoint over the ranks: ZeRO leaves each rank 1/D_dp of the optimizer state (the dense
    state over all D_dp ranks; N/D_ep experts per layer, each over D_dp/D_ep replicas), and equal expert
    sharding splits each expert's weights over those replicas. The two readings agree when D_dp = D_ep
    (Cases 1 and 2).
    """
    dp, ep = topology.world_size, topology.ep
    total = dense_params + expert_params
    if as_printed:
        return (
            total * precision.optimizer_bytes / ep
            + dense_params * precision.weight_bytes / dp
            + expert_params * precision.weight_bytes / ep
        )
    return total * (precision.optimizer_bytes + precision.weight_bytes) / dp
