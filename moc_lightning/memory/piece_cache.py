"""The pieces a snapshot copies, built once per unit and reused while they still view the live state.

A snapshot copies this rank's pieces of its units (:meth:`~moc_lightning.engine.layout.Layout.pieces`): a detached
view and a key for every weight, optimizer state and buffer. Building them again at every snapshot was most of the
training thread's preparation (0.3-0.9 ms for the quick preset's ~116 tensors on the reference machine). The dense
units are in every snapshot, and the sequential selection comes back to the same experts every ceil(N/K) snapshots.

A view is reused only while it views the live tensor. Before each reuse the cache asks the layout for the unit's
live objects (:meth:`~moc_lightning.engine.layout.Layout.sources`) and compares them by identity with those the views
were built from. An optimizer that creates its state, a roll back that refills it, or an optimizer or FSDP2 that
assigns new tensors makes the cache build that unit's views again. A cached view cannot alias a new tensor at the same
address: it keeps the old storage alive.

The live state is the engine's layout's at each snapshot. Lightning may re-create the optimizer, and the engine then
takes a new layout (:meth:`~moc_lightning.pec.checkpointer.PECCheckpointer.attach`). The old layout still answers,
with the old optimizer's state. So the cache is asked with the layout in force, and it starts over when that is
another one.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.units import Unit
from moc_lightning.memory.snapshot import signature_of


@dataclass(frozen=True)
class _UnitPieces:
    """One unit's pieces, what they were built from, and their slot signature (:func:`signature_of`)."""

    sources: list[object]
    pieces: dict[str, torch.Tensor]
    signature: tuple


class PieceCache:
    """This rank's pieces of each unit, kept between snapshots.

    Public: :meth:`pieces`.
    """

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self._units: dict[Unit, _UnitPieces] = {}

    def pieces(self, layout: Layout, units: Iterable[Unit]) -> tuple[dict[str, torch.Tensor], tuple]:
        """``layout.pieces(units)`` and its :func:`signature_of`, from the views built before where they still view
        the live tensors. ``layout``: the engine's layout now; views built from another one are dropped."""
        if layout is not self._layout:
            self._layout, self._units = layout, {}
        tensors: dict[str, torch.Tensor] = {}
        signature: list[tuple] = []
        for unit in units:
            cached = self._units.get(unit)
            sources = layout.sources((unit,))
            if cached is None or not _same(cached.sources, sources):
                pieces = layout.pieces((unit,))
                cached = self._units[unit] = _UnitPieces(sources, pieces, signature_of(pieces))
            tensors.update(cached.pieces)
            signature.append(cached.signature)
        return tensors, tuple(entry for part in signature for entry in part)


def _same(before: list[object], now: list[object]) -> bool:
    """Whether two lists hold the same objects in the same order (identity: ``==`` would compare tensors' values)."""
    return len(before) == len(now) and all(map(operator.is_, before, now))
