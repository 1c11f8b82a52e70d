"""A persist: every rank writes its share through DCP with :class:`MoCSavePlanner`, then the coordinator commits.

Every rank learns the outcome of each phase (one small all-gather each, :mod:`moc_lightning.pec.outcomes`), so a
persist ends alike everywhere: the same :class:`SaveReport`, or the same :class:`PersistFailed` with nothing
committed and the failed attempt's directory removed. The other writes of the manifest a run makes (a lineage
segment, dropping an unreadable checkpoint) go through the same agreement.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.engine.parts import split_part_key
from moc_lightning.engine.slots import slot_key
from moc_lightning.engine.units import Unit, parse_unit
from moc_lightning.pec.commit import ManifestCommit
from moc_lightning.pec.outcomes import (
    AgreedFailure,
    Failure,
    PersistFailed,
    barrier,
    gather_failures,
    group_rank,
    is_coordinator,
)
from moc_lightning.pec.stored import MANIFEST, RANK_STATE, UnreadableCheckpoint, checkpoint_name, read_manifest
from moc_lightning.pec.write_plan import WritePlan
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.sharding.planner import MoCSavePlanner, owned_bytes
from moc_lightning.storage import CheckpointStorage


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
class Stamp:
    """What a persist writes into its ``moc.json`` besides its tensors: the engine state and the run it belongs to."""

    engine_state: dict[str, Any]
    """Selection cursor, ledger, K and counters (:meth:`PECCheckpointer.state_dict`) of the persisted step."""
    lineage: Lineage | None
    """The run the checkpoint belongs to; ``None`` for an engine used on its own."""
    model_description: dict[str, Any] | None
    """What writes the model back in its own format; ``None``: nothing to record."""


class Persister:
    """Persists and the manifest writes of one storage, agreed on by every rank of the persist group.

    Public: :meth:`persist`, :meth:`commit_lineage`, :meth:`forget`; ``committer`` (the coordinator's
    :class:`ManifestCommit`, whose ``fault_hook`` injects faults).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        plan: WritePlan,
        topology: ExpertParallelTopology,
        storage: CheckpointStorage,
        backend: str,
        process_group: dist.ProcessGroup | None,
        fault_hook: Callable[[str], None] | None = None,
    ) -> None:
        self._sharding = cfg.sharding
        self._plan = plan
        self._topology = topology
        self._storage = storage
        self._backend = backend
        self._group = process_group
        self.committer = ManifestCommit(storage, cfg.retention, fault_hook)
        self._param_sources: dict[str, dict[str, Any]] | None = None

    def persist(
        self,
        step: int,
        units: Sequence[Unit],
        stamp: Stamp,
        *,
        parts: Sequence[str] = (),
        from_slot: Mapping[str, torch.Tensor] | None = None,
        trainer_state: str | None = None,
        before_commit: Callable[[], None] | None = None,
        supersede: bool = False,
        digests: tuple[str, ...] = (),
    ) -> SaveReport:
        """Write ``units`` whole and ``parts``, all ranks' share, as checkpoint ``step`` and commit it in the
        manifest with ``stamp`` (see :meth:`PECCheckpointer.persist` for the arguments)."""
        start = time.perf_counter()
        name = checkpoint_name(step, final=supersede)
        param_sources = self._gather_param_sources()  # collective on first use: every rank, before anything fails
        self._agree_on_lineage(name, stamp.lineage)
        written = 0
        failure: Failure | None = None
        try:
            state, writes = self._plan.persisted_state(units, parts, from_slot)
            if trainer_state is not None:  # this rank's own: RNG and data position differ per rank
                rank_key = RANK_STATE.format(rank=self._topology.rank)
                state[rank_key] = trainer_state
                if writes is not None:
                    writes[rank_key] = (0, 1)
            planner = MoCSavePlanner(writes)
            dcp.save(state, storage_writer=self._storage.writer(name), planner=planner, process_group=self._group)
            written = owned_bytes(planner.plan)  # the final local plan, after any deduplication
            if before_commit is not None:
                before_commit()
        except (Exception, CheckpointException) as err:  # DCP's failures are BaseExceptions
            failure = Failure.of("write", err, group_rank(self._group))
        self._agree_on_persist(name, failure)

        record = CheckpointRecord(
            name=name,
            step=step,
            units=tuple(u.key for u in units),
            parts=tuple(parts),
            strategy=self._sharding,
            world_size=self._topology.world_size,
            ep=self._topology.ep,
            backend=self._backend,
            digests=digests,
        )
        retired: list[str] = []
        if is_coordinator(self._group):
            try:
                describe = lambda: self._describe(record, param_sources, stamp, trainer_state)  # noqa: E731
                retired = self.committer.commit(record, describe, stamp.lineage, supersede)
            except (Exception, CheckpointException) as err:
                failure = Failure.of(self.committer.reached, err, group_rank(self._group))
        self._agree_on_persist(name, failure)
        plan = self._plan
        report = SaveReport(
            step=step,
            name=name,
            units=record.units,
            bytes_written=written,
            expected_bytes=sum(plan.unit_nbytes(u) for u in units)
            + sum(plan.unit_nbytes(parse_unit(u), part) for u, part in map(split_part_key, parts)),
            seconds=time.perf_counter() - start,
        )
        if is_coordinator(self._group):  # after the commit, and after the persist's clock
            self.committer.retire(retired)
        return report

    def commit_lineage(self, manifest: Manifest) -> None:
        """Commit ``manifest``, whose records are the committed ones and whose lineage gained a segment
        (collective; the coordinator writes)."""
        if is_coordinator(self._group):
            self._storage.put(MANIFEST, manifest.to_json())
        barrier(self._group)

    def forget(self, manifest: Manifest, bad: UnreadableCheckpoint) -> Manifest:
        """Drop an unreadable checkpoint from ``manifest`` and commit that, so nothing builds on it again."""
        print(f"[moc_lightning] {bad}; falling back to the versions stored before {bad.name}")
        manifest = manifest.without({bad.name})
        failure: Failure | None = None
        if is_coordinator(self._group):
            try:
                self._storage.put(MANIFEST, manifest.to_json())
            except (Exception, CheckpointException) as err:
                failure = Failure.of("manifest put", err, group_rank(self._group))
        failures = gather_failures(failure, self._group)  # every rank learns whether the manifest changed
        if failures:
            error = AgreedFailure(f"dropping {bad.name} from the manifest", failures, "the manifest is unchanged")
            raise error from (failure.error if failure is not None else None)
        return manifest

    def _agree_on_lineage(self, name: str, lineage: Lineage | None) -> None:
        """Before any rank writes: the storage must still belong to this run's lineage (another run started at
        the same URL would otherwise get its checkpoint directory overwritten). Checked again at the commit."""
        if lineage is None:
            return
        failure = None
        if is_coordinator(self._group):
            try:
                self.committer.check_lineage(read_manifest(self._storage), name, lineage)
            except (Exception, CheckpointException) as err:
                failure = Failure.of("lineage", err, group_rank(self._group))
        self._agree_on_persist(name, failure, discard=False)  # nothing was written: nothing to remove

    def _agree_on_persist(self, name: str, failure: Failure | None, discard: bool = True) -> None:
        """Share this rank's outcome of a persist phase; if any rank failed, every rank raises :class:`PersistFailed`.

        Runs on every rank whatever happened (the collective that keeps the persist group in step). With
        ``discard``, before anyone raises, the coordinator removes the failed attempt's directory (a retry at
        the same step then starts from an empty location, and a full disk gets its space back).
        """
        failures = gather_failures(failure, self._group)
        if not failures:
            return
        if discard:
            if is_coordinator(self._group):
                self.committer.discard_attempt(name)
            barrier(self._group)  # the directory is gone before any rank can start a retry that writes to it
        raise PersistFailed(name, failures) from (failure.error if failure is not None else None)

    def _describe(
        self,
        record: CheckpointRecord,
        param_sources: dict[str, dict[str, Any]],
        stamp: Stamp,
        trainer_state: str | None,
    ) -> dict[str, Any]:
        """The record, the engine state, the model parameter behind each weight key stored here, and the model.

        The parameter map and the model description let ``moc-consolidate`` write a dense checkpoint under
        the model's own names, in its own format, without building the model.
        """
        layout = self._plan.layout
        held = set(record.units) | {u for u, part in map(split_part_key, record.parts) if part == "weights"}
        return {
            "record": dataclasses.asdict(record),
            "lineage": stamp.lineage.stamp() if stamp.lineage is not None else None,
            "engine": stamp.engine_state,
            "trainer": trainer_state,
            "layout": {
                "num_experts": list(layout.num_experts),
                "params": {key: src for key, src in param_sources.items() if parse_unit(key).key in held},
                "aliases": dict(layout.aliases),
            },
            "model": stamp.model_description,
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
                for unit, slots in self._plan.layout.slots.items()
                for slot in slots
            }
            parts: list[dict[str, dict[str, Any]] | None] = [local]
            if dist.is_initialized():
                parts = [None] * dist.get_world_size(self._group)
                dist.all_gather_object(parts, local, group=self._group)
            self._param_sources = {key: src for part in parts if part is not None for key, src in part.items()}
        return self._param_sources
