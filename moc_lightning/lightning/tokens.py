"""The router counts of a fit's training steps, which PLT and Dynamic-K are computed from.

They come from the LightningModule's ``moe_layers()`` when it has one (objects reporting
``tokens_per_expert``/``tokens_assigned``), else from forward hooks on each MoE layer or its router
(:mod:`moc_lightning.engine.routing`). Where neither exists PLT is unknown: one warning says so, and the options that
need it (Dynamic-K, load-aware selection) are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout
from moc_lightning.engine.routing import RouterCounts, TokenSource, token_source, unknown_message


class TokenCounts:
    """Each step's router counts (:meth:`take`), from a source attached once per fit (:meth:`attach`)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.source: TokenSource | None = None
        """Where the counts come from (``None`` until :meth:`attach`, and after :meth:`close`)."""
        self._said_unknown = False

    @property
    def known(self) -> bool:
        """Whether PLT is measured: every MoE layer's router counts are known."""
        return self.source is not None and not self.source.unknown

    def attach(self, module: L.LightningModule, layout: Layout) -> None:
        """Count ``module``'s routing from now on, unless counting already (a fit builds its engine more than once)."""
        if self.source is None:
            self.source = token_source(module, layout)
            self._check()

    def take(self) -> Sequence[RouterCounts] | None:
        """The counts since the last take, or ``None`` where they are unknown (a router whose output turned out
        unreadable is refused or warned of here, as at :meth:`attach`)."""
        counts = self.source.take() if self.source is not None else None
        if counts is None:
            self._check()
        return counts

    def discard(self) -> None:
        """Drop the counts since the last take (a replay's routing, counted in the faulty run already)."""
        if self.source is not None:
            self.source.take()

    def close(self) -> None:
        """Stop counting (the hooks on the model go)."""
        if self.source is not None:
            self.source.close()
            self.source = None

    def _check(self) -> None:
        """Once PLT turns out unknown: refuse the options that need it, else warn once."""
        unknown = self.source.unknown if self.source is not None else {}
        if not unknown or self._said_unknown:
            return
        needs = [
            option for option, on in (
                ("checkpoint.dynamic_k.enabled=true", self.config.dynamic_k.enabled),
                ("checkpoint.selection=load_aware", self.config.selection == "load_aware"),
            ) if on
        ]
        if needs:
            raise ValueError(
                f"{' and '.join(needs)} need(s) router counts (Dynamic-K reacts to PLT, load-aware selection "
                f"ranks experts by tokens), but {unknown_message(unknown)}; or turn the option(s) off"
            )
        self._said_unknown = True
        rank_zero_warn(unknown_message(unknown))
