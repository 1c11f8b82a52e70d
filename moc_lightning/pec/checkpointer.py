"""The PEC engine: decides nothing about *when* (the callback does), does the *how* of saving and loading.

A save takes every dense unit and the selected experts, asks ownership which rank writes which rows,
writes them through ``torch.distributed.checkpoint.save`` with :class:`MoCSavePlanner`, and then commits:
the coordinator writes the checkpoint's self-description (``step_X/moc.json``) and the manifest that lists
it, and only then does the checkpoint exist. Every rank learns the outcome of both phases (one small
all-gather each), so a persist ends alike everywhere: the same :class:`SaveReport`, or the same
:class:`PersistFailed` with nothing committed and the failed attempt's directory removed.

A load reads the manifest, takes every dense unit from the newest checkpoint and every expert from its
newest stored version, loads them with DCP (any world size and EP degree), and accounts the lost tokens of
the experts that came from older steps (PLT, eq. 7).

``checkpoint.pec_scope`` (:mod:`moc_lightning.engine.parts`): a save also writes the non-PEC part of every expert it
does not take whole, and a load takes each part of each expert from its own newest stored version; sources
are keyed by part key (``expert/L0/E3/weights``), and an expert's lost tokens are those since its stalest part.

Usable without Lightning: give it a layout, the topology and a storage backend.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout, TensorSpec, slot_key
from moc_lightning.engine.ledger import NEVER, DynamicK, FaultReport, TokenLedger, check_k
from moc_lightning.engine.lineage import Lineage, LineageError
from moc_lightning.engine.manifest import CheckpointRecord, Manifest, ManifestError
from moc_lightning.engine.parts import PARTS, always_saved, part_key, part_key_of, part_of, split_part_key
from moc_lightning.engine.pieces import as_dtensors, check_supported, gather_holders, unit_replicas
from moc_lightning.engine.routing import RouterCounts
from moc_lightning.engine.selection import Selection, UnsavedTokens, every_expert, make_policy
from moc_lightning.engine.size_model import SizeModel, model_unit_bytes, size_model, stated_state_bytes
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit, parse_unit
from moc_lightning.runtime.distributed import collective_device
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.runtime.faults import fault_point
from moc_lightning.sharding.ownership import Ownership, ShardingUnit, Topology, plan_ownership
from moc_lightning.sharding.planner import MoCSavePlanner, RowRange, owned_bytes, shard_rows, whole_rows
from moc_lightning.sharding.replica_writes import replica_writes
from moc_lightning.storage import CheckpointStorage, CorruptCheckpointError, corrupt_from, find_cause
from moc_lightning.storage.integrity import ListedKeysPlanner
from moc_lightning.storage.sealed import SealError, seal, unseal

MANIFEST = "manifest.json"
RANK_STATE = "rank_state/{rank}"
"""DCP key of one rank's trainer state (loops, RNG, data position, ...) inside a persist: a bytes item each
rank writes itself, checksummed and committed with the checkpoint's tensors."""
PREVIOUS_MANIFEST = "manifest.previous.json"

COMMIT_POINTS = ("commit:description", "commit:previous_manifest", "commit:manifest", "commit:retention")
"""The points of the coordinator's commit at which ``PECCheckpointer.fault_hook`` is called, in order:

- ``commit:description``: before ``step_X/moc.json`` is put;
- ``commit:previous_manifest``: before ``manifest.previous.json`` (the manifest being replaced) is put;
- ``commit:manifest``: before ``manifest.json`` is put. That put is the commit point: a fault at any point
  up to here commits nothing (the manifest is unchanged) and the persist fails on every rank;
- ``commit:retention``: after the commit, before retention deletes the checkpoints the new manifest no
  longer lists. The persist is committed whatever happens from here on; a failed deletion is retried with
  the next commit.

Tests raise at these points; a chaos harness can SIGKILL at them.
"""


class UnreadableCheckpoint(Exception):
    """A stored checkpoint failed verification; recovery plans again without it."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"checkpoint {name} is unreadable: {detail}")
        self.name = name


class AgreedFailure(RuntimeError):
    """An operation on the persist group that failed on some rank, raised alike on every rank.

    ``failures`` maps each failing rank to what failed there (``"<where>: <Type>: <message>"``); the
    message names the lowest failing rank, so every rank's message is the same.
    """

    def __init__(self, what: str, failures: Mapping[int, str], outcome: str) -> None:
        rank, detail = min(failures.items())
        super().__init__(f"{what} failed on rank {rank} ({detail}); {outcome}")
        self.failures = dict(failures)


class PersistFailed(AgreedFailure):
    """A persist that failed on some rank: nothing of it is committed, and every rank raises this."""

    def __init__(self, name: str, failures: Mapping[int, str]) -> None:
        super().__init__(f"persist of {name}", failures, "nothing was committed")
        self.name = name


def checkpoint_name(step: int, final: bool = False) -> str:
    """Where the checkpoint of ``step`` lives; ``final``: the complete persist that supersedes a partial one
    of the same step (a separate location, so the committed partial one is never overwritten)."""
    return f"step_{step:09d}" + ("_final" if final else "")


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
    """Unit key -> step of the version that was loaded (``-1``: never stored, left at initialisation); of its
    stalest part under a ``pec_scope`` other than ``both``."""
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
        fault_hook: Callable[[str], None] | None = None,
    ) -> None:
        """``fault_hook``, if given, is called on the coordinator with each name in :data:`COMMIT_POINTS` as its
        commit reaches it (fault injection: what it raises fails the commit there)."""
        num_experts = layout.num_experts
        check_supported(layout.params)
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
        self.state_owners = gather_state_owners(layout)
        """Under ZeRO: unit key -> the rank keeping the unit's optimizer state, for every unit of the model; each
        unit is snapshotted whole there; a persist from the live tensors writes its optimizer state there and splits
        its replicated weights over their holders (:meth:`_zero_writes`). ``None`` when every holder keeps the state
        (DDP)."""
        self.piece_holders = gather_holders(
            {u.key: unit_replicas([layout.params[n] for n in layout.param_names(u)], topology.rank) for u in layout.units}
        ) if layout.sharded else None
        """Under FSDP2/HSDP (DTensor parameters, :mod:`moc_lightning.engine.pieces`): unit key -> the holders of each of its
        pieces (a piece's replicas under HSDP), for every unit of the model; each holder snapshots its own pieces, and
        a persist writes each piece once. ``None`` otherwise."""
        self._param_sources: dict[str, dict[str, Any]] | None = None
        self.lineage: Lineage | None = None
        """The run this engine's checkpoints belong to; ``None`` when the engine is used on its own."""
        self.model_description: dict[str, Any] | None = None
        """What writes the model back in its own format (:func:`moc_lightning.export.hf_format.describe_model`): its
        prefix in the module, class and config. Written into every ``moc.json``; ``None``: nothing to record."""
        self._k_choice_said: str | None = None
        self.stored_base: dict[str, int] = {}
        """Unit key -> step of its newest stored version when this process started (or recovered)."""
        self._every_unit_stored = False
        """Whether every unit is known to have a stored version in this lineage (see :meth:`_completes`)."""
        self.fault_hook = fault_hook
        self._reached = ""
        """The last commit point the coordinator's commit reached (named in a failure)."""
        self._undeleted: list[str] = []
        """Checkpoints retention retired whose deletion failed: deleted with the next commit."""

    def attach(self, layout: Layout) -> None:
        """Use ``layout`` from now on (same model, new optimizer object: after Lightning re-creates it)."""
        if layout.num_experts != self.layout.num_experts:
            raise ValueError(f"new layout has experts {layout.num_experts}, expected {self.layout.num_experts}")
        self.layout = layout
        self._unit_rows = {unit: _unit_rows(layout, unit) for unit in layout.units}
        self.state_owners = gather_state_owners(layout)

    def size_model(self) -> SizeModel:
        """Eq. 5/6 evaluated on this model's real tensors."""
        return size_model(self.layout)

    # ----------------------------------------------------------------- tokens
    def record_tokens(self, moe_layers: Sequence[RouterCounts]) -> None:
        """Add the router counts of the last step (this rank's tokens); reduced over ranks at checkpoint time."""
        for i, layer in enumerate(moe_layers):
            self._pending[i] += layer.tokens_per_expert.to("cpu", torch.int64)
            self._pending_assigned[i] += layer.tokens_assigned

    def mark_step(self, step: int, also_sum: Sequence[int] = ()) -> list[int]:
        """Reduce the router counts recorded since the last mark over all ranks (collective: every rank, on the
        training thread) and mark ``step`` in the ledger, as the step a checkpoint is taken at.

        ``also_sum``: integers of the caller's to sum over the ranks in the same all-reduce (one collective where
        a snapshot would need two; each waits for the slowest rank); returns their sums."""
        sums = self._sync_tokens(also_sum)
        self.ledger.mark(step)
        return sums

    def _sync_tokens(self, also_sum: Sequence[int]) -> list[int]:
        flat = torch.cat([
            *self._pending,
            torch.tensor(self._pending_assigned, dtype=torch.int64),
            torch.tensor(list(also_sum), dtype=torch.int64),
        ])
        if dist.is_initialized():
            # default group, on the training thread (persists use their own gloo group)
            flat = flat.to(collective_device())
            dist.all_reduce(flat)
            flat = flat.cpu()
        sizes = [len(p) for p in self._pending] + [len(self._pending_assigned), len(also_sum)]
        *counts, assigned, sums = flat.split(sizes)
        for i, c in enumerate(counts):
            self.ledger.record(i, c, int(assigned[i]))
        self._pending = [torch.zeros_like(p) for p in self._pending]
        self._pending_assigned = [0] * len(self._pending_assigned)
        return [int(v) for v in sums]

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
        whole = self.layout.dense_units + tuple(sorted(selection.persist_units()))
        report = self.persist(step, whole, parts=self.partial_parts(whole))
        self.prune_ledger()
        return report

    def partial_parts(self, whole: Collection[Unit]) -> tuple[str, ...]:
        """Part keys a checkpoint of the ``whole`` units saves besides them: the non-PEC part of every other
        expert (``checkpoint.pec_scope``); none under ``both``."""
        part = always_saved(self.cfg.pec_scope)
        if part is None:
            return ()
        return tuple(part_key(u.key, part) for u in self._all_units() if isinstance(u, ExpertUnit) and u not in whole)

    def part_tensors(self, parts: Iterable[str], local: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors of the units it holds among ``parts`` (part keys), as in-place views; ``local``: each
        DTensor as this rank's piece of it (what a snapshot copies)."""
        tensors: dict[str, torch.Tensor] = {}
        for key in parts:
            unit_key, part = split_part_key(key)
            unit = parse_unit(unit_key)
            if unit in self.layout.slots:
                held = self.layout.pieces([unit]) if local else self.layout.tensors([unit])
                tensors.update({k: t for k, t in held.items() if part_of(k) == part})
        return tensors

    def prune_ledger(self, in_memory: Sequence[int] = ()) -> None:
        """Forget token marks older than every stored version and every snapshot step in ``in_memory``."""
        steps = [r.step for r in self.read_manifest().records] + list(in_memory)
        if steps:
            self.ledger.prune(min(steps))

    def select(self, index: int, persist: bool, persisted: Sequence[SaveReport] | None = None) -> Selection:
        """The experts checkpoint number ``index`` snapshots (and persists, if ``persist``); advances the policy.

        ``load_aware`` and a complete first persist need the step each expert is stored at. With ``persisted`` (the
        persists every rank has seen succeed, in order) it is taken from :attr:`stored_base` plus those, the
        same on every rank; without it, from the manifest (safe only when no persist can be committing, as in
        :meth:`checkpoint`). A complete persist (every expert) still asks the policy, so that the rotation
        goes on from where it would have been: the schedule after it is exactly PEC's, with PEC's coverage
        bound, whether or not the first persist was complete or had to be retried.
        """
        unsaved = None
        if self.cfg.selection == "load_aware":
            stored = self._stored_steps(persisted)
            steps = [
                [stored.get(ExpertUnit(layer, e).key, NEVER) for e in range(n)]
                for layer, n in enumerate(self.layout.num_experts)
            ]
            since = self.ledger.tokens_since(steps)
            unsaved = UnsavedTokens(snapshot=since, persist=since)
        selection = self.policy.select(
            index, self.dynamic_k.k_snapshot, self.dynamic_k.k_persist, persist=persist, unsaved=unsaved
        )
        return every_expert(self.layout.num_experts) if persist and self._completes(persisted) else selection

    def needs_stored_steps(self, persist: bool) -> bool:
        """Whether :meth:`select` reads where units are stored: then it must be given the agreed persists
        while one may be committing (the manifest can be mid-commit on the coordinator)."""
        return self.cfg.selection == "load_aware" or (persist and self._may_lack_a_unit())

    def _completes(self, persisted: Sequence[SaveReport] | None = None) -> bool:
        """Whether a persist now must take every unit (``complete_first_persist``): some unit of the model has
        no stored version yet in this lineage (``persisted`` as in :meth:`select`)."""
        if not self._may_lack_a_unit():
            return False
        stored = self._stored_steps(persisted)
        self._every_unit_stored = all(unit.key in stored for unit in self._all_units())
        return not self._every_unit_stored

    def _may_lack_a_unit(self) -> bool:
        """False once every unit is known to be stored: retention never removes a unit's only version, so
        it stays so, and the stored view need not be read again."""
        return self.cfg.complete_first_persist and not self._every_unit_stored

    def base_on(self, manifest: Manifest) -> None:
        """Take ``manifest`` (the same on every rank) as what storage holds when training (re)starts."""
        self.stored_base = stored_steps(manifest)
        self._every_unit_stored = False

    def _stored_steps(self, persisted: Sequence[SaveReport] | None) -> dict[str, int]:
        if persisted is None:
            return stored_steps(self.read_manifest())
        steps = dict(self.stored_base)
        for report in persisted:
            steps.update(dict.fromkeys(report.units, report.step))
        return steps

    def persist(
        self,
        step: int,
        units: Sequence[Unit],
        *,
        parts: Sequence[str] = (),
        from_slot: Mapping[str, torch.Tensor] | None = None,
        engine_state: dict[str, Any] | None = None,
        trainer_state: str | None = None,
        before_commit: Callable[[], None] | None = None,
        supersede: bool = False,
        digests: tuple[str, ...] = (),
    ) -> SaveReport:
        """Write ``units`` whole and ``parts`` (part keys of other units, :meth:`partial_parts`), all ranks' share,
        as checkpoint ``step`` and commit it in the manifest.

        By default this rank writes the rows the ownership gives it, from the live tensors. With
        ``from_slot`` it writes those tensors (a snapshot slot: whole units it owns) as they are, and
        ``engine_state``/``trainer_state`` are the states captured with that snapshot. Every rank's own
        ``trainer_state`` is written as its bytes item :data:`RANK_STATE`; the coordinator's also goes into
        ``moc.json``, the fallback for a rank that finds no item of its own (a larger world size). ``digests``: what
        the record keeps of a final persist's live state (:attr:`CheckpointRecord.digests`).
        """
        start = time.perf_counter()
        name = checkpoint_name(step, final=supersede)
        param_sources = self._gather_param_sources()  # collective on first use: every rank, before anything fails
        self._agree_on_lineage(name)
        written = 0
        failure: _Failure | None = None
        try:
            if from_slot is None:
                state: dict[str, Any] = self.layout.tensors([u for u in units if u in self.layout.slots])
                state.update(self.part_tensors(parts))
                writes = self._writes(units, state, parts)
            elif self.piece_holders is not None:  # a slot's local pieces, placed at their offsets again
                live = self.layout.tensors([u for u in units if u in self.layout.slots]) | self.part_tensors(parts)
                state = as_dtensors(from_slot, live)
                writes = self._piece_writes(state)
            else:
                state = dict(from_slot)
                writes = None if self.cfg.sharding == "dcp_default" else {k: whole_rows(t) for k, t in state.items()}
            if trainer_state is not None:  # this rank's own: RNG and data position differ per rank
                rank_key = RANK_STATE.format(rank=self.topology.rank)
                state[rank_key] = trainer_state
                if writes is not None:
                    writes[rank_key] = (0, 1)
            planner = MoCSavePlanner(writes)
            dcp.save(state, storage_writer=self.storage.writer(name), planner=planner, process_group=self.process_group)
            written = owned_bytes(planner.plan)  # the final local plan, after any deduplication
            if before_commit is not None:
                before_commit()
        except (Exception, CheckpointException) as err:  # DCP's failures are BaseExceptions
            failure = _Failure.of("write", err, self._rank)
        self._agree_on_persist(name, failure)

        record = CheckpointRecord(
            name=name,
            step=step,
            units=tuple(u.key for u in units),
            parts=tuple(parts),
            strategy=self.cfg.sharding,
            world_size=self.topology.world_size,
            ep=self.topology.ep,
            backend=self.backend,
            digests=digests,
        )
        retired: list[str] = []
        if self._is_coordinator:
            try:
                self._reached = "describe"
                description = self._describe(record, param_sources, engine_state or self.state_dict(), trainer_state)
                retired = self._commit(record, description, supersede)
            except (Exception, CheckpointException) as err:
                failure = _Failure.of(self._reached, err, self._rank)
        self._agree_on_persist(name, failure)
        report = SaveReport(
            step=step,
            name=name,
            units=record.units,
            bytes_written=written,
            expected_bytes=sum(self.unit_nbytes(u) for u in units)
            + sum(self.unit_nbytes(parse_unit(u), part) for u, part in map(split_part_key, parts)),
            seconds=time.perf_counter() - start,
        )
        if self._is_coordinator:  # after the commit, and after the persist's clock
            self._retire(retired)
        return report

    def _agree_on_lineage(self, name: str) -> None:
        """Before any rank writes: the storage must still belong to this run's lineage (another run started at
        the same URL would otherwise get its checkpoint directory overwritten). Checked again at the commit."""
        if self.lineage is None:
            return
        failure = None
        if self._is_coordinator:
            try:
                self._check_lineage(self.read_manifest(), name)
            except (Exception, CheckpointException) as err:
                failure = _Failure.of("lineage", err, self._rank)
        self._agree_on_persist(name, failure, discard=False)  # nothing was written: nothing to remove

    def _check_lineage(self, current: Manifest, name: str) -> None:
        """Raise :class:`LineageError` unless the committed manifest ``current`` is of this run's lineage."""
        if self.lineage is not None and (current.lineage is None or current.lineage.run_id != self.lineage.run_id):
            found = current.lineage.run_id if current.lineage else "none"
            raise LineageError(
                f"{self.storage.url} now belongs to lineage {found}, not to this run's ({self.lineage.run_id}); "
                f"checkpoint {name} is not committed (did another run start at the same storage URL?)"
            )

    def _agree_on_persist(self, name: str, failure: _Failure | None, discard: bool = True) -> None:
        """Share this rank's outcome of a persist phase; if any rank failed, every rank raises :class:`PersistFailed`.

        Runs on every rank whatever happened (the collective that keeps the persist group in step). With
        ``discard``, before anyone raises, the coordinator removes the failed attempt's directory (a retry at
        the same step then starts from an empty location, and a full disk gets its space back).
        """
        failures = self._failures(failure)
        if not failures:
            return
        if discard:
            if self._is_coordinator:
                self._discard_attempt(name)
            self._barrier()  # the directory is gone before any rank can start a retry that writes to it
        raise PersistFailed(name, failures) from (failure.error if failure is not None else None)

    def _failures(self, failure: _Failure | None) -> dict[int, str]:
        """Every rank's failure (failing rank -> what failed), gathered from all ranks of the persist group."""
        mine = None if failure is None else (failure.rank, failure.text)
        outcomes: list[tuple[int, str] | None] = [mine]
        if dist.is_initialized():
            outcomes = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(outcomes, mine, group=self.process_group)
        return dict(sorted(o for o in outcomes if o is not None))

    def _discard_attempt(self, name: str) -> None:
        """Delete the location of a persist that failed, unless a committed manifest lists it (then it is not
        this attempt's to delete); best effort: what cannot be deleted is garbage no manifest names."""
        try:
            if self._listed(name):
                return
            self.storage.delete(name)
        except Exception as err:  # noqa: BLE001 - cleanup must not replace the failure being reported
            print(f"[moc_lightning] could not remove {name} after its failed persist ({err}); no manifest names it")

    def _listed(self, name: str) -> bool:
        return any(r.name == name for r in self.read_manifest().records)

    def _at(self, point: str) -> None:
        """Reach commit point ``point`` (one of :data:`COMMIT_POINTS`)."""
        self._reached = point
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _commit(self, record: CheckpointRecord, description: dict[str, Any], supersede: bool = False) -> list[str]:
        """Self-description first, then the manifest (the commit point); returns what retention retired, for
        the caller to delete once every rank knows the commit is done."""
        self._at("commit:description")
        self.storage.put(f"{record.name}/moc.json", seal(description))
        current = self.read_manifest()
        self._check_lineage(current, record.name)
        if supersede:
            replaced = current.latest
            manifest, removed = current.superseded_by(record).retire(self.cfg.retention)
            removed.append(replaced.name)
        else:
            manifest, removed = current.with_record(record).retire(self.cfg.retention)
        self._at("commit:previous_manifest")
        self.storage.put(PREVIOUS_MANIFEST, current.to_json())  # the fallback if the new one gets damaged
        self._at("commit:manifest")
        fault_point("manifest_commit", record.step)
        try:
            self.storage.put(MANIFEST, manifest.to_json())
        except (Exception, CheckpointException):
            if not self._listed_safely(record.name):
                raise
            print(f"[moc_lightning] the manifest put for {record.name} raised after the manifest landed; committed")
        return removed

    def _listed_safely(self, name: str) -> bool:
        """Whether the committed manifest lists ``name``; ``False`` when it cannot be read."""
        try:
            return self._listed(name)
        except Exception:  # noqa: BLE001 - unknown: report the commit as failed
            return False

    def _retire(self, retired: list[str]) -> None:
        """Delete checkpoints no committed manifest lists any more (and any whose deletion failed before).

        After the commit point: a failure here is logged and retried with the next commit, never a failed persist.
        """
        pending, self._undeleted = [*self._undeleted, *retired], []
        try:
            self._at("commit:retention")
            while pending:
                self.storage.delete(pending[0])
                pending.pop(0)
        except Exception as err:  # noqa: BLE001 - the persist is committed; the deletion is retried
            self._undeleted = pending
            print(f"[moc_lightning] retention could not delete {pending} ({err}); retried with the next commit")

    def _describe(
        self,
        record: CheckpointRecord,
        param_sources: dict[str, dict[str, Any]],
        engine_state: dict[str, Any],
        trainer_state: str | None,
    ) -> dict[str, Any]:
        """The record, the engine state, the model parameter behind each weight key stored here, and the model.

        The parameter map and the model description let ``moc-consolidate`` write a dense checkpoint under
        the model's own names, in its own format, without building the model.
        """
        held = set(record.units) | {u for u, part in map(split_part_key, record.parts) if part == "weights"}
        return {
            "record": dataclasses.asdict(record),
            "lineage": self.lineage.stamp() if self.lineage is not None else None,
            "engine": engine_state,
            "trainer": trainer_state,
            "layout": {
                "num_experts": list(self.layout.num_experts),
                "params": {key: src for key, src in param_sources.items() if parse_unit(key).key in held},
                "aliases": dict(self.layout.aliases),
            },
            "model": self.model_description,
        }

    def _gather_param_sources(self) -> dict[str, dict[str, Any]]:
        """Weight and buffer key -> ``{"param": name, "index": stacked slice or None, "view": [E, I, ...] or None}``
        of every unit on any rank.

        ``view`` is the shape a flattened stacked parameter (DBRX's ``[E*I, H]``) was sliced through, so that
        consolidation rejoins the slices into the parameter's own shape, not ``[E, I, H]``. Gathered once from
        all ranks, because under expert parallelism the coordinator that describes a checkpoint does not hold
        the other ranks' experts.
        """
        if self._param_sources is None:
            local = {
                slot_key(unit, slot): {
                    "param": slot.param, "index": slot.index, "view": list(slot.view) if slot.view else None
                }
                for unit, slots in self.layout.slots.items()
                for slot in slots
            }
            parts: list[dict[str, dict[str, Any]] | None] = [local]
            if dist.is_initialized():
                parts = [None] * dist.get_world_size(self.process_group)
                dist.all_gather_object(parts, local, group=self.process_group)
            self._param_sources = {key: src for part in parts for key, src in part.items()}
        return self._param_sources

    def _writes(
        self, units: Sequence[Unit], state: dict[str, torch.Tensor], parts: Sequence[str] = ()
    ) -> dict[str, RowRange] | None:
        """Rows of every local tensor this rank writes, from the ownership of ``units`` and of the units of
        ``parts`` (sized by that part); under ZeRO, :meth:`_zero_writes`; under FSDP2, its pieces
        (:meth:`_piece_writes`)."""
        if self.piece_holders is not None:
            return self._piece_writes(state)
        if self.cfg.sharding == "dcp_default":
            return None
        partial = {parse_unit(u): part for u, part in map(split_part_key, parts)}
        if self.state_owners is not None:
            return self._zero_writes(units, state, partial)
        sharding_units = tuple(self._sharding_unit(u) for u in units) + tuple(
            self._sharding_unit(u, part) for u, part in partial.items()
        )
        return self._owned_rows(plan_ownership(sharding_units, self._sharding_topology, self.cfg.sharding), state)

    def _zero_writes(
        self, units: Sequence[Unit], state: Mapping[str, torch.Tensor], partial: Mapping[Unit, str]
    ) -> dict[str, RowRange]:
        """Under ZeRO: the optimizer state of the saved units whose state this rank keeps, whole (no other rank
        holds it), and the rows of the saved weights that ownership gives it. The weights are replicated over
        their holders as under DDP, so ``checkpoint.sharding`` splits them as it does there; ``adaptive`` counts
        the optimizer bytes each owner writes anyway when it places them (the paper's AN, section 4.3)."""
        saved = [(u, None) for u in units] + list(partial.items())
        loads = [0] * self.topology.world_size
        for unit, part in saved:
            if part != "weights":
                loads[self.state_owners[unit.key]] += self.unit_nbytes(unit, "optimizer")
        weights = tuple(self._sharding_unit(u, "weights") for u, part in saved if part != "optimizer")
        ownership = plan_ownership(weights, self._sharding_topology, self.cfg.sharding, base_loads=loads)
        writes = self._owned_rows(ownership, {k: t for k, t in state.items() if part_of(k) == "weights"})
        rank = self.topology.rank
        for key, tensor in state.items():
            if part_of(key) == "optimizer" and self.state_owners[parse_unit(key).key] == rank:
                writes[key] = whole_rows(tensor)
        return writes

    @property
    def _sharding_topology(self) -> Topology:
        return Topology(self.topology.world_size, self.topology.ep)

    def _owned_rows(self, ownership: Ownership, state: Mapping[str, torch.Tensor]) -> dict[str, RowRange]:
        """Rows of each tensor in ``state`` that ``ownership`` gives this rank (a scalar whole, to its first row's
        writer); a key of a unit ``ownership`` does not cover is not written."""
        by_unit: dict[str, list[str]] = {}
        for key in state:
            by_unit.setdefault(parse_unit(key).key, []).append(key)
        writes: dict[str, RowRange] = {}
        for unit, shard in ownership.writes_of(self.topology.rank):
            for key in by_unit.get(unit.key, ()):
                if (rows := shard_rows(shard, unit.rows, state[key])) is not None:
                    writes[key] = rows
        return writes

    def _piece_writes(self, state: Mapping[str, torch.Tensor]) -> dict[str, RowRange]:
        """Under FSDP2/HSDP: every DTensor's local piece, whole when no other rank holds it, else this rank's share of
        it among its replicas (:mod:`moc_lightning.sharding.replica_writes`; DCP records the offsets); a plain tensor beside
        them (Adam's scalar ``step``, alike on every holder) by the unit's first holder."""
        writes = replica_writes(state, self.topology.rank, self.cfg.sharding)
        for key, tensor in state.items():
            if not isinstance(tensor, DTensor) and self.piece_holders[parse_unit(key).key][0][0] == self.topology.rank:
                writes[key] = whole_rows(tensor)
        return writes

    def _sharding_unit(self, unit: Unit, part: str | None = None) -> ShardingUnit:
        rows = self._unit_rows[self.local_twin(unit)]
        nbytes = self.unit_nbytes(unit, part)
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

    def unit_nbytes(self, unit: Unit, part: str | None = None) -> int:
        """Weights and optimizer state of ``unit`` in bytes, whether or not this rank holds it (or, under ZeRO,
        keeps its optimizer state: :func:`model_unit_bytes`); with ``part``, of that part only (``weights``:
        with the persistent buffers)."""
        size = model_unit_bytes(self.layout, self.local_twin(unit))
        return {None: size.total, "weights": size.weights + size.buffers, "optimizer": size.optimizer}[part]

    def snapshot_share_bytes(self, with_optimizer_state: bool = False, complete: bool = False) -> int:
        """What one rank's snapshot slot should hold at the current ``k_snapshot`` (``complete``: with every
        expert, as the snapshot of a complete first persist).

        Snapshot ownership spreads the dense units and ``k_snapshot`` experts per MoE layer over the ranks
        in whole units, balanced by bytes: an even share plus the largest unit covers the imbalance. Under
        ZeRO each unit is snapshotted by its state owner: this rank's dense units and, per MoE layer, its
        ``k_snapshot`` largest experts; under FSDP2 each holder snapshots its pieces of them, so the same count
        over the local bytes. Under a ``pec_scope`` other than ``both`` the other experts' non-PEC part is added.
        ``with_optimizer_state``: before the optimizer's first step (no state yet), count the state it will create
        (:func:`expected_state_bytes`).
        """
        rest = always_saved(self.cfg.pec_scope)
        local = self.piece_holders is not None

        def nbytes(unit: Unit, part: str | None = None) -> int:
            size = self.layout.unit_bytes(self.local_twin(unit), local=local)
            state = size.optimizer
            if with_optimizer_state and state == 0:
                state = expected_state_bytes(self.layout, self.local_twin(unit), local=local)
            weights = size.weights + size.buffers
            return {None: weights + state, "weights": weights, "optimizer": state}[part]

        if self.state_owners is not None or local:
            mine = [
                u for u in self.layout.units if local or self.state_owners[u.key] == self.topology.rank
            ]
            total = sum(nbytes(u) for u in mine if not isinstance(u, ExpertUnit))
            for layer, n in enumerate(self.layout.num_experts):
                layer_units = sorted(
                    (u for u in mine if isinstance(u, ExpertUnit) and u.layer == layer), key=nbytes, reverse=True
                )
                k = n if complete else self.dynamic_k.k_snapshot
                total += sum(nbytes(u) for u in layer_units[:k])
                total += sum(nbytes(u, rest) for u in layer_units[k:]) if rest is not None else 0
            return total

        dense = [nbytes(u) for u in self.layout.dense_units]
        experts = [ExpertUnit(layer, 0) for layer in range(len(self.layout.num_experts))]
        per_layer = self.layout.num_experts if complete else [self.dynamic_k.k_snapshot] * len(experts)
        total = sum(dense) + sum(k * nbytes(unit) for k, unit in zip(per_layer, experts))
        if rest is not None:
            total += sum((n - k) * nbytes(unit, rest) for n, k, unit in zip(self.layout.num_experts, per_layer, experts))
        return -(-total // self.topology.world_size) + max(dense + [nbytes(u) for u in experts], default=0)

    # ------------------------------------------------------------------- load
    def read_manifest(self) -> Manifest:
        """The committed manifest; if it is unreadable, the one committed before it (and say so)."""
        return read_manifest(self.storage)

    def read_description(self, record: CheckpointRecord) -> dict[str, Any]:
        """The verified ``moc.json`` of checkpoint ``record``: its record, engine and trainer state, parameter map."""
        return read_description(self.storage, record.name)

    def load_latest(self) -> LoadReport | None:
        """Restore the newest readable state in storage; ``None`` if there is none.

        A checkpoint that fails verification (checksum, truncated or missing file, bad metadata) is dropped
        from the manifest, everything the failed attempt loaded is rolled back, and the load is planned again from
        the versions before it.
        """
        manifest = self.read_manifest()
        before = self.layout.rollback_point()
        while manifest.latest is not None:
            try:
                return self._load_newest(manifest)
            except UnreadableCheckpoint as bad:
                self.layout.roll_back(before)
                manifest = self.forget(manifest, bad)
        return None

    def commit_lineage(self, manifest: Manifest) -> None:
        """Commit ``manifest``, whose records are the committed ones and whose lineage gained a segment
        (collective; the coordinator writes)."""
        if self._is_coordinator:
            self.storage.put(MANIFEST, manifest.to_json())
        self._barrier()

    def forget(self, manifest: Manifest, bad: UnreadableCheckpoint) -> Manifest:
        """Drop an unreadable checkpoint from ``manifest`` and commit that, so nothing builds on it again."""
        print(f"[moc_lightning] {bad}; falling back to the versions stored before {bad.name}")
        manifest = manifest.without({bad.name})
        failure: _Failure | None = None
        if self._is_coordinator:
            try:
                self.storage.put(MANIFEST, manifest.to_json())
            except (Exception, CheckpointException) as err:
                failure = _Failure.of("manifest put", err, self._rank)
        failures = self._failures(failure)  # every rank learns whether the manifest changed
        if failures:
            error = AgreedFailure(f"dropping {bad.name} from the manifest", failures, "the manifest is unchanged")
            raise error from (failure.error if failure is not None else None)
        return manifest

    def _load_newest(self, manifest: Manifest) -> LoadReport:
        latest = manifest.latest
        self.load_state_dict(self.read_description(latest)["engine"])
        missing = [u.key for u in self.layout.dense_units if not latest.holds(u.key)]
        if missing:
            raise RuntimeError(f"checkpoint {latest.name} lacks dense units {missing[:5]}; it cannot be resumed")
        sources = {
            part_key(unit.key, part): manifest.newest(unit.key, at_or_before=latest.step, part=part)
            for unit in self._all_units()
            for part in PARTS
        }
        stored = {k: r for k, r in sources.items() if r is not None}
        self.prepare_for_load(stored, self.stored_specs(stored))
        self.load_from_storage(stored)
        steps = {k: r.step if r is not None else NEVER for k, r in sources.items()}
        return self.account_recovery(latest.step, self.stalest_parts(steps))

    def stalest_parts(self, steps: Mapping[str, int]) -> list[list[int]]:
        """Per MoE layer, the step of each expert's stalest part (``steps``: part key -> step it was restored from).

        The expert's state is not its state of any step newer than that, so the tokens it processed since then
        are its lost tokens (eq. 7), whichever part is stale: the paper's PLT counts the tokens of experts whose
        state was not saved, and under ``pec_scope=optimizer`` (``weights``) an expert whose optimizer state
        (weights) is stale has not kept what those tokens taught it.
        """
        return [
            [min(steps[part_key(ExpertUnit(layer, e).key, part)] for part in PARTS) for e in range(n)]
            for layer, n in enumerate(self.layout.num_experts)
        ]

    def prepare_for_load(self, parts: Iterable[str], specs: Mapping[str, TensorSpec]) -> None:
        """Give the units whose optimizer part is among the restored ``parts`` (part keys) exactly the optimizer
        state their sources hold (``specs``: the slot entries' and DCP metadata's keys, shapes and dtypes), as
        tensors to load into; see :meth:`Layout.reset_optimizer_state`. Call it once for every restore, before
        any load."""
        units = [parse_unit(k) for k in parts if split_part_key(k)[1] == "optimizer"]
        self.layout.reset_optimizer_state(units, specs)

    def stored_specs(self, sources: Mapping[str, CheckpointRecord]) -> dict[str, TensorSpec]:
        """Key -> (shape, dtype) of every tensor of the parts in ``sources`` (part key -> checkpoint), from each
        checkpoint's DCP metadata (an expert's slice of a stacked tensor as the slice)."""
        specs: dict[str, TensorSpec] = {}
        for record in set(sources.values()):
            held = {k for k, r in sources.items() if r is record}
            for key, spec in self._stored_tensors(record).items():
                if part_key_of(key) in held:
                    specs[key] = spec
        return specs

    def _stored_tensors(self, record: CheckpointRecord) -> dict[str, TensorSpec]:
        """Shapes and dtypes of the tensors checkpoint ``record`` holds, from its DCP metadata."""
        try:
            metadata = self.storage.reader(record.name).read_metadata()
        except CorruptCheckpointError as err:  # the same file on every rank: every rank decides alike
            raise UnreadableCheckpoint(record.name, str(err)) from err
        return {
            key: (tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def load_from_storage(self, sources: Mapping[str, CheckpointRecord], skip: Collection[str] = ()) -> None:
        """Load every held part in ``sources`` (part key -> checkpoint) from its checkpoint, one collective DCP
        load per checkpoint.

        ``sources`` must be the same on every rank (it comes from the shared manifest): each rank loads the
        parts of the units it holds, under whatever world size and EP degree wrote them. Optimizer state is loaded where
        the checkpoint has it (a parameter saved without state has none to load); a weight or buffer it
        lacks is damage. Keys in ``skip`` are not loaded (a shared state another source provides).
        """
        for record in sorted(set(sources.values()), key=lambda r: r.step):
            held = {k for k, r in sources.items() if r is record}
            wanted = [u for u in self.layout.units if any(part_key(u.key, p) in held for p in PARTS)]
            stored = self._stored_tensors(record)
            tensors = {
                k: t for k, t in self.layout.tensors(wanted).items()
                if part_key_of(k) in held and (k in stored or "/optim/" not in k) and k not in skip
            }
            try:
                dcp.load(
                    tensors,
                    storage_reader=self.storage.reader(record.name),
                    planner=ListedKeysPlanner(record.name),  # a listed unit it lacks is damage, not a bug
                    process_group=self.process_group,
                )
            except CheckpointException as err:  # DCP gathers every rank's failure: all ranks decide alike
                corrupt = corrupt_from(err)
                if corrupt is None:
                    raise
                raise UnreadableCheckpoint(record.name, str(corrupt)) from err

    def read_rank_state(self, record: CheckpointRecord) -> Any:
        """This rank's own trainer state stored with checkpoint ``record`` (collective over the persist
        group); ``None`` when it holds none for this rank."""
        name = record.name
        key = RANK_STATE.format(rank=self.topology.rank)
        try:
            metadata = self.storage.reader(name).read_metadata()
        except CorruptCheckpointError as err:
            raise UnreadableCheckpoint(name, str(err)) from err
        wanted: dict[str, Any] = {key: None} if key in metadata.state_dict_metadata else {}
        try:
            dcp.load(wanted, storage_reader=self.storage.reader(name), process_group=self.process_group)
        except CheckpointException as err:
            corrupt = corrupt_from(err)
            if corrupt is None:
                raise
            raise UnreadableCheckpoint(name, str(corrupt)) from err
        return wanted.get(key)

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
        """Restore the engine state of a checkpoint; K follows :meth:`DynamicK.load_state_dict` (and says so)."""
        self.snapshots_taken = int(state["snapshots_taken"])
        self.policy.load_state_dict(state["selection"])
        self.ledger.load_state_dict(state["ledger"])
        self.dynamic_k.load_state_dict(state["dynamic_k"])
        choice = self.dynamic_k.describe_choice(state["dynamic_k"])
        if choice is not None and self.topology.rank == 0 and choice != self._k_choice_said:
            print(f"[moc_lightning] {choice}")
            self._k_choice_said = choice

    @property
    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if dist.is_initialized() else 0

    @property
    def _is_coordinator(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.process_group) == 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.process_group)


def expected_state_bytes(layout: Layout, unit: Unit, local: bool = False) -> int:
    """Optimizer state ``unit`` will have once stepped, for sizing before the optimizer has created any: what the
    optimizer states (:func:`stated_state_bytes`), else :func:`expected_state_ratio` of its weights (``local``: of
    this rank's pieces of them)."""
    stated = stated_state_bytes(layout, unit)
    if stated is not None:
        return stated
    return int(layout.unit_bytes(unit, local=local).weights * expected_state_ratio(layout.optimizer))


def gather_state_owners(layout: Layout) -> dict[str, int] | None:
    """Every unit's ZeRO state owner (:attr:`Layout.state_owners` of each rank, gathered over the default group on
    the training thread, where a persist's own group may be busy: collective under ZeRO), by unit key; ``None``
    without ZeRO."""
    local = layout.state_owners
    if local is None:
        return None
    mine = {u.key: r for u, r in local.items()}
    parts: list[dict[str, int]] = [mine]
    if dist.is_initialized():
        parts = [{}] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    owners: dict[str, int] = {}
    for part in parts:
        for key, rank in part.items():
            if owners.setdefault(key, rank) != rank:
                raise ValueError(f"ranks disagree on the ZeRO owner of unit {key} ({owners[key]} and {rank})")
    return owners


def expected_state_ratio(optimizer: torch.optim.Optimizer | None) -> float:
    """Optimizer state per byte of weights, for sizing before the optimizer has created any: two moments for
    the Adam family, one buffer for SGD with momentum and Adagrad, two (the Adam case) when unknown."""
    if optimizer is None:
        return 0.0
    name = type(optimizer).__name__
    if name == "SGD":
        return 1.0 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0.0
    return {"Adagrad": 1.0, "RMSprop": 1.0, "Adadelta": 2.0}.get(name, 2.0)


def read_manifest(storage: CheckpointStorage) -> Manifest:
    """The committed manifest under ``storage``; if it is unreadable (damaged, or failing its CRC32C), the one
    committed before it, saying so. No manifest is an empty one."""
    data = storage.get(MANIFEST)
    if data is None:
        return Manifest()
    try:
        return Manifest.from_json(data)
    except ManifestError as err:
        previous = storage.get(PREVIOUS_MANIFEST)
        if previous is None:
            raise ManifestError(f"{storage.url}/{MANIFEST} is unreadable ({err}) and no previous "
                                "manifest exists to fall back to") from err
        manifest = Manifest.from_json(previous)
        print(f"[moc_lightning] {MANIFEST} is unreadable ({err}); using the previous manifest "
              f"(latest step {manifest.latest.step if manifest.latest else None})")
        return manifest


def read_description(storage: CheckpointStorage, name: str) -> dict[str, Any]:
    """The verified ``moc.json`` of checkpoint ``name``; :class:`UnreadableCheckpoint` if missing or damaged."""
    data = storage.get(f"{name}/moc.json")
    if data is None:
        raise UnreadableCheckpoint(name, f"{name}/moc.json is missing")
    try:
        return unseal(data)
    except SealError as err:
        raise UnreadableCheckpoint(name, f"{name}/moc.json {err}") from err


@dataclass(frozen=True)
class _Failure:
    """One rank's failure of a phase: the rank it happened on, one line saying what, and (locally) the error."""

    rank: int
    text: str
    error: BaseException | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, where: str, err: BaseException, rank: int) -> _Failure:
        """``err`` raised at ``where`` on ``rank``: DCP reports every rank's failure on every rank, so the
        rank that really failed is taken from it; the OS error behind it (a full disk) is named if any."""
        dcp_failure = find_cause(err, CheckpointException)
        cause: BaseException = err
        if dcp_failure is not None and dcp_failure.failures:
            rank, (cause, _) = min(dcp_failure.failures.items())
        cause = find_cause(cause, OSError) or cause
        return cls(rank, f"{where}: {type(cause).__name__}: {cause}"[:500], err)


def _unit_rows(layout: Layout, unit: Unit) -> int:
    """Rows a unit is split into: the longest dim 0 among its tensors (1 for scalar-only units)."""
    return max([t.shape[0] for t in layout.tensors([unit]).values() if t.dim() > 0] or [1])


def stored_steps(manifest: Manifest) -> dict[str, int]:
    """Unit key -> step of its newest version listed in ``manifest``."""
    return {unit: record.step for record in manifest.records for unit in record.units}


