"""Checkpoint size model (eq. 5 and 6) from a layout, and the bytes a checkpoint really wrote.

``P_ne`` and ``P_e`` count parameters of the whole model: under expert parallelism a rank sees only its
local experts, so each MoE layer's expert parameters are its per-expert count (from the local experts)
times N. ``B_w`` and ``B_o`` are bytes per parameter read from the live tensors (weights, and optimizer
state once the optimizer has created it), not assumed from a dtype. Persistent buffers (norm statistics, a
per-expert load-balancing bias) are saved with their units too; the paper's equations have no term for
them, so they are added as bytes, dense ones whole and expert ones in proportion ``K/N`` like expert weights.
Under ZeRO a rank holds only the optimizer state it keeps; the state other ranks keep is counted as the
optimizer says it is (``state_nbytes``, exact for :class:`moc_lightning.sharding.zero.ZeroAdamW` once it has stepped).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moc_lightning.engine.layout import Layout, UnitBytes
from moc_lightning.engine.parts import always_saved
from moc_lightning.engine.units import ExpertUnit, Unit


@dataclass(frozen=True)
class SizeModel:
    """The terms of eq. 5 and 6."""

    p_ne: int
    """Non-expert parameters."""
    p_e_per_layer: tuple[int, ...]
    """Expert parameters of each MoE layer, all N experts."""
    num_experts: tuple[int, ...]
    b_w: float
    """Weight bytes per parameter."""
    b_o: float
    """Optimizer-state bytes per parameter."""
    buffers_ne: int = 0
    """Bytes of the non-expert units' persistent buffers."""
    buffers_e_per_layer: tuple[int, ...] = ()
    """Bytes of the persistent buffers of each MoE layer's experts, all N experts."""

    @property
    def p_e(self) -> int:
        return sum(self.p_e_per_layer)

    def c_full(self) -> float:
        """Eq. 5: bytes of a checkpoint of every parameter."""
        return (self.p_ne + self.p_e) * (self.b_w + self.b_o) + self.buffers_ne + sum(self.buffers_e_per_layer)

    def c_pec(self, k: int, scope: str = "both") -> float:
        """Eq. 6: bytes of a checkpoint of all non-expert parameters and ``k`` experts per MoE layer.

        ``scope`` (``checkpoint.pec_scope``) is the part of an expert PEC applies to: the other part of every
        expert is saved too. Eq. 6 per scope: dense units whole, every expert's non-PEC part, ``k`` experts'
        PEC part (an expert's buffers go with its weights).
        """
        saved_experts = sum(min(k, n) / n * p for n, p in zip(self.num_experts, self.p_e_per_layer))
        saved_buffers = sum(min(k, n) / n * b for n, b in zip(self.num_experts, self.buffers_e_per_layer))
        every = always_saved(scope)
        expert_weights = (self.p_e if every == "weights" else saved_experts) * self.b_w + (
            sum(self.buffers_e_per_layer) if every == "weights" else saved_buffers
        )
        expert_state = (self.p_e if every == "optimizer" else saved_experts) * self.b_o
        return self.p_ne * (self.b_w + self.b_o) + self.buffers_ne + expert_weights + expert_state


def size_model(layout: Layout) -> SizeModel:
    """Eq. 5/6 terms of the model behind ``layout``."""
    sizes = {unit: model_unit_bytes(layout, unit) for unit in layout.units}
    p_ne = sum(b.weight_numel for u, b in sizes.items() if not isinstance(u, ExpertUnit))
    p_e_per_layer = tuple(
        _per_expert([b for u, b in sizes.items() if isinstance(u, ExpertUnit) and u.layer == layer.index], layer.prefix)
        * layer.num_experts
        for layer in layout.moe_layers
    )
    numel = sum(b.weight_numel for b in sizes.values())
    expert_buffers = tuple(
        _per_expert_buffers([b for u, b in sizes.items() if isinstance(u, ExpertUnit) and u.layer == layer.index])
        * layer.num_experts
        for layer in layout.moe_layers
    )
    return SizeModel(
        buffers_ne=sum(b.buffers for u, b in sizes.items() if not isinstance(u, ExpertUnit)),
        buffers_e_per_layer=expert_buffers,
        p_ne=p_ne,
        p_e_per_layer=p_e_per_layer,
        num_experts=layout.num_experts,
        b_w=sum(b.weights for b in sizes.values()) / numel,
        b_o=sum(b.optimizer for b in sizes.values()) / numel,
    )


def model_unit_bytes(layout: Layout, unit: Unit) -> UnitBytes:
    """Bytes of ``unit`` in the model, wherever its optimizer state is kept (see the module docstring)."""
    local = layout.unit_bytes(unit)
    elsewhere = stated_state_bytes(layout, unit, elsewhere_only=True)
    return local if elsewhere is None else dataclasses.replace(local, optimizer=local.optimizer + elsewhere)


def stated_state_bytes(layout: Layout, unit: Unit, elsewhere_only: bool = False) -> int | None:
    """The optimizer state of ``unit``'s parameters as its optimizer states it (``state_nbytes``, as
    :class:`moc_lightning.sharding.zero.ZeroAdamW` does), an expert's slice of a stacked parameter as its share; ``None``
    when the optimizer states nothing. ``elsewhere_only``: only the parameters whose state another rank keeps."""
    state_nbytes = getattr(layout.optimizer, "state_nbytes", None)
    if state_nbytes is None:
        return None
    total = 0
    for slot in layout.slots[unit]:
        if slot.buffer or (elsewhere_only and layout.keeps_state(slot.param)):
            continue
        param = layout.params[slot.param]
        total += state_nbytes(param, 1 if slot.index is None else (slot.view or param.shape)[0])
    return total


def _per_expert(local: list[UnitBytes], prefix: str) -> int:
    counts = {b.weight_numel for b in local}
    if len(counts) != 1:
        raise ValueError(
            f"experts of MoE layer {prefix!r} differ in parameter count {sorted(counts)}; eq. 5/6 assume equal experts"
        )
    return counts.pop()


def _per_expert_buffers(local: list[UnitBytes]) -> int:
    """Buffer bytes of one expert (experts of a layer hold the same buffers)."""
    return max((b.buffers for b in local), default=0)


def expected_bytes(layout: Layout, units: Iterable[Unit]) -> int:
    """Exact bytes of ``units`` on this rank now (weights and optimizer state), what a save of them writes."""
    return sum(layout.unit_bytes(unit).total for unit in units)


def bytes_written(directory: str | os.PathLike[str]) -> int:
    """Bytes of all files under ``directory``: what a checkpoint actually put on storage, metadata included."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
