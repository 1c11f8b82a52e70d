"""What a unit is made of: the parameter and buffer slots it owns, the MoE layers, and the state-dict keys of its
tensors (weights, buffers, optimizer state), the same in every world size and data-parallel mode."""

from __future__ import annotations

from dataclasses import dataclass

from moc_lightning.engine.units import Unit


@dataclass(frozen=True)
class ParamSlot:
    """One parameter or persistent buffer, or one expert's slice of a stacked one, as owned by a unit."""

    param: str
    """Fully qualified parameter (or buffer) name."""
    local_name: str
    """Name inside the unit (``fc.weight`` for an expert): the same for every expert, EP degree and rank."""
    index: int | None = None
    """Position along dim 0 of a stacked ``[E, ...]`` parameter (of this rank's piece of it, for a DTensor sharded
    along the expert dim) or buffer (the expert's entry: a buffer is never sharded); ``None`` when the unit owns it
    whole."""
    buffer: bool = False
    """A persistent buffer: saved and restored with the unit, no optimizer state."""
    view: tuple[int, ...] | None = None
    """Shape a flattened stacked tensor ``[E*I, ...]`` is viewed as (``[E, I, ...]``) before slice ``index``
    is taken; ``None`` when dim 0 is already the expert dim."""

    @property
    def is_view(self) -> bool:
        """True when the unit's tensors are views into a stacked parameter shared with other experts."""
        return self.index is not None


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer: its ordinal (the ``layer`` of its expert units), module prefix and experts."""

    index: int
    prefix: str
    num_experts: int
    """Global number of experts N."""
    local_experts: tuple[int, ...]
    """Global ids of the experts whose parameters live on this rank."""
    router: str | None = None
    """Module name of the layer's router (``...mlp.gate``), found by name (:func:`claims.find_router`); ``None``
    when the layer has none that a name shows. :mod:`moc_lightning.engine.routing` counts tokens there."""


def param_key(unit: Unit, local_name: str) -> str:
    """State-dict key of a unit's weight."""
    return f"{unit.key}/param/{local_name}"


def buffer_key(unit: Unit, local_name: str) -> str:
    """State-dict key of a unit's persistent buffer."""
    return f"{unit.key}/buffer/{local_name}"


def is_state_key(key: str) -> bool:
    """Whether a state-dict key names optimizer state (:func:`state_key`)."""
    return "/optim/" in key


def is_buffer_key(key: str) -> bool:
    """Whether a state-dict key (:func:`buffer_key`) names a persistent buffer: unlike weights and optimizer state,
    which only an optimizer step changes, a forward may update a buffer in place (norm statistics, a
    load-balancing bias)."""
    return "/buffer/" in key


def slot_key(unit: Unit, slot: ParamSlot) -> str:
    """The key of a slot's own tensor (weight or buffer)."""
    return buffer_key(unit, slot.local_name) if slot.buffer else param_key(unit, slot.local_name)


def state_key(unit: Unit, local_name: str, state_name: str) -> str:
    """State-dict key of one optimizer state entry of a unit's weight."""
    return f"{unit.key}/optim/{local_name}/{state_name}"
