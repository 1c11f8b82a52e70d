"""The PEC engine: decides nothing about *when* (the callback does), does the *how* of saving and loading.

A save takes every dense unit and the selected experts, asks ownership which rank writes which rows, writes them
through DCP and commits them in the manifest (:mod:`moc_lightning.pec.persist`); a load takes every unit from its
newest stored version and accounts the lost tokens (:mod:`moc_lightning.pec.loading`). :class:`PECCheckpointer`
composes the parts that do each job and owns what they share: the configuration, the layout, the topology, the
storage and the run's identity.

Usable without Lightning: give it a layout, the topology and a storage backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout
from moc_lightning.engine.ledger import DynamicK, TokenLedger, check_k
from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.pieces import check_supported
from moc_lightning.engine.routing import RouterCounts
from moc_lightning.engine.size_model import SizeModel, size_model
from moc_lightning.engine.units import Unit
from moc_lightning.pec.loading import Loader, LoadReport
from moc_lightning.pec.persist import Persister, SaveReport, Stamp
from moc_lightning.pec.selecting import ExpertSelector
from moc_lightning.pec.sizing import snapshot_share_bytes
from moc_lightning.pec.stored import UnreadableCheckpoint, read_manifest
from moc_lightning.pec.tokens import TokenAccounting, TokenMark
from moc_lightning.pec.write_plan import WritePlan
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.storage import CheckpointStorage


class PECCheckpointer:
    """Partial Experts Checkpointing of one model + optimizer, synchronous, through DCP.

    Public: :meth:`attach`, :meth:`checkpoint`, :meth:`persist`, :meth:`load_latest`, :meth:`read_manifest`,
    :meth:`record_tokens`, :meth:`prune_ledger`, :meth:`snapshot_share_bytes`, :meth:`size_model`,
    :meth:`state_dict`, :meth:`load_state_dict`; ``ledger`` and ``dynamic_k``. The parts, for their own jobs:
    ``tokens`` (:class:`TokenAccounting`), ``selector`` (:class:`ExpertSelector`), ``plan`` (:class:`WritePlan`),
    ``persister`` (:class:`Persister`), ``loader`` (:class:`Loader`).
    """

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
        """``fault_hook``, if given, is called on the coordinator with each name in
        :data:`~moc_lightning.pec.commit.COMMIT_POINTS` as its commit reaches it (fault injection: what it raises
        fails the commit there)."""
        num_experts = layout.num_experts
        check_supported(layout.params)
        cfg.validate_for(min(num_experts))
        check_k(cfg.k_snapshot, cfg.k_persist, min(num_experts))
        self.cfg = cfg
        self.layout = layout
        self.topology = topology
        self.storage = storage
        self.process_group = process_group
        self.snapshots_taken = 0
        self.lineage: Lineage | None = None
        """The run this engine's checkpoints belong to; ``None`` when the engine is used on its own."""
        self.model_description: dict[str, Any] | None = None
        """What writes the model back in its own format (:func:`moc_lightning.export.hf_format.describe_model`): its
        prefix in the module, class and config. Written into every ``moc.json``; ``None``: nothing to record."""
        self.tokens = TokenAccounting(cfg, num_experts, topology.rank)
        # read at call time, so that the stored view is always this engine's reading of the manifest
        self.selector = ExpertSelector(cfg, layout, topology.ep, self.tokens, lambda: self.read_manifest())
        self.plan = WritePlan(cfg, layout, topology)
        self.persister = Persister(cfg, self.plan, topology, storage, backend, process_group, fault_hook)
        self.loader = Loader(layout, storage, topology.rank, process_group, self.tokens)

    @property
    def ledger(self) -> TokenLedger:
        """Per-expert token counts (the source of PLT): :attr:`TokenAccounting.ledger`."""
        return self.tokens.ledger

    @property
    def dynamic_k(self) -> DynamicK:
        """The K in force at each level: :attr:`TokenAccounting.dynamic_k`."""
        return self.tokens.dynamic_k

    def attach(self, layout: Layout) -> None:
        """Use ``layout`` from now on (same model, new optimizer object: after Lightning re-creates it)."""
        if layout.num_experts != self.layout.num_experts:
            raise ValueError(f"new layout has experts {layout.num_experts}, expected {self.layout.num_experts}")
        self.layout = layout
        self.plan.attach(layout)
        self.loader.layout = layout

    def size_model(self) -> SizeModel:
        """Eq. 5/6 evaluated on this model's real tensors."""
        return size_model(self.layout)

    def snapshot_share_bytes(self, with_optimizer_state: bool = False, complete: bool = False) -> int:
        """What one rank's snapshot slot should hold at the current ``k_snapshot``
        (:func:`~moc_lightning.pec.sizing.snapshot_share_bytes`)."""
        return snapshot_share_bytes(self.plan, self.dynamic_k.k_snapshot, with_optimizer_state, complete)

    def record_tokens(self, moe_layers: Sequence[RouterCounts]) -> None:
        """Add the router counts of the last step (this rank's tokens); reduced over ranks at checkpoint time."""
        self.tokens.record(moe_layers)

    def checkpoint(self, step: int) -> SaveReport | None:
        """Take the checkpoint of step ``step``: select, and persist when this snapshot is a persist one.

        Returns the save report when something was persisted.
        """
        self.tokens.mark_step(step)
        index = self.snapshots_taken
        persist = index % self.cfg.persist_every_n_snapshots == 0
        selection = self.selector.select(index, persist)
        self.snapshots_taken += 1
        if not persist:
            return None
        whole = self.layout.dense_units + tuple(sorted(selection.persist_units()))
        report = self.persist(step, whole, parts=self.plan.partial_parts(whole))
        self.prune_ledger()
        return report

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
        """Write ``units`` whole and ``parts`` (part keys of other units, :meth:`WritePlan.partial_parts`), all
        ranks' share, as checkpoint ``step`` and commit it in the manifest.

        By default this rank writes the rows the ownership gives it, from the live tensors. With
        ``from_slot`` it writes those tensors (a snapshot slot: whole units it owns) as they are, and
        ``engine_state``/``trainer_state`` are the states captured with that snapshot. Every rank's own
        ``trainer_state`` is written as its bytes item :data:`~moc_lightning.pec.stored.RANK_STATE`; the
        coordinator's also goes into ``moc.json``, the fallback for a rank that finds no item of its own (a larger
        world size). ``digests``: what the record keeps of a final persist's live state
        (:attr:`CheckpointRecord.digests`).
        """
        stamp = Stamp(engine_state or self.state_dict(), self.lineage, self.model_description)
        return self.persister.persist(
            step, units, stamp, parts=parts, from_slot=from_slot, trainer_state=trainer_state,
            before_commit=before_commit, supersede=supersede, digests=digests,
        )

    def prune_ledger(self, in_memory: Sequence[int] = (), stored: Sequence[int] | None = None) -> None:
        """Forget token marks older than every stored version and every snapshot step in ``in_memory``. ``stored``:
        the stored versions' steps (:meth:`stored_steps`) where the caller read them already; ``None``: read now."""
        self.tokens.prune(list(self.stored_steps() if stored is None else stored) + list(in_memory))

    def stored_steps(self) -> list[int]:
        """The step of every version the committed manifest records."""
        return [r.step for r in self.read_manifest().records]

    def read_manifest(self) -> Manifest:
        """The committed manifest; if it is unreadable, the one committed before it (and say so)."""
        return read_manifest(self.storage)

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
                self.load_state_dict(self.loader.read_description(manifest.latest)["engine"])
                return self.loader.load_newest(manifest)
            except UnreadableCheckpoint as bad:
                self.layout.roll_back(before)
                manifest = self.persister.forget(manifest, bad)
        return None

    def state_dict(self, pending: TokenMark | None = None) -> dict[str, Any]:
        """Selection cursor, ledger, K and counters: small and JSON-able, saved with every checkpoint. ``pending``: the
        ledger as it will be once that mark is finished (:meth:`TokenAccounting.state_dict`)."""
        return {
            "snapshots_taken": self.snapshots_taken,
            "selection": self.selector.policy.state_dict(),
            **self.tokens.state_dict(pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the engine state of a checkpoint; K follows :meth:`DynamicK.load_state_dict` (and says so)."""
        self.snapshots_taken = int(state["snapshots_taken"])
        self.selector.policy.load_state_dict(state["selection"])
        self.tokens.load_state_dict(state)
