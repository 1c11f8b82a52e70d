"""Choosing the experts of each checkpoint, from one view of storage that every rank shares.

The policy (:mod:`moc_lightning.engine.selection`) is pure; what it needs besides the checkpoint's index is where
every unit is stored (``load_aware`` ranks experts by the tokens they processed since; a complete first persist
waits until every unit has a stored version). That view must be the same on every rank while the coordinator may
be committing a persist in the background, so it is built from the storage at start-up plus the persists every
rank has seen succeed, and read from the manifest only when no persist can be committing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout
from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.manifest import Manifest
from moc_lightning.engine.selection import Selection, UnsavedTokens, every_expert, make_policy
from moc_lightning.engine.units import ExpertUnit
from moc_lightning.pec.persist import SaveReport
from moc_lightning.pec.stored import stored_steps
from moc_lightning.pec.tokens import TokenAccounting
from moc_lightning.pec.write_plan import model_units


class ExpertSelector:
    """The experts each checkpoint snapshots and persists.

    Public: :meth:`select`, :meth:`needs_stored_steps`, :attr:`ranks_by_tokens`, :meth:`base_on`; the ``policy`` (its
    cursor travels in the engine state) and ``stored_base``.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        layout: Layout,
        ep: int,
        tokens: TokenAccounting,
        read_manifest: Callable[[], Manifest],
    ) -> None:
        """``read_manifest``: the committed manifest, read when no agreed persists are given."""
        self._cfg = cfg
        self._num_experts = layout.num_experts
        self._unit_keys = [unit.key for unit in model_units(layout)]
        self._tokens = tokens
        self._read_manifest = read_manifest
        self.policy = make_policy(cfg.selection, layout.num_experts, ep)
        self.stored_base: dict[str, int] = {}
        """Unit key -> step of its newest stored version when this process started (or recovered)."""
        self._every_unit_stored = False
        """Whether every unit is known to have a stored version in this lineage (see :meth:`_completes`)."""

    def select(self, index: int, persist: bool, persisted: Sequence[SaveReport] | None = None) -> Selection:
        """The experts checkpoint number ``index`` snapshots (and persists, if ``persist``); advances the policy.

        ``load_aware`` and a complete first persist need the step each expert is stored at. With ``persisted`` (the
        persists every rank has seen succeed, in order) it is taken from :attr:`stored_base` plus those, the
        same on every rank; without it, from the manifest (safe only when no persist can be committing, as in
        :meth:`PECCheckpointer.checkpoint`). A complete persist (every expert) still asks the policy, so that the
        rotation goes on from where it would have been: the schedule after it is exactly PEC's, with PEC's coverage
        bound, whether or not the first persist was complete or had to be retried.
        """
        unsaved = None
        dynamic_k = self._tokens.dynamic_k
        if self._cfg.selection == "load_aware":
            stored = self._stored_steps(persisted)
            steps = [
                [stored.get(ExpertUnit(layer, e).key, NEVER) for e in range(n)]
                for layer, n in enumerate(self._num_experts)
            ]
            since = self._tokens.ledger.tokens_since(steps)
            unsaved = UnsavedTokens(snapshot=since, persist=since)
        selection = self.policy.select(
            index, dynamic_k.k_snapshot, dynamic_k.k_persist, persist=persist, unsaved=unsaved
        )
        return every_expert(self._num_experts) if persist and self._completes(persisted) else selection

    @property
    def ranks_by_tokens(self) -> bool:
        """Whether :meth:`select` reads the ledger's counts (``load_aware``): they must be summed and recorded up to
        the checkpoint's step before it selects."""
        return self._cfg.selection == "load_aware"

    def needs_stored_steps(self, persist: bool) -> bool:
        """Whether :meth:`select` reads where units are stored: then it must be given the agreed persists
        while one may be committing (the manifest can be mid-commit on the coordinator)."""
        return self._cfg.selection == "load_aware" or (persist and self._may_lack_a_unit())

    def base_on(self, manifest: Manifest) -> None:
        """Take ``manifest`` (the same on every rank) as what storage holds when training (re)starts."""
        self.stored_base = stored_steps(manifest)
        self._every_unit_stored = False

    def _completes(self, persisted: Sequence[SaveReport] | None = None) -> bool:
        """Whether a persist now must take every unit (``complete_first_persist``): some unit of the model has
        no stored version yet in this lineage (``persisted`` as in :meth:`select`)."""
        if not self._may_lack_a_unit():
            return False
        stored = self._stored_steps(persisted)
        self._every_unit_stored = all(key in stored for key in self._unit_keys)
        return not self._every_unit_stored

    def _may_lack_a_unit(self) -> bool:
        """False once every unit is known to be stored: retention never removes a unit's only version, so
        it stays so, and the stored view need not be read again."""
        return self._cfg.complete_first_persist and not self._every_unit_stored

    def _stored_steps(self, persisted: Sequence[SaveReport] | None) -> dict[str, int]:
        if persisted is None:
            return stored_steps(self._read_manifest())
        steps = dict(self.stored_base)
        for report in persisted:
            steps.update(dict.fromkeys(report.units, report.step))
        return steps
