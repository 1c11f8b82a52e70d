"""The control plane at simulated world sizes, in one process, with the library's own functions (issue 30, item 1).

DESIGN.md, Scale: at 16,384 ranks and a DeepSeek-V3-shaped model, a rank's plan costs O(units + ranks), runs off the
training thread and takes under a second; a recovery exchanges O(units) per rank; a snapshot runs no collective whose
cost grows with world size. Nothing here re-implements the engine: every figure comes from calling its functions on
synthetic inputs of the simulated size (the paper's setting, ZeRO-2 + EP in bf16 with fp32 master and moments):

- ``plan_s``: one rank's write plan, :func:`~moc_lightning.pec.write_plan.zero_weights_ownership` over the engine's
  units (rows = the longest dim 0, as :class:`~moc_lightning.pec.write_plan.WritePlan` sizes them) and the rank's
  ``writes_of``, uncached; the ZeRO owners come from :func:`~moc_lightning.sharding.zero.lpt_owners`
  (``zero_owners_s``, once per layout). ``plan_memory_bytes``: the peak Python allocation of that plan (tracemalloc).
  That ownership is the plan of a persist from the live tensors (the final persist; the PEC engine used alone); a
  periodic persist from a snapshot slot writes the slot's own units whole, with no ownership to compute.
  ``plan_on_training_thread`` / ``plan_thread``: where a real engine's periodic persist plans
  (:func:`with_plan_threads`, :mod:`moc_lightning.tools.plan_threads`); null from :func:`simulate` alone.
- ``coordinator_plan_s`` / ``metadata_bytes``: every simulated rank's local plan from
  :class:`~moc_lightning.sharding.planner.MoCSavePlanner` over meta tensors of the real shapes, then the coordinator's
  ``create_global_plan`` and the sealed ``.metadata`` (:func:`~moc_lightning.storage.integrity.metadata_bytes`). The
  ``dcp_*`` fields are DCP's own default (every rank proposes what it holds, ``dedup_save_plans`` picks) measured the
  same way (on the same ranks, alternating with ours, the best of a few trials). Above ``item_cap`` write items the
  plans are not built (their memory); the field is null, its ``*_reason`` gives a linear extrapolation from the
  largest measured size of the same model and K, and ``coordinator_plan_s_estimate`` / ``metadata_bytes_estimate``
  (``dcp_`` likewise) give it as numbers.
- ``manifest_bytes`` / ``commit_s``: a manifest of ``retention`` records of the rotation, and the coordinator's
  :class:`~moc_lightning.pec.commit.ManifestCommit` to a temporary filesystem storage, the self-description shaped as
  the persister's (every weight key's parameter source).
- ``inventory_bytes_per_rank`` / ``recovery_exchange_bytes`` / ``recovery_plan_s``: each rank's
  :class:`~moc_lightning.memory.recovery.SlotInventory` list for three committed slots, pickled as
  ``all_gather_object`` pickles it (which pads every rank's to the largest: each rank receives world x largest), and
  :func:`~moc_lightning.memory.recovery.plan_recovery` over all of them.
- ``snapshot_collectives`` / ``snapshot_collective_bytes`` / ``snapshot_blocking_collectives``: what the training
  thread sends per snapshot once persists run, and how much of it it waits for, counted by running the snapshot's own
  collectives (:func:`snapshot_path_collectives`: the persist vote started the step before,
  :class:`~moc_lightning.memory.persist_vote.PersistVote`, and the start of the router counts' sum,
  :meth:`~moc_lightning.pec.tokens.TokenAccounting.start_mark`) against a recording stand-in of ``torch.distributed``
  of the simulated size.
"""

from __future__ import annotations

import gc
import itertools
import math
import pickle
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import UnitBytes
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.engine.selection import SequentialSelection
from moc_lightning.engine.slots import param_key, state_key
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit
from moc_lightning.memory.persist_vote import PersistVote
from moc_lightning.memory.persisting import PersistQueue
from moc_lightning.memory.recovery import SlotInventory, plan_recovery
from moc_lightning.memory.snapshot import NUM_SLOTS
from moc_lightning.memory.stats import CheckpointStats
from moc_lightning.pec.commit import ManifestCommit
from moc_lightning.pec.stored import MANIFEST
from moc_lightning.pec.tokens import TokenAccounting
from moc_lightning.pec.write_plan import zero_weights_ownership
from moc_lightning.replay.core import window_schedule
from moc_lightning.runtime.distributed import agreement_group
from moc_lightning.runtime.expert_parallel import ep_position
from moc_lightning.sharding.ownership import (
    Ownership,
    ShardingUnit,
    Topology,
    forget_plans,
)
from moc_lightning.sharding.planner import MoCSavePlanner, shard_rows
from moc_lightning.sharding.zero import lpt_owners
from moc_lightning.storage.filesystem import ChecksummedStorageInfo, FilesystemStorage
from moc_lightning.storage.integrity import metadata_bytes
from moc_lightning.tools.moe_shapes import (
    DeepSeekV3Shape,
    GptMoeShape,
    MoeShape,
    TensorShapes,
    numel,
)
from moc_lightning.tools.plan_threads import plan_threads

WEIGHT_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
"""Adam's state of a bf16 parameter under ZeRO (:class:`~moc_lightning.sharding.zero.ZeroAdamW`), besides ``step``."""
ITEM_CAP = 600_000
"""Write items above which the simulated DCP plans are not built (about 1 KB of Python objects each)."""
TRIALS = 3
"""Timings of each coordinator plan, alternating ours and DCP's, of which the best counts."""
REPEAT_BELOW_S = 5.0
"""A coordinator plan slower than this is timed once."""
TARGETS = {
    "plan_s": 1.0,
    "coordinator_plan_s": 10.0,
    "recovery_plan_s": 5.0,
    "recovery_exchange_bytes": 1e9,
}
"""Issue 30's targets at 16,384 ranks, DeepSeek-V3-shaped, K = N (and snapshot bytes independent of world size)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as the control plane sees it: its units' tensor shapes, expert counts and EP degree."""

    name: str
    shape: MoeShape
    ep: int

    @property
    def num_experts(self) -> tuple[int, ...]:
        return (self.shape.experts,) * len(self.shape.moe_layers)


MODELS: dict[str, ModelSpec] = {
    "gpt350m16e": ModelSpec("GPT-350M-16E", GptMoeShape(), ep=16),
    "deepseekv3": ModelSpec("DeepSeek-V3-shaped", DeepSeekV3Shape(), ep=64),
}
"""GPT-350M-16E (Table 2's model; EP 16 at the simulated sizes, its expert count) and DeepSeek-V3 (EP 64)."""


class _Model:
    """The engine's view of one model: unit keys, their tensors' state-dict keys and shapes, sizes and rows.

    Each unit's sizes are worked out once, as the write plan sizes each layer's experts once per plan from a local
    twin (:meth:`~moc_lightning.pec.write_plan.WritePlan._plan_sizes`): every expert has the same shape."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        shape = spec.shape
        self.dense: list[tuple[Unit, TensorShapes]] = [(DenseUnit(n), t) for n, t in shape.dense_tensors()]
        self.expert_tensors = shape.expert_tensors()
        self.experts = [ExpertUnit(layer, e) for layer, n in enumerate(spec.num_experts) for e in range(n)]
        self._dense_tensors = dict(self.dense)
        self._sizes = {unit.key: _sizes(tensors) for unit, tensors in self.dense} | {
            EXPERT: _sizes(self.expert_tensors)
        }

    def tensors(self, unit: Unit) -> TensorShapes:
        return self.expert_tensors if isinstance(unit, ExpertUnit) else self._dense_tensors[unit]

    def weight_bytes(self, unit: Unit) -> int:
        return self._sized(unit).weight_bytes

    def state_bytes(self, unit: Unit) -> int:
        """fp32 master and moments of every parameter, and its fp32 ``step`` (ZeroAdamW.state_nbytes)."""
        return self._sized(unit).state_bytes

    def rows(self, unit: Unit) -> int:
        """The longest dim 0 of the unit's tensors, as the write plan splits units."""
        return self._sized(unit).rows

    def _sized(self, unit: Unit) -> _UnitSizes:
        return self._sizes[EXPERT if isinstance(unit, ExpertUnit) else unit.key]

    def weights_unit(self, unit: Unit, topology: Topology) -> ShardingUnit:
        """The unit's weights as :meth:`WritePlan._sharding_unit` builds them (rows, bytes per row, holders)."""
        rows = self.rows(unit)
        row_bytes = max(1, math.ceil(self.weight_bytes(unit) / rows))
        if isinstance(unit, DenseUnit):
            return ShardingUnit(unit.key, "dense", rows, row_bytes, topology.ranks())
        assert isinstance(unit, ExpertUnit)
        holders = topology.replicas(ep_position(unit.expert, self.spec.shape.experts, topology.ep))
        return ShardingUnit(unit.key, "expert", rows, row_bytes, holders, layer=unit.layer, expert=unit.expert)

    def meta(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's weights and ZeRO state as meta tensors under the engine's state-dict keys (no memory)."""
        out: dict[str, torch.Tensor] = {}
        for local, shape in self.tensors(unit):
            out[param_key(unit, local)] = torch.empty(shape, dtype=WEIGHT_DTYPE, device="meta")
            for name in STATE_NAMES:
                out[state_key(unit, local, name)] = torch.empty(shape, dtype=STATE_DTYPE, device="meta")
            out[state_key(unit, local, "step")] = torch.empty((), dtype=STATE_DTYPE, device="meta")
        return out


class _UnitSizes(NamedTuple):
    rows: int
    weight_bytes: int
    state_bytes: int


EXPERT = "expert"
"""The sizes key every expert shares (all have one shape)."""


def _sizes(tensors: TensorShapes) -> _UnitSizes:
    """Rows (the longest dim 0), bf16 weight bytes, and ZeRO state bytes: fp32 master and moments of every
    parameter, and its fp32 ``step`` (``ZeroAdamW.state_nbytes``)."""
    params = numel(tensors)
    return _UnitSizes(
        rows=max(shape[0] for _, shape in tensors),
        weight_bytes=params * WEIGHT_DTYPE.itemsize,
        state_bytes=params * STATE_DTYPE.itemsize * len(STATE_NAMES) + STATE_DTYPE.itemsize * len(tensors),
    )


def _selections(spec: ModelSpec, k: int, count: int) -> list[tuple[tuple[int, ...], ...]]:
    """The experts of the first ``count`` checkpoints of the sequential selection (snapshot = persist, K each)."""
    policy = SequentialSelection(num_experts=list(spec.num_experts), ep_degree=spec.ep)
    return [policy.select(index, k, k).persist for index in range(count)]


def _units(model: _Model, selection: Sequence[Sequence[int]]) -> list[Unit]:
    return [unit for unit, _ in model.dense] + [ExpertUnit(layer, e) for layer, es in enumerate(selection) for e in es]


def _zero_owners(model: _Model, topology: Topology) -> dict[str, int]:
    """Every unit's ZeRO owner as every EP rank's :func:`partition_by_units` places them: dense over all ranks, then
    each EP rank's experts over its replicas, from the dense loads (the same on every rank)."""
    loads = [0] * topology.world_size
    owners = lpt_owners([(u.key, numel(t)) for u, t in model.dense], topology.ranks(), loads)
    experts = model.spec.shape.experts
    for ep_rank in range(topology.ep):
        mine = [(u.key, numel(model.expert_tensors)) for u in model.experts
                if ep_position(u.expert, experts, topology.ep) == ep_rank]
        owners |= lpt_owners(mine, topology.replicas(ep_rank), list(loads))
    return owners


def _plan(model: _Model, units: Sequence[Unit], owners: Mapping[str, int], topology: Topology) -> Ownership:
    """One rank's write plan (``WritePlan._zero_writes`` without the tensors): sharding units, then the ownership."""
    weights = [model.weights_unit(unit, topology) for unit in units]
    states = [(owners[unit.key], model.state_bytes(unit)) for unit in units]
    return zero_weights_ownership(weights, states, topology, "adaptive")


def time_plan(model: _Model, units: Sequence[Unit], owners: Mapping[str, int], topology: Topology) -> dict[str, Any]:
    """``plan_s`` (uncached, best of two when fast) and ``plan_memory_bytes`` of rank 0's write plan."""
    seconds = []
    for _ in range(2):
        forget_plans()
        gc.collect()
        start = time.perf_counter()
        ownership = _plan(model, units, owners, topology)
        ownership.writes_of(0)
        seconds.append(time.perf_counter() - start)
        if seconds[-1] > 2:
            break
    forget_plans()
    tracemalloc.start()
    _plan(model, units, owners, topology).writes_of(0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    forget_plans()
    return {"plan_s": min(seconds), "plan_memory_bytes": peak, "ownership": ownership}


@dataclass(frozen=True)
class RankBytes:
    """What a checkpoint of K experts per layer moves per rank under ZeRO-2 + EP, as the engine places the model's
    shape on the simulated ranks, and what a recovery and replay mode's window move. A synchronous job waits for its
    busiest rank, so the projection at scale (:mod:`moc_lightning.tools.scale_projection`) takes the maxima."""

    snapshot_max: int
    """The busiest rank's snapshot: weights and optimizer state of the selected units it is the ZeRO owner of (a
    checkpoint snapshots each unit whole on its owner)."""
    snapshot_total: int
    """Every rank's snapshot together."""
    persist_max: int
    """The busiest rank's persist: its owned units' optimizer state and its rows of their weights (the write plan)."""
    persist_total: int
    """Every rank's persist together."""
    state_total: int
    """Weights and optimizer state of every unit: what a recovery restores."""
    restore_max: int
    """What the busiest rank copies in restoring every unit from memory: the weights of the units it holds (every dense
    unit and the experts of its EP position), each broadcast to its holders only, and the optimizer state it keeps as
    their ZeRO owner, from its own slot (:meth:`~moc_lightning.memory.restoring.MemoryRestore.restore`)."""
    restore_units_max: int
    """Units the busiest rank takes part in restoring from memory, one broadcast each."""


def rank_bytes(spec: ModelSpec, world_size: int, k: int) -> RankBytes:
    """:class:`RankBytes` of ``spec`` on ``world_size`` ranks, checkpoints of ``k`` experts per layer (the first of the
    sequential selection), from the same owners and write plan :func:`simulate` times."""
    model, topology = _Model(spec), Topology(world_size, spec.ep)
    owners = _zero_owners(model, topology)
    units = _units(model, _selections(spec, k, 1)[0])
    snapshot, state = [0] * world_size, [0] * world_size
    for unit in units:
        snapshot[owners[unit.key]] += model.weight_bytes(unit) + model.state_bytes(unit)
        state[owners[unit.key]] += model.state_bytes(unit)
    ownership = _plan(model, units, owners, topology)
    persist = [own + weights for own, weights in zip(state, ownership.rank_bytes)]
    every = [unit for unit, _ in model.dense] + list(model.experts)
    forget_plans()
    dense = [unit for unit, _ in model.dense]
    held_bytes, held_units = [sum(model.weight_bytes(u) for u in dense)] * spec.ep, [len(dense)] * spec.ep
    for unit in model.experts:  # an expert's holders: the ranks at its EP position
        position = ep_position(unit.expert, spec.num_experts[unit.layer], spec.ep)
        held_bytes[position] += model.weight_bytes(unit)
        held_units[position] += 1
    kept = [0] * world_size
    for unit in every:
        kept[owners[unit.key]] += model.state_bytes(unit)
    return RankBytes(
        snapshot_max=max(snapshot),
        snapshot_total=sum(snapshot),
        persist_max=max(persist),
        persist_total=sum(persist),
        state_total=sum(model.weight_bytes(u) + model.state_bytes(u) for u in every),
        restore_max=max(held + max(kept[r] for r in topology.replicas(p)) for p, held in enumerate(held_bytes)),
        restore_units_max=max(held_units),
    )


@dataclass(frozen=True)
class ReplayBytes:
    """What replay mode's captures copy per rank over a window (:mod:`moc_lightning.replay.core`): at offset t, the
    full state a rank has of the units active at t (weights, and optimizer state on their ZeRO owner) and the weights
    of the units it holds that are still frozen."""

    window: int
    """W, iterations per window."""
    capture_max: tuple[int, ...]
    """Per offset of the window, the busiest rank's capture."""
    window_max: int
    """The busiest rank's captures over a whole window: what a recovery restores and replays from."""


def replay_bytes(spec: ModelSpec, world_size: int, window: int) -> ReplayBytes:
    """:class:`ReplayBytes` of ``spec`` on ``world_size`` ranks, with the engine's own window schedule
    (:func:`~moc_lightning.replay.core.window_schedule` over whole units' sizes) and ZeRO owners."""
    model, topology = _Model(spec), Topology(world_size, spec.ep)
    owners = _zero_owners(model, topology)
    every = [unit for unit, _ in model.dense] + list(model.experts)
    sizes = {u: UnitBytes(model.weight_bytes(u), model.state_bytes(u), numel(model.tensors(u))) for u in every}
    schedule = window_schedule(every, window, sizes)
    weights = [[0] * window for _ in range(spec.ep)]  # per EP rank and offset: the held weights copied there
    owned = [[0] * window for _ in range(world_size)]  # per rank and offset: the optimizer state copied there
    for unit in every:
        holders: Sequence[int] = range(spec.ep)
        if isinstance(unit, ExpertUnit):
            holders = [ep_position(unit.expert, spec.shape.experts, spec.ep)]
        for ep_rank in holders:
            for t in range(schedule[unit] + 1):
                weights[ep_rank][t] += sizes[unit].weights
        owned[owners[unit.key]][schedule[unit]] += sizes[unit].optimizer
    captures = [[weights[rank % spec.ep][t] + owned[rank][t] for t in range(window)] for rank in range(world_size)]
    return ReplayBytes(
        window=window,
        capture_max=tuple(max(c[t] for c in captures) for t in range(window)),
        window_max=max(sum(c) for c in captures),
    )


def _write_items(ownership: Ownership, model: _Model, owners: Mapping[str, int], dcp_default: bool) -> int:
    """Write items the ranks' local plans will hold, counted from the ownership without building them (one unit's
    shards at a time: every rank's at once is what a rank's plan no longer builds)."""
    per_unit = {unit.key: len(model.tensors(u)) for unit, u in zip(ownership.units, _units_of(ownership))}
    if dcp_default:  # every holder proposes every weight; owners their state (a scalar step per tensor too)
        weights = sum(len(unit.holders) * per_unit[unit.key] for unit in ownership.units)
    else:
        weights = sum(len(ownership.shards_of(unit.key)) * per_unit[unit.key] for unit in ownership.units)
    return weights + sum(per_unit.values()) * (len(STATE_NAMES) + 1)


def _units_of(ownership: Ownership) -> list[Unit]:
    return [
        DenseUnit(u.key.removeprefix("dense/")) if u.kind == "dense" else ExpertUnit(u.layer or 0, u.expert or 0)
        for u in ownership.units
    ]


def _local_plans(
    ownership: Ownership, model: _Model, owners: Mapping[str, int], dcp_default: bool
) -> tuple[list[SavePlan], MoCSavePlanner]:
    """Every simulated rank's local plan from the real planner over meta tensors; the coordinator's planner."""
    by_rank: dict[int, tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]] = {}
    units = _units_of(ownership)
    for unit, sharding, shards in zip(units, ownership.units, ownership.shards):
        tensors = model.meta(unit)
        weights = {k: t for k, t in tensors.items() if "/optim/" not in k}
        state = {k: t for k, t in tensors.items() if "/optim/" in k}
        holders = sharding.holders if dcp_default else [s.rank for s in shards]
        for index, rank in enumerate(holders):
            held, writes = by_rank.setdefault(rank, ({}, {}))
            held.update(weights)
            if not dcp_default:
                for key, tensor in weights.items():
                    rows = shard_rows(shards[index], sharding.rows, tensor)
                    if rows is not None:
                        writes[key] = rows
        held, writes = by_rank.setdefault(owners[unit.key], ({}, {}))
        held.update(state)
        writes.update({k: (0, 1) if t.dim() == 0 else (0, t.shape[0]) for k, t in state.items()})
    plans, coordinator = [], MoCSavePlanner(None)
    for rank in range(ownership.topology.world_size):
        held, writes = by_rank.get(rank, ({}, {}))
        planner = MoCSavePlanner(None if dcp_default else writes)
        planner.set_up_planner(held, None, rank == 0)
        plans.append(planner.create_local_plan())
        coordinator = planner if rank == 0 else coordinator
    return plans, coordinator


def _sealed_metadata(metadata: Metadata, plans: Sequence[SavePlan]) -> int:
    """Bytes of the ``.metadata`` :class:`DurableFileSystemWriter` publishes: every item's file, offset, length,
    checksum, dtype and shape."""
    results = [[_result(rank, offset, item) for offset, item in enumerate(p.items)] for rank, p in enumerate(plans)]
    return len(metadata_bytes(metadata, results, None))


def _result(rank: int, offset: int, item: WriteItem) -> WriteResult:
    data = item.tensor_data
    dtype, shape = (str(data.properties.dtype), tuple(data.chunk.sizes)) if data is not None else ("", ())
    info = ChecksummedStorageInfo(f"__{rank}_0.distcp", offset, 0, crc32c=0, dtype=dtype, shape=shape)
    return WriteResult(item.index, 0, info)


def coordinator_plans(
    ownership: Ownership, model: _Model, owners: Mapping[str, int], item_cap: int
) -> dict[bool, dict[str, Any]]:
    """The coordinator's global plan over every rank's local plan, and ``.metadata``'s size, for ours (``False``) and
    DCP's default (``True``) on the same simulated ranks; null above the cap. Timed alternately, ours then DCP's, the
    best of :data:`TRIALS` for a plan under :data:`REPEAT_BELOW_S` (this machine's load moves one timing 2-3x)."""
    built: dict[bool, tuple[list[SavePlan], MoCSavePlanner]] = {}
    result: dict[bool, dict[str, Any]] = {}
    for dcp_default in (False, True):
        items = _write_items(ownership, model, owners, dcp_default)
        result[dcp_default] = {"items": items, "seconds": None, "metadata_bytes": None}
        if items <= item_cap:
            built[dcp_default] = _local_plans(ownership, model, owners, dcp_default)
    gc.collect()  # once: a full collection with every simulated plan alive takes about a second
    for trial in range(TRIALS):
        for dcp_default, (plans, planner) in built.items():
            timed = result[dcp_default]
            if trial and timed["seconds"] > REPEAT_BELOW_S:
                continue
            start = time.perf_counter()
            global_plans, metadata = planner.create_global_plan(plans)
            seconds = time.perf_counter() - start
            timed["seconds"] = seconds if timed["seconds"] is None else min(timed["seconds"], seconds)
            if trial == 0:
                timed["items"] = sum(1 for p in global_plans for item in p.items if item.type != WriteItemType.BYTE_IO)
                timed["metadata_bytes"] = _sealed_metadata(metadata, global_plans)
    return result


def _record(model: _Model, selection: Sequence[Sequence[int]], step: int, topology: Topology) -> CheckpointRecord:
    return CheckpointRecord(
        name=f"step_{step:08d}",
        step=step,
        units=tuple(u.key for u in _units(model, selection)),
        strategy="adaptive",
        world_size=topology.world_size,
        ep=topology.ep,
        backend="filesystem",
    )


def manifest_and_commit(model: _Model, k: int, topology: Topology) -> dict[str, Any]:
    """The steady-state manifest (``retention`` records) and the coordinator's commit of one more checkpoint."""
    retention = CheckpointConfig().retention
    selections = _selections(model.spec, k, retention + 1)
    records = [_record(model, s, 10 * (i + 1), topology) for i, s in enumerate(selections)]
    manifest = Manifest(records=tuple(records[:-1]))
    new = records[-1]
    sources = {
        param_key(unit, local): {"param": f"{unit.key}.{local}", "index": None, "view": None}
        for unit in _units(model, selections[-1])
        for local, _ in model.tensors(unit)
    }
    description = {"record": new.__dict__, "layout": {"num_experts": list(model.spec.num_experts), "params": sources}}
    with tempfile.TemporaryDirectory(prefix="moc-scale-") as root:
        storage = FilesystemStorage(Path(root).as_uri())
        storage.put(MANIFEST, manifest.to_json())
        start = time.perf_counter()
        ManifestCommit(storage, retention).commit(new, lambda: description, None)
        seconds = time.perf_counter() - start
        committed = len(Path(root, MANIFEST).read_bytes())
    return {"manifest_bytes": committed, "commit_s": seconds, "manifest": manifest.with_record(new)}


def recovery(
    model: _Model, k: int, owners: Mapping[str, int], topology: Topology, manifest: Manifest
) -> dict[str, Any]:
    """Every rank's inventory of ``NUM_SLOTS`` committed slots (the units whose ZeRO state it keeps, of three
    consecutive snapshots), the bytes ``all_gather_object`` moves, and the plan from all of them."""
    per_rank: dict[int, list[SlotInventory]] = {rank: [] for rank in topology.ranks()}
    for slot, selection in enumerate(_selections(model.spec, k, NUM_SLOTS)):
        mine: dict[int, list[str]] = {}
        for unit in _units(model, selection):
            mine.setdefault(owners[unit.key], []).append(unit.key)
        for rank, keys in mine.items():
            per_rank[rank].append(SlotInventory(rank, slot, 100 + slot, frozenset(keys)))
    sizes = [len(pickle.dumps(items)) for items in per_rank.values()]
    everything = [item for items in per_rank.values() for item in items]
    start = time.perf_counter()
    plan = plan_recovery([u.key for u, _ in model.dense], [u.key for u in model.experts], everything, manifest)
    seconds = time.perf_counter() - start
    assert plan is not None, "the newest slots hold every dense unit"
    return {
        "inventory_bytes_per_rank": max(sizes),
        "inventory_bytes_mean": sum(sizes) / len(sizes),
        "recovery_exchange_bytes": max(sizes) * topology.world_size,
        "recovery_plan_s": seconds,
    }


class _Sent:
    """A recorded non-blocking collective, done at once."""

    def wait(self) -> bool:
        return True


@contextmanager
def recorded_collectives(world_size: int) -> Iterator[list[tuple[str, int, bool]]]:
    """``torch.distributed`` as a rank of ``world_size`` sees it, recording each collective, its bytes per rank and
    whether the caller waits for it (no ``async_op``)."""
    sent: list[tuple[str, int, bool]] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> _Sent | None:
        sent.append(("all_reduce", tensor.numel() * tensor.element_size(), not async_op))
        return _Sent() if async_op else None

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_backend", return_value="gloo"),
        mock.patch.object(dist, "get_world_size", return_value=world_size),
        mock.patch.object(dist, "all_reduce", side_effect=all_reduce),
    ):
        yield sent


def snapshot_path_collectives(num_experts: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
    """A steady-state snapshot's collectives, issued and read as the engine does: the persist vote, started at the
    batch end before the snapshot once a persist has started and read at the snapshot, then the start of the sum of the
    router counts, read on the copy thread and at the join (here, at once). ``group``: the engine's agreement group."""
    persists = PersistQueue(cast(Any, None), cast(Any, None), cast(Any, None), CheckpointStats())
    persists.started = 1  # a persist has run: from now on every snapshot votes
    vote = PersistVote(persists, group)
    vote.start()
    vote.result()
    tokens = TokenAccounting(CheckpointConfig(), num_experts, rank=0)
    tokens.finish_mark(tokens.start_mark(1, group))


def snapshot_collectives(spec: ModelSpec, world_size: int) -> dict[str, Any]:
    """The snapshot's training-thread collectives (:func:`snapshot_path_collectives`) on ``world_size`` ranks."""
    with recorded_collectives(world_size) as sent:
        snapshot_path_collectives(spec.num_experts)
    return _snapshot_fields(sent)


def _snapshot_fields(sent: Sequence[tuple[str, int, bool]]) -> dict[str, Any]:
    return {
        "snapshot_collectives": len(sent),
        "snapshot_collective_bytes": sum(nbytes for _, nbytes, _ in sent),
        "snapshot_blocking_collectives": sum(blocking for _, _, blocking in sent),
    }


def simulate(spec: ModelSpec, world_size: int, k: int, item_cap: int = ITEM_CAP) -> dict[str, Any]:
    """One row of the report: ``spec`` on ``world_size`` simulated ranks, checkpoints of K experts per layer."""
    model = _Model(spec)
    topology = Topology(world_size, spec.ep)
    start = time.perf_counter()
    owners = _zero_owners(model, topology)
    zero_owners_s = time.perf_counter() - start
    units = _units(model, _selections(spec, k, 1)[0])
    plan = time_plan(model, units, owners, topology)
    coordinators = coordinator_plans(plan["ownership"], model, owners, item_cap)
    ours, dcp = coordinators[False], coordinators[True]
    committed = manifest_and_commit(model, k, topology)
    return {
        "model": spec.name,
        "world_size": world_size,
        "ep": spec.ep,
        "k": k,
        "units": len(units),
        "plan_s": plan["plan_s"],
        "plan_on_training_thread": None,  # a simulated rank has no threads: with_plan_threads measures a real one
        "plan_thread": "unmeasured in the simulation (with_plan_threads measures it on a real engine)",
        "plan_memory_bytes": plan["plan_memory_bytes"],
        "zero_owners_s": zero_owners_s,
        "write_items": ours["items"],
        "coordinator_plan_s": ours["seconds"],
        "metadata_bytes": ours["metadata_bytes"],
        "dcp_write_items": dcp["items"],
        "dcp_coordinator_plan_s": dcp["seconds"],
        "dcp_metadata_bytes": dcp["metadata_bytes"],
        "manifest_bytes": committed["manifest_bytes"],
        "commit_s": committed["commit_s"],
        **recovery(model, k, owners, topology, committed["manifest"]),
        **snapshot_collectives(spec, world_size),
    }


def with_plan_threads(rows: list[dict[str, Any]]) -> None:
    """Fill ``plan_on_training_thread`` and ``plan_thread`` of every row from a real engine's persists
    (:func:`~moc_lightning.tools.plan_threads.plan_threads`: a periodic persist's plan under ZeRO-2, measured)."""
    measured = plan_threads()
    for row in rows:
        row.update(measured)


def extrapolate(rows: list[dict[str, Any]]) -> None:
    """Fill ``*_reason`` for every null coordinator figure, and ``*_estimate``: a linear extrapolation in write items
    from the largest measured row of the same model and K (DCP's global plan and its metadata are linear in items).
    The figure itself stays null (unmeasured); the estimates are null where it was measured or nothing was."""
    for prefix in ("", "dcp_"):
        for row in rows:
            row[f"{prefix}coordinator_plan_s_estimate"] = row[f"{prefix}metadata_bytes_estimate"] = None
            if row[f"{prefix}coordinator_plan_s"] is not None:
                continue
            measured = [
                r
                for r in rows
                if r["model"] == row["model"] and r["k"] == row["k"] and r[f"{prefix}coordinator_plan_s"] is not None
            ]
            items = row[f"{prefix}write_items"]
            reason = f"not built: {items:,} write items exceed the cap of one process here"
            if measured:
                base = max(measured, key=lambda r: r[f"{prefix}write_items"])
                scale = items / base[f"{prefix}write_items"]
                seconds = row[f"{prefix}coordinator_plan_s_estimate"] = base[f"{prefix}coordinator_plan_s"] * scale
                nbytes = row[f"{prefix}metadata_bytes_estimate"] = base[f"{prefix}metadata_bytes"] * scale
                reason += (
                    f"; linear in items from {base['world_size']} ranks: ~{seconds:.1f} s, ~{nbytes / 1e9:.2f} GB"
                )
            row[f"{prefix}coordinator_plan_reason"] = reason


def report(
    models: Sequence[str],
    worlds: Sequence[int],
    ks: Sequence[str],
    item_cap: int = ITEM_CAP,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every (model, world, K) row; ``ks``: ``1`` and/or ``N`` (every expert)."""
    rows = []
    for name in models:
        spec = MODELS[name]
        for k in ks:
            for world in worlds:
                experts = spec.shape.experts if k == "N" else int(k)
                log(f"[scale] {spec.name} world={world} K={k} ...")
                rows.append(simulate(spec, world, experts, item_cap))
    extrapolate(rows)
    return rows


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "null"
    if unit == "B":
        return f"{value / 1e6:.2f} MB" if value < 1e9 else f"{value / 1e9:.2f} GB"
    return f"{value:.3f}" if isinstance(value, float) else f"{value:,}"


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table: every field per row, then DCP's own planning beside ours."""
    head = (
        "| model | world | K | plan_s | plan mem | coord plan_s (ours) | .metadata (ours) | coord plan_s (DCP dedup) "
        "| .metadata (DCP) | manifest | commit_s | inventory/rank | exchange total | recovery_plan_s | snapshot coll. |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['world_size']:,} | {r['k']} | {_fmt(r['plan_s'])} | {_fmt(r['plan_memory_bytes'], 'B')} "
            f"| {_fmt(r['coordinator_plan_s'])} | {_fmt(r['metadata_bytes'], 'B')} | {_fmt(r['dcp_coordinator_plan_s'])} "
            f"| {_fmt(r['dcp_metadata_bytes'], 'B')} | {_fmt(r['manifest_bytes'], 'B')} | {_fmt(r['commit_s'])} "
            f"| {_fmt(r['inventory_bytes_per_rank'], 'B')} | {_fmt(r['recovery_exchange_bytes'], 'B')} "
            f"| {_fmt(r['recovery_plan_s'])} | {r['snapshot_collectives']}, {r['snapshot_collective_bytes']} B, "
            f"{r['snapshot_blocking_collectives']} blocking |"
        )
    notes = [
        f"- {r['model']} {r['world_size']:,} K={r['k']}: {field} null: {r[field + '_reason']}"
        for r in rows
        for field in ("coordinator_plan", "dcp_coordinator_plan")
        if field + "_reason" in r
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def growth(rows: Sequence[Mapping[str, Any]], field: str, model: str, k: int) -> list[tuple[int, int, float, float]]:
    """(world a, world b, world ratio, ``field`` ratio) between consecutive simulated sizes of one model and K."""
    ordered = sorted((r for r in rows if r["model"] == model and r["k"] == k), key=lambda r: r["world_size"])
    return [
        (a["world_size"], b["world_size"], b["world_size"] / a["world_size"], b[field] / max(a[field], 1e-9))
        for a, b in itertools.pairwise(ordered)
    ]


def verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The targets at the largest simulated world of DeepSeek-V3-shaped, K = N: met or missed, with the figure."""
    target = [r for r in rows if r["model"] == MODELS["deepseekv3"].name and r["k"] == 256]
    if not target:
        return ["- targets: DeepSeek-V3-shaped with K=N not in this run"]
    row = max(target, key=lambda r: r["world_size"])
    lines = [f"Targets at {row['world_size']:,} ranks (DeepSeek-V3-shaped, K=N):"]
    for field, bound in TARGETS.items():
        value = row[field]
        if value is None:
            lines.append(f"- {field} <= {bound:g}: unmeasured ({row.get('coordinator_plan_reason', '')})")
            continue
        lines.append(f"- {field} = {value:,.3f} vs <= {bound:g}: {'met' if value <= bound else 'MISSED'}")
    on_thread = row["plan_on_training_thread"]
    verdict = f"unknown ({row['plan_thread']})" if on_thread is None else "MISSED" if on_thread else "met"
    lines.append(f"- plan off the training thread: {verdict}")
    sizes = {r["snapshot_collective_bytes"] for r in target}
    lines.append(
        f"- snapshot collective bytes independent of world size: {'met' if len(sizes) == 1 else 'MISSED'} "
        f"({sorted(sizes)} B over {len(target)} sizes)"
    )
    return lines


CALIBRATION = ModelSpec("GPT-MoE small", GptMoeShape(layers=4, hidden=64, experts=8, vocab=512, seq_len=64), ep=2)
"""The model of the calibration runs: small enough that every rank holds real tensors of it."""


class _TimedSavePlanner(MoCSavePlanner):
    """The engine's planner, timing the coordinator's global plan of a real ``dcp.save``."""

    global_plan_s: float | None = None

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        start = time.perf_counter()
        result = super().create_global_plan(all_plans)
        self.global_plan_s = time.perf_counter() - start
        return result


def _calibration_rank(k: int, root: str) -> dict[str, Any]:
    """One gloo rank of a calibration run: the same steps as :func:`simulate`, with real tensors and collectives."""
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, topology = _Model(CALIBRATION), Topology(world, CALIBRATION.ep)
    owners = _zero_owners(model, topology)
    units = _units(model, _selections(CALIBRATION, k, 1)[0])
    start = time.perf_counter()
    ownership = _plan(model, units, owners, topology)
    writes: dict[str, tuple[int, int]] = {}
    state: dict[str, torch.Tensor] = {}
    for sharding, shard in ownership.writes_of(rank):
        unit = _units_of(ownership)[ownership.units.index(sharding)]
        for key, meta in model.meta(unit).items():
            if "/optim/" not in key and (rows := shard_rows(shard, sharding.rows, meta)) is not None:
                writes[key] = rows
    plan_s = time.perf_counter() - start
    for unit in units:
        held = isinstance(unit, DenseUnit) or rank in model.weights_unit(unit, topology).holders
        for key, meta in model.meta(unit).items():
            is_state = "/optim/" in key
            if (is_state and owners[unit.key] == rank) or (held and not is_state):
                state[key] = torch.zeros(meta.shape, dtype=meta.dtype)
                if is_state:
                    writes[key] = (0, 1) if meta.dim() == 0 else (0, meta.shape[0])
    planner = _TimedSavePlanner(writes)
    storage = FilesystemStorage(root)
    dcp.save(state, storage_writer=storage.writer(f"w{world}k{k}"), planner=planner)
    mine: list[SlotInventory] = []
    for slot, selection in enumerate(_selections(CALIBRATION, k, NUM_SLOTS)):
        keys = frozenset(u.key for u in _units(model, selection) if owners[u.key] == rank)
        if keys:
            mine.append(SlotInventory(rank, slot, 100 + slot, keys))
    gathered: list[Any] = [None] * world
    start = time.perf_counter()
    dist.all_gather_object(gathered, mine)
    exchange_s = time.perf_counter() - start
    sizes = [len(pickle.dumps(items)) for items in gathered]
    selection = _selections(CALIBRATION, k, 1)[0]
    manifest = Manifest(records=(_record(model, selection, 100, topology),))
    start = time.perf_counter()
    plan_recovery(
        [u.key for u, _ in model.dense],
        [u.key for u in model.experts],
        [i for items in gathered for i in items],
        manifest,
    )
    recovery_plan_s = time.perf_counter() - start
    sent: list[tuple[str, int, bool]] = []
    real_all_reduce = dist.all_reduce
    group = agreement_group()

    def counted(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        sent.append(("all_reduce", tensor.numel() * tensor.element_size(), not async_op))
        kwargs["async_op"] = async_op
        return real_all_reduce(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", side_effect=counted):
        snapshot_path_collectives(CALIBRATION.num_experts, group)
    metadata = Path(storage.root, f"w{world}k{k}", ".metadata")
    dist.barrier()
    dist.destroy_process_group()
    return {
        "plan_s": plan_s,
        "coordinator_plan_s": planner.global_plan_s,
        "metadata_bytes": metadata.stat().st_size if rank == 0 else None,
        "inventory_bytes_per_rank": max(sizes),
        "recovery_exchange_bytes": max(sizes) * world,
        "recovery_exchange_s": exchange_s,
        "recovery_plan_s": recovery_plan_s,
        **_snapshot_fields(sent),
    }


CALIBRATED = (
    "plan_s",
    "coordinator_plan_s",
    "metadata_bytes",
    "inventory_bytes_per_rank",
    "recovery_exchange_bytes",
    "recovery_plan_s",
    "snapshot_collectives",
    "snapshot_collective_bytes",
    "snapshot_blocking_collectives",
)


def calibrate(worlds: Sequence[int] = (2, 4, 8), log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Real gloo runs of ``worlds`` processes of the calibration model beside its simulation at the same sizes; a
    figure measured on several ranks is the slowest or largest rank's (the coordinator's for the global plan)."""
    from moc_lightning.runtime.launch import standalone

    rows = []
    with tempfile.TemporaryDirectory(prefix="moc-calibrate-") as root:
        for world in worlds:
            for k in (1, CALIBRATION.shape.experts):
                log(f"[scale] calibration: {world} gloo ranks, K={k} ...")
                ranks = standalone(_calibration_rank, (k, root), nproc=world)
                measured = {f: max(r[f] for r in ranks.values() if r[f] is not None) for f in CALIBRATED}
                simulated = simulate(CALIBRATION, world, k)
                rows.append(
                    {
                        "world_size": world,
                        "k": k,
                        "measured": measured,
                        "simulated": {f: simulated[f] for f in CALIBRATED},
                    }
                )
    return rows


def calibration_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| world | K | field | measured (gloo) | simulated |", "|---|---|---|---|---|"]
    for row in rows:
        for field in CALIBRATED:
            lines.append(
                f"| {row['world_size']} | {row['k']} | {field} | {_fmt(row['measured'][field])} "
                f"| {_fmt(row['simulated'][field])} |"
            )
    return "\n".join(lines)
