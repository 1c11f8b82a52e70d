"""The PEC engine: decides nothing about *when* (the callback does), does the *how* of saving and loading.

A save takes every dense unit and the selected experts, asks ownership which rank writes which rows,
writes them through ``torch.distributed.checkpoint.save`` with :class:`MoCSavePlanner`, and then commits:
the coordinator writes the checkpoint's self-description (``step_X/moc.json``) and the manifest that lists
it, and only then does the checkpoint exist. A load reads the manifest, takes every dense unit from the
newest checkpoint and every expert from its newest stored version, loads them with DCP (any world size
and EP degree), and accounts the lost tokens of the experts that came from older steps (PLT, eq. 7).

Usable without Lightning: give it a layout, the topology and a storage backend.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moc_lightning.config import CheckpointConfig
from moc_lightning.distributed import collective_device
from moc_lightning.faults import fault_point
from moc_lightning.layout import Layout, materialize_optimizer_state, param_key
from moc_lightning.ledger import NEVER, DynamicK, FaultReport, TokenLedger, check_k
from moc_lightning.manifest import CheckpointRecord, Manifest, ManifestError
from moc_lightning.models.moe import MoELayer
from moc_lightning.models.parallel import ExpertParallelTopology
from moc_lightning.planner import MoCSavePlanner, RowRange, owned_bytes, tensor_row_range
from moc_lightning.selection import Selection, UnsavedTokens, make_policy
from moc_lightning.sharding import ShardingUnit, Topology, plan_ownership
from moc_lightning.size_model import SizeModel, size_model
from moc_lightning.storage import CheckpointStorage, corrupt_from
from moc_lightning.units import DenseUnit, ExpertUnit, Unit, parse_unit

MANIFEST = "manifest.json"
PREVIOUS_MANIFEST = "manifest.previous.json"


class UnreadableCheckpoint(Exception):
    """A stored checkpoint failed verification; recovery plans again without it."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"checkpoint {name} is unreadable: {detail}")
        self.name = name


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


@dataclass(frozen=True)
class SaveReport:
    """What one persist wrote."""

    step: int
    name: str
    units: tuple[str, ...]
    bytes_written: int
    """Tensor bytes this rank wrote."""
    expected_bytes: int
    """Bytes of every saved unit, all ranks together (eq. 5/6 evaluated on the real tensors)."""
    seconds: float
    """From the start of the DCP save to the manifest commit on every rank (retention's deletions follow)."""


@dataclass(frozen=True)
class LoadReport:
    """What a load restored: the resume step, where each unit came from, and the PLT it implies."""

    resume_step: int
    sources: dict[str, int]
    """Unit key -> step of the version that was loaded (``-1``: never stored, left at initialisation)."""
    fault: FaultReport
    k_changed: bool
    """Whether Dynamic-K raised K after this recovery."""

    @property
    def plt(self) -> float:
        return self.fault.plt


class PECCheckpointer:
    """Partial Experts Checkpointing of one model + optimizer, synchronous, through DCP."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        layout: Layout,
        topology: ExpertParallelTopology,
        storage: CheckpointStorage,
        backend: str = "filesystem",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        num_experts = layout.num_experts
        cfg.validate_for(min(num_experts))
        check_k(cfg.k_snapshot, cfg.k_persist, min(num_experts))
        self.cfg = cfg
        self.layout = layout
        self.topology = topology
        self.storage = storage
        self.backend = backend
        self.process_group = process_group
        self.policy = make_policy(cfg.selection, num_experts, topology.ep)
        self.ledger = TokenLedger(num_experts)
        self.dynamic_k = DynamicK(cfg.k_snapshot, cfg.k_persist, min(num_experts), cfg.dynamic_k.plt_threshold)
        self.snapshots_taken = 0
        self._pending = [torch.zeros(n, dtype=torch.int64) for n in num_experts]
        self._pending_assigned = [0] * len(num_experts)
        self._unit_rows = {unit: _unit_rows(layout, unit) for unit in layout.units}
        self._param_sources: dict[str, dict[str, Any]] | None = None

    def attach(self, layout: Layout) -> None:
        """Use ``layout`` from now on (same model, new optimizer object: after Lightning re-creates it)."""
        if layout.num_experts != self.layout.num_experts:
            raise ValueError(f"new layout has experts {layout.num_experts}, expected {self.layout.num_experts}")
        self.layout = layout
        self._unit_rows = {unit: _unit_rows(layout, unit) for unit in layout.units}

    def size_model(self) -> SizeModel:
        """Eq. 5/6 evaluated on this model's real tensors."""
        return size_model(self.layout)

    # ----------------------------------------------------------------- tokens
    def record_tokens(self, moe_layers: Sequence[MoELayer]) -> None:
        """Add the router counts of the last step (this rank's tokens); reduced over ranks at checkpoint time."""
        for i, layer in enumerate(moe_layers):
            self._pending[i] += layer.tokens_per_expert.to("cpu", torch.int64)
            self._pending_assigned[i] += layer.tokens_assigned

    def mark_step(self, step: int) -> None:
        """Reduce the router counts recorded since the last mark over all ranks (collective: every rank, on the
        training thread) and mark ``step`` in the ledger, as the step a checkpoint is taken at."""
        self._sync_tokens()
        self.ledger.mark(step)

    def _sync_tokens(self) -> None:
        flat = torch.cat([*self._pending, torch.tensor(self._pending_assigned, dtype=torch.int64)])
        if dist.is_initialized():
            # default group, on the training thread (persists use their own gloo group)
            flat = flat.to(collective_device())
            dist.all_reduce(flat)
            flat = flat.cpu()
        sizes = [len(p) for p in self._pending] + [len(self._pending_assigned)]
        *counts, assigned = flat.split(sizes)
        for i, c in enumerate(counts):
            self.ledger.record(i, c, int(assigned[i]))
        self._pending = [torch.zeros_like(p) for p in self._pending]
        self._pending_assigned = [0] * len(self._pending_assigned)

    # ------------------------------------------------------------------- save
    def checkpoint(self, step: int) -> SaveReport | None:
        """Take the checkpoint of step ``step``: select, and persist when this snapshot is a persist one.

        Returns the save report when something was persisted.
        """
        self.mark_step(step)
        index = self.snapshots_taken
        persist = index % self.cfg.persist_every_n_snapshots == 0
        selection = self.select(index, persist)
        self.snapshots_taken += 1
        if not persist:
            return None
        report = self.persist(step, self.layout.dense_units + tuple(sorted(selection.persist_units())))
        self.prune_ledger()
        return report

    def prune_ledger(self, in_memory: Sequence[int] = ()) -> None:
        """Forget token marks older than every stored version and every snapshot step in ``in_memory``."""
        steps = [r.step for r in self.read_manifest().records] + list(in_memory)
        if steps:
            self.ledger.prune(min(steps))

    def select(self, index: int, persist: bool) -> Selection:
        """The experts checkpoint number ``index`` snapshots (and persists, if ``persist``); advances the policy."""
        unsaved = None
        if self.cfg.selection == "load_aware":
            manifest = self.read_manifest()
            steps = [
                [_stored_step(manifest, ExpertUnit(layer, e)) for e in range(n)]
                for layer, n in enumerate(self.layout.num_experts)
            ]
            since = self.ledger.tokens_since(steps)
            unsaved = UnsavedTokens(snapshot=since, persist=since)
        return self.policy.select(
            index, self.dynamic_k.k_snapshot, self.dynamic_k.k_persist, persist=persist, unsaved=unsaved
        )

    def persist(
        self,
        step: int,
        units: Sequence[Unit],
        *,
        from_slot: Mapping[str, torch.Tensor] | None = None,
        engine_state: dict[str, Any] | None = None,
        trainer_state: str | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> SaveReport:
        """Write ``units`` (all ranks' share) as checkpoint ``step`` and commit it in the manifest.

        By default this rank writes the rows the ownership gives it, from the live tensors. With
        ``from_slot`` it writes those tensors (a snapshot slot: whole units it owns) as they are, and
        ``engine_state``/``trainer_state`` are the states captured with that snapshot.
        """
        start = time.perf_counter()
        name = checkpoint_name(step)
        if from_slot is None:
            state = self.layout.tensors([u for u in units if u in self.layout.slots])
            writes = self._writes(units, state)
        else:
            state = dict(from_slot)
            writes = None if self.cfg.sharding == "dcp_default" else {k: _whole_rows(t) for k, t in state.items()}
        planner = MoCSavePlanner(writes)
        dcp.save(state, storage_writer=self.storage.writer(name), planner=planner, process_group=self.process_group)
        written = owned_bytes(planner.plan)  # the final local plan, after any deduplication
        record = CheckpointRecord(
            name=name,
            step=step,
            units=tuple(u.key for u in units),
            strategy=self.cfg.sharding,
            world_size=self.topology.world_size,
            ep=self.topology.ep,
            backend=self.backend,
        )
        param_sources = self._gather_param_sources()  # collective on first use: every rank, before the commit
        if before_commit is not None:
            before_commit()
        retired: list[str] = []
        if self._is_coordinator:
            description = self._describe(record, param_sources, engine_state or self.state_dict(), trainer_state)
            retired = self._commit(record, description)
        self._barrier()
        report = SaveReport(
            step=step,
            name=name,
            units=record.units,
            bytes_written=written,
            expected_bytes=sum(self.unit_nbytes(u) for u in units),
            seconds=time.perf_counter() - start,
        )
        for retired_name in retired:  # after the commit, and after the persist's clock
            self.storage.delete(retired_name)
        return report

    def _commit(self, record: CheckpointRecord, description: dict[str, Any]) -> list[str]:
        """Self-description first, then the manifest (the commit point); returns what retention retired, for
        the caller to delete once the commit is done."""
        self.storage.put(f"{record.name}/moc.json", json.dumps(description).encode())
        current = self.read_manifest()
        manifest, removed = current.with_record(record).retire(self.cfg.retention)
        self.storage.put(PREVIOUS_MANIFEST, current.to_json())  # the fallback if the new one gets damaged
        fault_point("manifest_commit", record.step)
        self.storage.put(MANIFEST, manifest.to_json())
        return removed

    def _describe(
        self,
        record: CheckpointRecord,
        param_sources: dict[str, dict[str, Any]],
        engine_state: dict[str, Any],
        trainer_state: str | None,
    ) -> dict[str, Any]:
        """The record, the engine state and the model parameter behind each weight key stored here.

        The parameter map lets ``moc-consolidate`` write a dense checkpoint under the model's own names
        without building the model.
        """
        held = set(record.units)
        return {
            "record": dataclasses.asdict(record),
            "engine": engine_state,
            "trainer": trainer_state,
            "layout": {
                "num_experts": list(self.layout.num_experts),
                "params": {key: src for key, src in param_sources.items() if parse_unit(key).key in held},
            },
        }

    def _gather_param_sources(self) -> dict[str, dict[str, Any]]:
        """Weight key -> ``{"param": name, "index": stacked slice or None}`` of every unit on any rank.

        Gathered once from all ranks, because under expert parallelism the coordinator that describes a
        checkpoint does not hold the other ranks' experts.
        """
        if self._param_sources is None:
            local = {
                param_key(unit, slot.local_name): {"param": slot.param, "index": slot.index}
                for unit, slots in self.layout.slots.items()
                for slot in slots
            }
            parts: list[dict[str, dict[str, Any]] | None] = [local]
            if dist.is_initialized():
                parts = [None] * dist.get_world_size(self.process_group)
                dist.all_gather_object(parts, local, group=self.process_group)
            self._param_sources = {key: src for part in parts for key, src in part.items()}
        return self._param_sources

    def _writes(self, units: Sequence[Unit], state: dict[str, torch.Tensor]) -> dict[str, RowRange] | None:
        """Rows of every local tensor this rank writes, from the ownership of ``units``."""
        if self.cfg.sharding == "dcp_default":
            return None
        topology = Topology(self.topology.world_size, self.topology.ep)
        sharding_units = tuple(self._sharding_unit(u) for u in units)
        ownership = plan_ownership(sharding_units, topology, self.cfg.sharding)
        by_unit: dict[str, list[str]] = {}
        for key in state:
            by_unit.setdefault(parse_unit(key).key, []).append(key)
        writes: dict[str, RowRange] = {}
        for unit, shard in ownership.writes_of(self.topology.rank):
            for key in by_unit.get(unit.key, ()):
                tensor = state[key]
                if tensor.dim() == 0:
                    if shard.row_start == 0:
                        writes[key] = (0, 1)
                    continue
                writes[key] = tensor_row_range(shard.row_start, shard.row_stop, unit.rows, tensor.shape[0])
        return writes

    def _sharding_unit(self, unit: Unit) -> ShardingUnit:
        rows = self._unit_rows[self.local_twin(unit)]
        nbytes = self.unit_nbytes(unit)
        common = {"key": unit.key, "rows": rows, "row_bytes": max(1, math.ceil(nbytes / rows))}
        if isinstance(unit, DenseUnit):
            return ShardingUnit(kind="dense", holders=range(self.topology.world_size), **common)
        per_rank = self.layout.num_experts[unit.layer] // self.topology.ep
        ep_rank = unit.expert // per_rank
        holders = range(ep_rank, self.topology.world_size, self.topology.ep)
        return ShardingUnit(kind="expert", holders=holders, layer=unit.layer, expert=unit.expert, **common)

    def local_twin(self, unit: Unit) -> Unit:
        """``unit`` itself if held here, else a local expert of the same MoE layer (experts share one shape)."""
        if unit in self.layout.slots:
            return unit
        assert isinstance(unit, ExpertUnit)
        return next(u for u in self.layout.expert_units if u.layer == unit.layer)

    def unit_nbytes(self, unit: Unit) -> int:
        """Weights and optimizer state of ``unit`` in bytes, whether or not this rank holds it."""
        return self.layout.unit_bytes(self.local_twin(unit)).total

    def snapshot_share_bytes(self) -> int:
        """What one rank's snapshot slot should hold at the current ``k_snapshot``.

        Snapshot ownership spreads the dense units and ``k_snapshot`` experts per MoE layer over the ranks
        in whole units, balanced by bytes: an even share plus the largest unit covers the imbalance.
        """
        dense = [self.unit_nbytes(u) for u in self.layout.dense_units]
        experts = [self.unit_nbytes(ExpertUnit(layer, 0)) for layer in range(len(self.layout.num_experts))]
        total = sum(dense) + self.dynamic_k.k_snapshot * sum(experts)
        return -(-total // self.topology.world_size) + max(dense + experts, default=0)

    # ------------------------------------------------------------------- load
    def read_manifest(self) -> Manifest:
        """The committed manifest; if it is unreadable, the one committed before it (and say so)."""
        data = self.storage.get(MANIFEST)
        if data is None:
            return Manifest()
        try:
            return Manifest.from_json(data)
        except ManifestError as err:
            previous = self.storage.get(PREVIOUS_MANIFEST)
            if previous is None:
                raise ManifestError(f"{self.storage.url}/{MANIFEST} is unreadable ({err}) and no previous "
                                    "manifest exists to fall back to") from err
            manifest = Manifest.from_json(previous)
            print(f"[moc_lightning] {MANIFEST} is unreadable ({err}); using the previous manifest "
                  f"(latest step {manifest.latest.step if manifest.latest else None})")
            return manifest

    def read_description(self, step: int) -> dict[str, Any]:
        """The ``moc.json`` of the checkpoint of ``step``: its record, engine and trainer state, parameter map."""
        name = checkpoint_name(step)
        data = self.storage.get(f"{name}/moc.json")
        if data is None:
            raise UnreadableCheckpoint(name, f"{name}/moc.json is missing")
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise UnreadableCheckpoint(name, f"{name}/moc.json is unreadable: {err}") from err

    def load_latest(self) -> LoadReport | None:
        """Restore the newest readable state in storage; ``None`` if there is none.

        A checkpoint that fails verification (checksum, truncated or missing file, bad metadata) is dropped
        from the manifest and the load is planned again from the versions before it.
        """
        manifest = self.read_manifest()
        while manifest.latest is not None:
            try:
                return self._load_newest(manifest)
            except UnreadableCheckpoint as bad:
                manifest = self.forget(manifest, bad)
        return None

    def forget(self, manifest: Manifest, bad: UnreadableCheckpoint) -> Manifest:
        """Drop an unreadable checkpoint from ``manifest`` and commit that, so nothing builds on it again."""
        print(f"[moc_lightning] {bad}; falling back to the versions stored before {bad.name}")
        manifest = manifest.without({bad.name})
        if self._is_coordinator:
            self.storage.put(MANIFEST, manifest.to_json())
        self._barrier()
        return manifest

    def _load_newest(self, manifest: Manifest) -> LoadReport:
        latest = manifest.latest
        self.load_state_dict(self.read_description(latest.step)["engine"])
        self.prepare_for_load()
        sources = {unit: manifest.newest(unit.key, at_or_before=latest.step) for unit in self._all_units()}
        missing = [u.key for u in self.layout.dense_units if sources[u] is not latest]
        if missing:
            raise RuntimeError(f"checkpoint {latest.name} lacks dense units {missing[:5]}; it cannot be resumed")
        self.load_from_storage({u: r for u, r in sources.items() if r is not None})
        restored_from = [
            [sources[ExpertUnit(layer, e)].step if sources[ExpertUnit(layer, e)] else NEVER for e in range(n)]
            for layer, n in enumerate(self.layout.num_experts)
        ]
        return self.account_recovery(latest.step, restored_from)

    def prepare_for_load(self) -> None:
        """Create the optimizer's state tensors so loads have somewhere to go (a fresh optimizer has none)."""
        if self.layout.optimizer is not None:
            materialize_optimizer_state(self.layout.optimizer)

    def load_from_storage(self, sources: Mapping[Unit, CheckpointRecord]) -> None:
        """Load every held unit in ``sources`` from its checkpoint, one collective DCP load per checkpoint.

        ``sources`` must be the same on every rank (it comes from the shared manifest): each rank loads the
        units it holds, under whatever world size and EP degree wrote them.
        """
        for record in sorted(set(sources.values()), key=lambda r: r.step):
            wanted = [u for u in self.layout.units if sources.get(u) is record]
            try:
                dcp.load(
                    self.layout.tensors(wanted),
                    storage_reader=self.storage.reader(record.name),
                    process_group=self.process_group,
                )
            except CheckpointException as err:  # DCP gathers every rank's failure: all ranks decide alike
                corrupt = corrupt_from(err)
                if corrupt is None:
                    raise
                raise UnreadableCheckpoint(record.name, str(corrupt)) from err

    def account_recovery(self, resume_step: int, restored_from: list[list[int]]) -> LoadReport:
        """PLT of the recovery (eq. 7) from the ledger, then Dynamic-K."""
        fault = self.ledger.recover(resume_step, restored_from)
        k_changed = self.cfg.dynamic_k.enabled and self.dynamic_k.after_recovery(fault, self.ledger.accumulated_plt)
        self._barrier()
        sources = {
            ExpertUnit(layer, e).key: step for layer, steps in enumerate(restored_from) for e, step in enumerate(steps)
        }
        return LoadReport(
            resume_step=resume_step,
            sources={**{u.key: resume_step for u in self.layout.dense_units}, **sources},
            fault=fault,
            k_changed=k_changed,
        )

    def _all_units(self) -> list[Unit]:
        experts = [ExpertUnit(layer, e) for layer, n in enumerate(self.layout.num_experts) for e in range(n)]
        return [*self.layout.dense_units, *experts]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Selection cursor, ledger, K and counters: small and JSON-able, saved with every checkpoint."""
        return {
            "snapshots_taken": self.snapshots_taken,
            "selection": self.policy.state_dict(),
            "ledger": self.ledger.state_dict(),
            "dynamic_k": self.dynamic_k.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshots_taken = int(state["snapshots_taken"])
        self.policy.load_state_dict(state["selection"])
        self.ledger.load_state_dict(state["ledger"])
        self.dynamic_k.load_state_dict(state["dynamic_k"])

    @property
    def _is_coordinator(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.process_group) == 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.process_group)


def _whole_rows(tensor: torch.Tensor) -> RowRange:
    return (0, 1) if tensor.dim() == 0 else (0, tensor.shape[0])


def _unit_rows(layout: Layout, unit: Unit) -> int:
    """Rows a unit is split into: the longest dim 0 among its tensors (1 for scalar-only units)."""
    return max([t.shape[0] for t in layout.tensors([unit]).values() if t.dim() > 0] or [1])


def _stored_step(manifest: Manifest, unit: Unit) -> int:
    record = manifest.newest(unit.key)
    return record.step if record else NEVER


