"""Ownership: which rank writes which row range of every unit a checkpoint saves.

Every unit is replicated: a dense unit on all ranks, an expert on one rank per EP group. Left alone, each
holder would write its replica; ownership picks exactly one writer for every byte and spreads the bytes so
that the busiest rank, which sets how long a checkpoint takes, is as light as possible (MoC-System,
section 4). It is a pure function of the units and the topology, so every rank computes the same answer
with no communication, and it is cached because the sequential PEC selection repeats every ceil(N/K)
checkpoints.

Strategies (``STRATEGIES``):

- ``equal``: the experts are split equally over their replicas (section 4.1): the selected experts one EP rank
  holds, laid end to end, are cut into one equal byte range per replica (:class:`SplitRun`); dense units are
  placed at layer granularity (section 4.2), oversized ones in row blocks (below), onto the ranks with the
  fewest dense bytes, ignoring experts, so the dense pattern never depends on the selection.
- ``adaptive``: experts as in ``equal``; dense units as in ``equal`` but onto the ranks with the fewest
  bytes *including* the experts the selection put on them, filling the ranks PEC leaves light (4.3).
- ``rank0``: the Megatron-DeepSpeed baseline (Figure 7a): every unit whole by its lowest-ranked holder, i.e.
  rank 0 writes all dense units and EP group 0 writes all experts.
- ``dcp_default``: what ``torch.distributed.checkpoint``'s deduplication (``dedup_save_plans``) does,
  modelled with one write item per unit; see ``_dcp_default``.

``equal_experts_ownership`` places the same way around bytes a rank writes besides the units (the ZeRO
optimizer partitions of ``moc_lightning.sharding.paper_accounting``), at layer granularity or with pouring.

Dense placement in ``equal`` and ``adaptive`` (``_place_dense``). The *dense share* is the bytes of all
dense units being saved divided by the world size. A dense unit bigger than it is *oversized*: whole, it
would make its writer the bottleneck, whatever else is placed (the 0.72 GB word embedding of GPT-350M-16E
against a 0.45 GB share at DP=8, where K=16 gives every rank the same expert bytes). The share counts dense
bytes, not the total: when experts are spread evenly, the room each rank has left for dense bytes is the
dense share, so a unit under the total share but over the dense share still overloads its writer.

Units that fit stay whole and are placed first, largest first, each onto its lightest holder (LPT greedy).
Oversized units are then poured, largest first, into the gaps: consecutive row blocks onto the lightest
holders, each block filling its rank up to the *ideal line* (the strategy's perfectly even load: the dense
share for ``equal``, total bytes over ranks for ``adaptive``), rounded up to whole rows. So, for a unit
held everywhere, no block is larger than that line (plus under one row); the blocks of one unit go to
distinct ranks (the engine writes one row range per tensor per rank); and only as many ranks take a block
as the gaps need. Equal-size blocks placed among the whole units level those gaps only by chance: for
GPT-350M-16E at DP=EP=16, K=1, 4, 7, 8 or 16 equal blocks of the embedding leave the busiest rank at
1.13, 1.09, 1.04 or 1.09x the ideal; pouring reaches 1.00x.

Cost at scale (DESIGN.md, Scale). The experts' split is a pure function of their sizes, so an ``Ownership`` keeps
it implicit (``placed[i] is None``) and derives a shard where it is asked for: one rank's ``writes_of`` costs
O(units) (its piece of each run found by bisection), and the per-rank expert bytes the placement needs come from
walking each run's cuts and units together, O(units + ranks). Only the dense units are placed explicitly, in
O(ranks + dense units x log ranks). So a plan costs O(units + ranks), never O(units x ranks). Cutting runs rather
than each expert also keeps the *checkpoint* O(units + ranks): every shard is a DCP write item and a chunk in
``.metadata``, and at 16,384 ranks each DeepSeek-V3 expert has 256 replicas, 11.4 M chunks split one by one, which
the coordinator plans and records in one process (the scale report's ``coordinator_plan_s``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Literal

UnitKind = Literal["expert", "dense"]


@dataclass(frozen=True)
class Topology:
    """The ranks that train together: EP groups are consecutive blocks of ``ep`` ranks."""

    world_size: int
    """Number of ranks (the data-parallel degree)."""
    ep: int
    """Expert-parallel degree: ranks per EP group. Must divide ``world_size``."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ep < 1 or self.world_size % self.ep != 0:
            raise ValueError(
                f"topology needs world_size >= 1 and an ep >= 1 that divides it; "
                f"got world_size={self.world_size}, ep={self.ep}"
            )

    def ranks(self) -> range:
        """Every rank: the holders of a dense unit."""
        return range(self.world_size)

    def replicas(self, ep_rank: int) -> range:
        """The ranks at EP rank ``ep_rank`` in each EP group: the holders of the experts that EP rank holds."""
        if not 0 <= ep_rank < self.ep:
            raise ValueError(f"ep_rank={ep_rank} must lie in [0, ep={self.ep})")
        return range(ep_rank, self.world_size, self.ep)


@dataclass(frozen=True)
class ShardingUnit:
    """One unit to save, as ownership sees it: a key, a size in rows, and the ranks holding a replica.

    A unit (weights and optimizer state) is viewed as ``rows`` rows of ``row_bytes`` bytes each, so that
    it can be split into row ranges; ``holders`` is a sorted ``range`` or tuple of ranks (a ``range`` keeps
    a dense unit on thousands of ranks cheap to store and to hash).
    """

    key: str
    """Stable name of the unit, the same on every rank (e.g. ``expert/L3/E7`` or ``dense/blocks.0.attn``)."""
    kind: UnitKind
    rows: int
    """Length of dim 0: the unit can be split into row ranges ``[start, stop)`` of ``[0, rows)``."""
    row_bytes: int
    """Bytes per row, weights and optimizer state together."""
    holders: tuple[int, ...] | range
    """Ranks holding a replica, ascending."""
    layer: int | None = None
    """MoE-layer index, for experts only."""
    expert: int | None = None
    """Global expert id within its layer, for experts only."""

    def __post_init__(self) -> None:
        if self.kind not in ("expert", "dense"):
            raise ValueError(f"unit {self.key!r}: kind={self.kind!r} must be 'expert' or 'dense'")
        is_expert = self.kind == "expert"
        if (self.layer is not None, self.expert is not None) != (is_expert, is_expert):
            raise ValueError(f"unit {self.key!r}: layer and expert are required for experts and forbidden for dense")
        if self.rows < 0 or self.row_bytes < 0:
            raise ValueError(f"unit {self.key!r}: rows={self.rows} and row_bytes={self.row_bytes} must be >= 0")
        if len(self.holders) == 0:
            raise ValueError(f"unit {self.key!r}: holders must name at least one rank")
        ascending = self.holders.step > 0 if isinstance(self.holders, range) else all(
            a < b for a, b in zip(self.holders, self.holders[1:])
        )
        if not ascending or self.holders[0] < 0:
            raise ValueError(f"unit {self.key!r}: holders must be distinct ranks >= 0 in ascending order")

    @property
    def nbytes(self) -> int:
        """Size of the whole unit in bytes."""
        return self.rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows ``[row_start, row_stop)`` of one unit, written by ``rank``."""

    rank: int
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start


Holders = tuple[int, ...] | range
"""The ranks holding a replica of a unit, ascending."""


@dataclass(frozen=True)
class SplitRun:
    """The units of one set of holders laid end to end, in unit order, and cut into one equal range per holder.

    This is how ``equal`` and ``adaptive`` split the experts (section 4.1's equal expert sharding, the goal being
    equal bytes per replica): the experts an EP rank holds share their holders, its replicas, so their rows form one
    run, whose ``total`` bytes are cut at ``piece * total // replicas``, each cut moved down to a whole row of the
    unit it falls in. Replica ``piece`` writes whatever lies between its two cuts: a few whole experts and at most two
    partial ones, each a single row range, within one row of ``total / replicas`` bytes. Splitting every expert over
    every replica instead would balance as well but give each (expert, replica) pair its own write item: at 16,384
    ranks a DeepSeek-V3-shaped checkpoint's 14,848 experts each had 256 replicas, 11.4 M chunks for the coordinator
    to plan and ``.metadata`` to record; cut as one run, an EP rank's experts and replicas add up instead
    (units + replicas pieces). With one unit, or one replica, it is the paper's figure: an expert halved over two
    replicas, or whole. A row counts ``row_bytes`` (at least 1, so that weightless rows are spread too).

    Where the cuts fall depends only on the units, so every rank finds the same ones, and a checkpoint records its
    chunks in DCP's metadata: loading, resharding and consolidation read them from there, whichever way they were cut.
    """

    holders: Holders
    indices: tuple[int, ...]
    """Each unit's position among the ownership's units."""
    units: tuple[ShardingUnit, ...]
    starts: tuple[int, ...]
    """Where each unit begins in the run, in row-weighted bytes; ``starts[-1]`` is the run's total."""
    bytes_before: tuple[int, ...]
    """Bytes of the units before each one (``starts`` with each row its own ``row_bytes``, even 0)."""

    @classmethod
    def of(cls, holders: Holders, members: Sequence[tuple[int, ShardingUnit]]) -> SplitRun:
        """The run of ``members`` ((position, unit) pairs, in order), all held by ``holders``."""
        units = tuple(u for _, u in members)
        starts = itertools.accumulate((u.rows * max(1, u.row_bytes) for u in units), initial=0)
        before = itertools.accumulate((u.nbytes for u in units), initial=0)
        return cls(holders, tuple(i for i, _ in members), units, tuple(starts), tuple(before))

    @property
    def total(self) -> int:
        return self.starts[-1]

    def piece_shards(self, piece: int) -> list[tuple[int, Shard]]:
        """(position in the run, shard) of everything replica number ``piece`` writes; the first replica also takes
        each unit of no rows (an empty shard, so that it has a writer). O(log units + its shards)."""
        rank = self.holders[piece]
        mine = [(j, Shard(rank, 0, 0)) for j in self._empty] if piece == 0 else []
        return mine + [(j, Shard(rank, start, stop)) for j, start, stop in self._piece_rows(piece)]

    def unit_shards(self, j: int) -> tuple[Shard, ...]:
        """The shards of the run's unit number ``j``, by consecutive replicas: O(its shards)."""
        unit = self.units[j]
        if unit.rows == 0:
            return (Shard(self.holders[0], 0, 0),)
        first, last = self._piece_at(self.starts[j]), self._piece_at(self.starts[j + 1] - 1)
        shards = []
        for piece in range(first, last + 1):
            start, stop = self._row(j, self._cut(piece)), self._row(j, self._cut(piece + 1))
            if stop > start:
                shards.append(Shard(self.holders[piece], start, stop))
        return tuple(shards)

    def add_loads(self, loads: list[int]) -> None:
        """Add the bytes each holder writes of the run to ``loads`` (by rank): the bytes between the row boundaries
        of its two cuts, walking cuts and units together. O(replicas + units)."""
        j, before, last = 0, 0, len(self.units) - 1
        starts, total, count = self.starts, self.total, len(self.holders)
        for piece, rank in enumerate(self.holders):
            cut = (piece + 1) * total // count  # _cut(piece + 1), in the loop that a plan runs once per replica
            while j < last and starts[j + 1] <= cut:  # the last unit that starts at or before the cut
                j += 1
            after = self.bytes_before[j] + self._row(j, cut) * self.units[j].row_bytes
            loads[rank] += after - before
            before = after

    def _piece_rows(self, piece: int) -> Iterator[tuple[int, int, int]]:
        """(position in the run, first row, stop row) of each unit replica number ``piece`` writes rows of."""
        low, high = self._cut(piece), self._cut(piece + 1)
        j = max(0, bisect.bisect_right(self.starts, low) - 1)
        while j < len(self.units) and self.starts[j] < high:
            start, stop = self._row(j, low), self._row(j, high)
            if stop > start:
                yield j, start, stop
            j += 1

    @cached_property
    def _empty(self) -> tuple[int, ...]:
        """Positions of the units of no rows."""
        return tuple(j for j, unit in enumerate(self.units) if unit.rows == 0)

    def _cut(self, piece: int) -> int:
        return piece * self.total // len(self.holders)

    def _piece_at(self, position: int) -> int:
        """The replica whose range holds ``position`` (in ``[0, total)``): the last with ``_cut(piece) <= position``."""
        return min(len(self.holders) - 1, ((position + 1) * len(self.holders) - 1) // self.total)

    def _row(self, j: int, position: int) -> int:
        """The row boundary of unit ``j`` at or below ``position``, clamped to the unit."""
        unit = self.units[j]
        return min(unit.rows, max(0, (position - self.starts[j]) // max(1, unit.row_bytes)))


def split_runs(units: Iterable[tuple[int, ShardingUnit]]) -> list[SplitRun]:
    """The :class:`SplitRun` of each set of holders among ``units`` ((position, unit) pairs), in first-seen order."""
    groups: dict[Holders, list[tuple[int, ShardingUnit]]] = {}
    for index, unit in units:
        groups.setdefault(unit.holders, []).append((index, unit))
    return [SplitRun.of(holders, members) for holders, members in groups.items()]


def split_loads(units: Iterable[ShardingUnit], world_size: int) -> list[int]:
    """Bytes each rank writes of ``units`` cut as runs over their holders (:class:`SplitRun`), in the given order.
    O(units + holders of each set): O(units + ranks) for the experts, whose EP rank's replicas are their holders."""
    loads = [0] * world_size
    for run in split_runs(enumerate(units)):
        run.add_loads(loads)
    return loads


@dataclass(frozen=True)
class Ownership:
    """Who writes what: for every unit, shards that cover its rows exactly once, each by one of its holders."""

    strategy: str
    topology: Topology
    units: tuple[ShardingUnit, ...]
    placed: tuple[tuple[Shard, ...] | None, ...]
    """``placed[i]``: the shards of ``units[i]`` where they were placed (dense units; every unit under ``rank0`` and
    ``dcp_default``); ``None``: cut with the other units of its holders as one run (:class:`SplitRun`, the experts
    under ``equal`` and ``adaptive``), derived where asked, so that no rank builds every replica's shards."""
    runs: tuple[SplitRun, ...]
    """The runs of the units ``placed`` leaves to the split, one per set of holders."""
    rank_bytes: tuple[int, ...]
    """Bytes each rank writes."""
    _writes: dict[int, tuple[tuple[ShardingUnit, Shard], ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Each rank's writes, once asked for."""

    @cached_property
    def shards(self) -> tuple[tuple[Shard, ...], ...]:
        """``shards[i]`` partitions ``[0, units[i].rows)``; an empty unit has one empty shard, so it has a writer.

        Every rank's shards of every unit (O(units + ranks) for units cut as runs); a rank's own are
        :meth:`writes_of`."""
        return tuple(self._shards_at(i) for i in range(len(self.units)))

    def shards_of(self, key: str) -> tuple[Shard, ...]:
        """The shards of the unit named ``key``."""
        try:
            return self._shards_at(self._index_of_key[key])
        except KeyError:
            raise KeyError(f"no unit with key {key!r} in this ownership") from None

    def writes_of(self, rank: int) -> tuple[tuple[ShardingUnit, Shard], ...]:
        """What ``rank`` writes: (unit, shard) pairs, in unit order. O(units), whatever the world size (each run's
        piece found by bisection)."""
        if not 0 <= rank < self.topology.world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={self.topology.world_size})")
        if rank not in self._writes:
            self._writes[rank] = self._writes_of(rank)
        return self._writes[rank]

    @property
    def total_bytes(self) -> int:
        return sum(self.rank_bytes)

    @property
    def busiest_bytes(self) -> int:
        """Bytes of the bottleneck rank, which sets how long the checkpoint takes."""
        return max(self.rank_bytes)

    @property
    def ideal_bytes(self) -> float:
        """Bytes per rank if the total were spread perfectly evenly."""
        return self.total_bytes / self.topology.world_size

    def _shards_at(self, index: int) -> tuple[Shard, ...]:
        placed = self.placed[index]
        if placed is not None:
            return placed
        run, j = self._run_of[index]
        return run.unit_shards(j)

    @cached_property
    def _run_of(self) -> dict[int, tuple[SplitRun, int]]:
        """Unit index -> its run and its position there."""
        return {index: (run, j) for run in self.runs for j, index in enumerate(run.indices)}

    @cached_property
    def _index_of_key(self) -> dict[str, int]:
        return {unit.key: i for i, unit in enumerate(self.units)}

    @cached_property
    def _placed_by_rank(self) -> dict[int, list[tuple[int, Shard]]]:
        """(unit index, shard) of every placed shard, by rank: O(units + ranks) shards in all (pouring gives a rank
        at most one block of each unit)."""
        by_rank: dict[int, list[tuple[int, Shard]]] = {}
        for index, shards in enumerate(self.placed):
            for shard in shards or ():
                by_rank.setdefault(shard.rank, []).append((index, shard))
        return by_rank

    def _writes_of(self, rank: int) -> tuple[tuple[ShardingUnit, Shard], ...]:
        """The rank's piece of each run it holds and its placed shards from the index, merged into unit order."""
        mine = list(self._placed_by_rank.get(rank, ()))
        for run in self.runs:
            if rank in run.holders:
                mine += [(run.indices[j], shard) for j, shard in run.piece_shards(run.holders.index(rank))]
        mine.sort(key=lambda pair: pair[0])
        return tuple((self.units[index], shard) for index, shard in mine)


Assignment = dict[int, tuple[Shard, ...]]
"""Shards of the units a strategy places, keyed by the unit's position in the input (an expert left to the split
over its holders, :class:`SplitRun`, is left out)."""


def _whole(unit: ShardingUnit, rank: int) -> tuple[Shard, ...]:
    return (Shard(rank, 0, unit.rows),)


def _rank_bytes(units: Sequence[ShardingUnit], assignment: Assignment, world_size: int) -> list[int]:
    loads = [0] * world_size
    for i, shards in assignment.items():
        for shard in shards:
            loads[shard.rank] += shard.rows * units[i].row_bytes
    return loads


def _is_oversized(unit: ShardingUnit, dense_bytes: int, world_size: int) -> bool:
    """Bigger than the dense share ``dense_bytes / world_size``, compared exactly in integers."""
    return unit.nbytes * world_size > dense_bytes


def _pop_lightest_holder(heap: list[tuple[int, int]], holders: range | tuple[int, ...]) -> tuple[int, int]:
    """Pop the (bytes, rank) entry of the holder with the fewest bytes; other ranks go back on the heap.

    With dense units held everywhere nothing is set aside, so this costs O(log ranks).
    """
    skipped: list[tuple[int, int]] = []
    entry = heapq.heappop(heap)
    while entry[1] not in holders:
        skipped.append(entry)
        entry = heapq.heappop(heap)
    for other in skipped:
        heapq.heappush(heap, other)
    return entry


def _place_whole(unit: ShardingUnit, heap: list[tuple[int, int]]) -> tuple[Shard, ...]:
    """The whole unit onto its holder with the fewest bytes so far."""
    load, rank = _pop_lightest_holder(heap, unit.holders)
    heapq.heappush(heap, (load + unit.nbytes, rank))
    return _whole(unit, rank)


def _pour(unit: ShardingUnit, heap: list[tuple[int, int]], line: int, world_size: int) -> tuple[Shard, ...]:
    """Consecutive row blocks of an oversized unit onto its lightest holders, each filled up to the ideal line.

    ``line`` is ``world_size`` times the ideal line, so rooms are exact integers. A room is rounded up to
    whole rows, so a block lifts its rank at most one row above the line. Each block goes to a different
    rank (its entry stays off the heap until the unit is done); the last holder, or a lightest holder
    already on the line (possible only when the unit is not held everywhere), takes all remaining rows.
    """
    shards: list[Shard] = []
    filled: list[tuple[int, int]] = []
    start = 0
    while start < unit.rows:
        load, rank = _pop_lightest_holder(heap, unit.holders)
        room = -(-(line - world_size * load) // (world_size * unit.row_bytes))
        last = room <= 0 or len(shards) == len(unit.holders) - 1
        stop = unit.rows if last else min(unit.rows, start + room)
        shards.append(Shard(rank, start, stop))
        filled.append((load + (stop - start) * unit.row_bytes, rank))
        start = stop
    for entry in filled:
        heapq.heappush(heap, entry)
    return tuple(shards)


def _place_dense(units: Sequence[ShardingUnit], loads: Sequence[int], pour: bool = True) -> Assignment:
    """Dense units onto the ranks with the fewest bytes, starting from ``loads``; oversized ones poured last.

    Whole units go first, largest first, each onto its lightest holder (LPT greedy); then each oversized
    unit, largest first, is poured into the gaps they leave below the ideal line, ``(sum(loads) + dense
    bytes) / world_size``: divisible bytes placed after indivisible ones can level what whole units cannot.
    With ``pour=False`` nothing counts as oversized: every unit stays whole (the paper's layer granularity).
    Ties go to the earlier unit and the lower rank, so every rank computes the same placement.
    """
    world_size = len(loads)
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    dense = [i for i, unit in enumerate(units) if unit.kind == "dense"]
    dense_bytes = sum(units[i].nbytes for i in dense)
    oversized = {i for i in dense if pour and _is_oversized(units[i], dense_bytes, world_size)}
    line = sum(loads) + dense_bytes
    assignment: Assignment = {}
    for i in sorted(dense, key=lambda i: (i in oversized, -units[i].nbytes)):
        if i in oversized:
            assignment[i] = _pour(units[i], heap, line, world_size)
        else:
            assignment[i] = _place_whole(units[i], heap)
    return assignment


def _equal_experts(
    units: Sequence[ShardingUnit], world_size: int, base_loads: Sequence[int] | None, pour: bool
) -> Assignment:
    """Experts cut as runs over their holders (left out: :attr:`Ownership.placed` derives them); dense units placed
    ignoring the rest (``base_loads=None``), or onto the ranks with the fewest bytes counting ``base_loads`` and the
    expert shards (:func:`split_loads`)."""
    if base_loads is None:
        return _place_dense(units, [0] * world_size, pour)
    expert_loads = split_loads((unit for unit in units if unit.kind == "expert"), world_size)
    loads = [base + load for base, load in zip(base_loads, expert_loads, strict=True)]
    return _place_dense(units, loads, pour)


def _equal(units: Sequence[ShardingUnit], world_size: int) -> Assignment:
    """Dense placement from zero loads: fixed once for the dense units, whatever the selection (section 4.2)."""
    return _equal_experts(units, world_size, None, pour=True)


def _adaptive(units: Sequence[ShardingUnit], world_size: int) -> Assignment:
    """Dense placement from the expert loads this selection leaves (section 4.3)."""
    return _equal_experts(units, world_size, [0] * world_size, pour=True)


def _rank0(units: Sequence[ShardingUnit], world_size: int) -> Assignment:
    """Lowest holder writes: rank 0 for dense units, the EP-group-0 replica for experts (Figure 7a)."""
    return {i: _whole(unit, unit.holders[0]) for i, unit in enumerate(units)}


def _dcp_default(units: Sequence[ShardingUnit], world_size: int) -> Assignment:
    """``dedup_save_plans`` of torch 2.13, with each unit as one write item held by its holders.

    DCP visits write items in first-seen order over the ranks' plans (rank 0's items, then rank 1's new
    ones, ...); with every rank listing its units in input order, that is the input stably sorted by lowest
    holder. Each item goes whole to the holder with the smallest planned size so far, ties resolved in the
    iteration order of a Python ``set`` of the holders filled in ascending order, exactly as DCP builds it;
    an empty item counts as 1 byte, as in DCP. Approximation: real DCP sees one item per tensor (each
    parameter and each optimizer-state tensor), so it balances at a finer grain than one item per unit.
    """
    plan_size = [0] * world_size
    assignment: Assignment = {}
    for i in sorted(range(len(units)), key=lambda i: units[i].holders[0]):
        unit = units[i]
        rank = min(set(unit.holders), key=plan_size.__getitem__)
        plan_size[rank] += unit.nbytes or 1
        assignment[i] = _whole(unit, rank)
    return assignment


_STRATEGIES: Mapping[str, Callable[[Sequence[ShardingUnit], int], Assignment]] = {
    "equal": _equal,
    "adaptive": _adaptive,
    "rank0": _rank0,
    "dcp_default": _dcp_default,
}
STRATEGIES: tuple[str, ...] = tuple(_STRATEGIES)
"""Names accepted by ``plan_ownership``."""


def _check_inputs(units: Sequence[ShardingUnit], topology: Topology, strategy: str) -> None:
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    _check_units(units, topology)


def _check_units(units: Sequence[ShardingUnit], topology: Topology) -> None:
    seen: set[str] = set()
    for unit in units:
        if unit.key in seen:
            raise ValueError(f"unit key {unit.key!r} appears twice; keys must be unique")
        seen.add(unit.key)
        if unit.holders[-1] >= topology.world_size:
            raise ValueError(
                f"unit {unit.key!r} names holder rank {unit.holders[-1]}, "
                f"outside world_size={topology.world_size}"
            )


def _ownership(
    strategy: str, topology: Topology, units: tuple[ShardingUnit, ...], assignment: Assignment
) -> Ownership:
    """The ownership of ``units`` from the placed ones' shards; every unit ``assignment`` leaves out is an expert
    cut with the others of its holders (:class:`SplitRun`)."""
    runs = tuple(split_runs((i, unit) for i, unit in enumerate(units) if i not in assignment))
    assert all(unit.kind == "expert" for run in runs for unit in run.units), "only experts are cut as runs implicitly"
    loads = _rank_bytes(units, assignment, topology.world_size)
    for run in runs:
        run.add_loads(loads)
    return Ownership(
        strategy=strategy,
        topology=topology,
        units=units,
        placed=tuple(assignment.get(i) for i in range(len(units))),
        runs=runs,
        rank_bytes=tuple(loads),
    )


def compute_ownership(units: Sequence[ShardingUnit], topology: Topology, strategy: str) -> Ownership:
    """Ownership of ``units`` under ``strategy`` (one of ``STRATEGIES``), computed afresh.

    Under ``equal`` and ``adaptive``, O(units + ranks) (the module's cost at scale); ``rank0`` is O(units) and
    ``dcp_default`` O(unit holders). Prefer the cached ``plan_ownership``.
    """
    units = tuple(units)
    _check_inputs(units, topology, strategy)
    return _ownership(strategy, topology, units, _STRATEGIES[strategy](units, topology.world_size))


def equal_experts_ownership(
    units: Sequence[ShardingUnit],
    topology: Topology,
    *,
    label: str,
    base_loads: Sequence[int] | None,
    pour: bool,
) -> Ownership:
    """Experts split equally over their holders (EE, as runs: :class:`SplitRun`), dense units placed as the paper's
    EN or AN.

    For state that other bytes share the ranks with, such as ZeRO optimizer partitions each rank writes
    itself (``moc_lightning.sharding.paper_accounting``). ``base_loads=None``: dense units placed ignoring everything
    else (EN, section 4.2). Else dense units go onto the ranks with the fewest bytes counting ``base_loads``
    (bytes each rank writes besides ``units``) and the expert shards (AN, section 4.3). ``pour=False`` keeps
    every dense unit whole (the paper's layer granularity); ``pour=True`` pours oversized ones in row blocks,
    as ``equal`` and ``adaptive`` do. ``rank_bytes`` of the result counts ``units`` only; ``label`` names it.
    """
    units = tuple(units)
    _check_units(units, topology)
    if base_loads is not None and (
        len(base_loads) != topology.world_size or any(load < 0 for load in base_loads)
    ):
        raise ValueError(
            f"base_loads must give bytes >= 0 for each of world_size={topology.world_size} ranks; "
            f"got {len(base_loads)} values, smallest {min(base_loads, default=None)}"
        )
    return _ownership(label, topology, units, _equal_experts(units, topology.world_size, base_loads, pour))


_cached_ownership = lru_cache(maxsize=32)(compute_ownership)
"""32 entries hold a full rotation of both levels' selections (ceil(N/K) each) for N <= 16 experts."""


@lru_cache(maxsize=32)
def _adaptive_around(units: tuple[ShardingUnit, ...], topology: Topology, base_loads: tuple[int, ...]) -> Ownership:
    return equal_experts_ownership(units, topology, label="adaptive", base_loads=base_loads, pour=True)


def forget_plans() -> None:
    """Drop every cached plan, so that the next ``plan_ownership`` computes afresh (what the scale report times)."""
    _cached_ownership.cache_clear()
    _adaptive_around.cache_clear()


def plan_ownership(
    units: Sequence[ShardingUnit],
    topology: Topology,
    strategy: str = "adaptive",
    base_loads: Sequence[int] | None = None,
) -> Ownership:
    """Ownership of ``units`` under ``strategy``, reused while the same units and topology come back.

    ``base_loads``: bytes each rank writes besides ``units`` (under ZeRO, the optimizer partitions each owner
    writes itself). ``adaptive`` places the dense units onto the ranks with the fewest bytes counting them, as
    it counts the experts the selection put on a rank; the other strategies place as they always do.
    ``rank_bytes`` of the result counts ``units`` only.
    """
    if base_loads is not None and strategy == "adaptive":
        return _adaptive_around(tuple(units), topology, tuple(base_loads))
    return _cached_ownership(tuple(units), topology, strategy)
