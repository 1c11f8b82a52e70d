"""Reading persisted checkpoints back: the parts each checkpoint holds, loaded through DCP under any world size
and EP degree, and the accounting of what the recovery lost.

A load takes every dense unit from the newest checkpoint and every part of every expert from its newest stored
version (``checkpoint.pec_scope``, :mod:`moc_lightning.engine.parts`: sources are keyed by part key,
``expert/L0/E3/weights``), and the tokens routed to an expert since its stalest part are its lost tokens (PLT,
eq. 7). Two-level recovery uses the same steps with sources in memory besides.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moc_lightning.engine.layout import Layout, TensorSpec
from moc_lightning.engine.ledger import NEVER, FaultReport
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.engine.parts import PARTS, part_key, part_key_of, split_part_key
from moc_lightning.engine.units import ExpertUnit, parse_unit
from moc_lightning.pec.outcomes import barrier
from moc_lightning.pec.stored import RANK_STATE, UnreadableCheckpoint, read_description
from moc_lightning.pec.tokens import TokenAccounting
from moc_lightning.pec.write_plan import model_units
from moc_lightning.storage import CheckpointStorage, CorruptCheckpointError, corrupt_from
from moc_lightning.storage.integrity import ListedKeysPlanner


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


class Loader:
    """Loads parts of units from persisted checkpoints into the live tensors, and accounts the recovery.

    Public: :meth:`load_newest`, :meth:`read_description`, :meth:`read_rank_state`, :meth:`stored_specs`,
    :meth:`prepare_for_load`, :meth:`load_from_storage`, :meth:`stalest_parts`, :meth:`account_recovery`; the
    ``layout`` it loads into.
    """

    def __init__(
        self,
        layout: Layout,
        storage: CheckpointStorage,
        rank: int,
        process_group: dist.ProcessGroup | None,
        tokens: TokenAccounting,
    ) -> None:
        """``rank``: this process's global rank (which trainer-state item is its own)."""
        self.layout = layout
        self._storage = storage
        self._rank = rank
        self._group = process_group
        self._tokens = tokens

    def load_newest(self, manifest: Manifest) -> LoadReport:
        """Load every part from its newest version in ``manifest`` at or before its latest checkpoint, whose
        engine state the caller has restored; :class:`UnreadableCheckpoint` if a checkpoint fails verification."""
        latest = manifest.latest
        assert latest is not None, "a manifest with no checkpoint has nothing to load"
        missing = [u.key for u in self.layout.dense_units if not latest.holds(u.key)]
        if missing:
            raise RuntimeError(f"checkpoint {latest.name} lacks dense units {missing[:5]}; it cannot be resumed")
        sources = {
            part_key(unit.key, part): manifest.newest(unit.key, at_or_before=latest.step, part=part)
            for unit in model_units(self.layout)
            for part in PARTS
        }
        stored = {k: r for k, r in sources.items() if r is not None}
        self.prepare_for_load(stored, self.stored_specs(stored))
        self.load_from_storage(stored)
        steps = {k: r.step if r is not None else NEVER for k, r in sources.items()}
        return self.account_recovery(latest.step, self.stalest_parts(steps))

    def read_description(self, record: CheckpointRecord) -> dict[str, Any]:
        """The verified ``moc.json`` of checkpoint ``record``: its record, engine and trainer state, parameter map."""
        return read_description(self._storage, record.name)

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
            metadata = self._storage.reader(record.name).read_metadata()
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
        parts of the units it holds, under whatever world size and EP degree wrote them. Optimizer state is loaded
        where the checkpoint has it (a parameter saved without state has none to load); a weight or buffer it
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
                    storage_reader=self._storage.reader(record.name),
                    planner=ListedKeysPlanner(record.name),  # a listed unit it lacks is damage, not a bug
                    process_group=self._group,
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
        key = RANK_STATE.format(rank=self._rank)
        try:
            metadata = self._storage.reader(name).read_metadata()
        except CorruptCheckpointError as err:
            raise UnreadableCheckpoint(name, str(err)) from err
        wanted: dict[str, Any] = {key: None} if key in metadata.state_dict_metadata else {}
        try:
            reader = self._storage.reader(name)
            dcp.load(wanted, storage_reader=reader, planner=ListedKeysPlanner(name), process_group=self._group)
        except CheckpointException as err:
            corrupt = corrupt_from(err)
            if corrupt is None:
                raise
            raise UnreadableCheckpoint(name, str(corrupt)) from err
        return wanted.get(key)

    def account_recovery(self, resume_step: int, restored_from: list[list[int]]) -> LoadReport:
        """PLT of the recovery (eq. 7) from the ledger, then Dynamic-K."""
        fault, k_changed = self._tokens.recover(resume_step, restored_from)
        barrier(self._group)
        sources = {
            ExpertUnit(layer, e).key: step for layer, steps in enumerate(restored_from) for e, step in enumerate(steps)
        }
        return LoadReport(
            resume_step=resume_step,
            sources={**{u.key: resume_step for u in self.layout.dense_units}, **sources},
            fault=fault,
            k_changed=k_changed,
        )
