"""Layout: the map from a model and its optimizer to units, built once from parameter names.

Every named parameter belongs to exactly one unit, and so does its per-parameter optimizer state (Adam's
``exp_avg``/``exp_avg_sq``/``step``, SGD's ``momentum_buffer``, ...): PEC on weights alone would save the
wrong 14% of a checkpoint, since expert optimizer state is its bulk. So does every persistent buffer (those
in ``state_dict()``: norm statistics, a router's load-balancing bias), by where it is held:

- inside an expert's own module (``experts.{e}.calls``): that expert's;
- inside a stacked ``experts`` module with one entry per expert on dim 0 (``[N]``, or ``[E_local]`` of the rank's
  experts): sliced like a stacked parameter, entry ``e`` to expert ``e``;
- held by the MoE layer module itself or by its router: *routing state* (torchtitan's ``expert_bias`` on the layer,
  DeepSeek-V3's ``e_score_correction_bias`` on its ``gate``, token counters). It steers the router, whose weights come
  back at the resume step, so it is a dense buffer of the router's unit (a layer's own buffer joins the unit of its
  router's weights; :func:`~moc_lightning.engine.discovery.dense_unit_name`'s
  unit where no router is found) and comes back with it, at the resume step, in
  every mode (DESIGN.md hard part 10). PEC's loss is of expert weights and optimizer state, not of routing. One
  exception is kept: a buffer of the layer module of shape ``[E_local]`` under expert parallelism (E_local < N) holds
  values that differ per rank, which no dense unit (held alike by every rank, written once) can hold, so its entries
  stay with the local experts;
- anywhere else: the dense unit of its module, by the same rule as a parameter.

A per-expert buffer of all N experts that a rank holds whole while its units own only some of the experts (an
``expert_buffers`` buffer under expert parallelism, or a stacked ``experts`` module's buffer beside stacked DTensor
experts) gives the rank's units their own entries only, so its keys are the same in every world and mode; after a
restore the ranks share the entries (:meth:`Layout.share_expert_entries`), so each rank's whole buffer again holds
every expert's entry at that expert's source step.

Under FSDP2 the parameters and the optimizer state shaped like them are DTensors (:mod:`moc_lightning.engine.pieces`): units
and keys are found from their names and whole shapes exactly as under DDP, so checkpoints of the two modes are
interchangeable; :meth:`Layout.tensors` hands out the DTensors (what DCP writes and loads at their offsets), and
:meth:`Layout.pieces` this rank's local shards of them (what a snapshot copies). A stacked ``[E, ...]`` DTensor sharded
along the expert dim (torchtitan's experts under ``fully_shard``) holds whole experts on each rank: the units are those
experts, their tensors slices of the local piece (plain tensors: nobody else holds them), so the rank's experts are
its local experts as under EP; the layer's routing bias, which every rank holds whole and alike, is a plain tensor of
the router's unit beside its DTensor weight.

How :func:`build_layout` finds the experts, the routers and the dense units in a model's names and shapes is
:mod:`moc_lightning.engine.discovery`'s job.

Optimizer state is read when tensors are asked for, not when the layout is built, because optimizers
create it lazily at their first step. A parameter may have no state at all (frozen, or an expert that has
received no token yet); a restore recreates exactly the state its source holds, from the stored shapes and
dtypes (:meth:`Layout.reset_optimizer_state`) or, where the restored tensors are at hand, from them in one pass
(:meth:`Layout.restore_optimizer_state`), and never steps the optimizer to make some.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moc_lightning.engine.claims import no_experts_error
from moc_lightning.engine.compute_dtype import compute_dtypes
from moc_lightning.engine.discovery import (
    PRESETS,
    ExpertOffset,
    buffer_slots,
    check_unique_keys,
    claimed_buffers,
    compile_patterns,
    dense_unit_name,
    expert_claims,
    expert_offset_of,
    match_expert,
    moe_layer,
    persistent_buffers,
    placements,
    tied_aliases,
)
from moc_lightning.engine.pieces import has_dtensors, piece
from moc_lightning.engine.slots import (
    MoeLayer,
    ParamSlot,
    buffer_key,
    param_key,
    state_key,
)
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit, parse_unit

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""Shape and dtype of a stored tensor: what a restore needs to create the tensor that receives it."""


@dataclass(frozen=True)
class UnitBytes:
    """Bytes of a unit, read from the live tensors (``numel * element_size``)."""

    weights: int
    optimizer: int
    weight_numel: int
    buffers: int = 0
    """Persistent buffers (norm statistics, a load-balancing bias): saved with the unit like its weights."""
    compute_weights: int | None = None
    """The weights in the dtype a forward reads them in (:attr:`Layout.compute_dtypes`); ``None``: their own dtype,
    :attr:`weights`."""

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.buffers

    @property
    def logged(self) -> int:
        """What replay mode logs of the unit while it is frozen: what a forward reads, its weights in their compute
        dtype and its buffers."""
        return (self.weights if self.compute_weights is None else self.compute_weights) + self.buffers


@dataclass(frozen=True)
class Layout:
    """Units of a model and optimizer; hands out their tensors as a flat DCP-ready ``key -> tensor`` dict.

    The tensors are views that share storage with the live parameters and optimizer state (slices for
    stacked experts), so a DCP load into them restores in place; ``copy_in`` does the same for tensors
    loaded elsewhere (a peer's snapshot slot).
    """

    slots: Mapping[Unit, tuple[ParamSlot, ...]]
    moe_layers: tuple[MoeLayer, ...]
    params: Mapping[str, nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Persistent buffers by name."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other names ``state_dict()`` holds a parameter or buffer under (a head tied to the embedding:
    ``lm_head.weight`` -> ``model.embed_tokens.weight``), each to the one name its unit holds it by; what a
    consolidated checkpoint must repeat for the model's own ``load_state_dict`` to accept it."""
    compute_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Parameter name -> the dtype a forward reads it in, for each parameter a sharding wrapper casts exactly for
    compute (FSDP2's mixed precision, :func:`~moc_lightning.engine.compute_dtype.compute_dtypes`); the others are read in
    their own dtype."""

    @cached_property
    def units(self) -> tuple[Unit, ...]:
        return tuple(sorted(self.slots))

    @cached_property
    def sharded(self) -> bool:
        """Whether the parameters are DTensors (FSDP2): a unit's state on a rank is then its pieces of it."""
        return has_dtensors(self.params.values())

    @cached_property
    def state_owners(self) -> Mapping[Unit, int] | None:
        """Under ZeRO (an optimizer with ``unit_owners``, :class:`moc_lightning.sharding.zero.ZeroAdamW`): the rank that keeps
        each local unit's optimizer state. ``None`` when every holder of a unit keeps its state (DDP)."""
        owners = getattr(self.optimizer, "unit_owners", None)
        return None if owners is None else owners(self)

    def keeps_state(self, param_name: str) -> bool:
        """Whether this rank keeps the optimizer state of ``param_name`` (under ZeRO only its owner does)."""
        holds = getattr(self.optimizer, "holds_state", None)
        return holds is None or holds(self.params[param_name])

    @cached_property
    def expert_units(self) -> tuple[ExpertUnit, ...]:
        return tuple(u for u in self.units if isinstance(u, ExpertUnit))

    @cached_property
    def dense_units(self) -> tuple[DenseUnit, ...]:
        return tuple(u for u in self.units if isinstance(u, DenseUnit))

    @property
    def num_experts(self) -> tuple[int, ...]:
        """N of each MoE layer, by ordinal."""
        return tuple(layer.num_experts for layer in self.moe_layers)

    def param_names(self, unit: Unit) -> tuple[str, ...]:
        return tuple(slot.param for slot in self.slots[unit] if not slot.buffer)

    def tensors(self, units: Iterable[Unit] | None = None) -> dict[str, torch.Tensor]:
        """Weights and optimizer state of ``units`` (all units by default) as detached in-place views."""
        chosen = self.units if units is None else units
        return {key: tensor for unit in chosen for key, tensor, _ in self._entries(unit)}

    @torch.no_grad()
    def pieces(self, units: Iterable[Unit]) -> dict[str, torch.Tensor]:
        """As :meth:`tensors`, each DTensor as this rank's local piece of it (sharing its storage).

        Without grad mode, on every snapshot: ``DTensor.to_local`` is then the local tensor itself, where with it
        it is an autograd function (8-17 us a tensor, over a millisecond a snapshot of the quick preset's pieces).
        """
        return {key: tensor for unit in units for key, tensor, _ in self._entries(unit, local=True)}

    def model_tensors(self, units: Iterable[Unit]) -> dict[str, torch.Tensor]:
        """The model's own tensors of ``units``: weights and buffers, no optimizer state (as in :meth:`tensors`)."""
        return {key: tensor for unit in units for key, tensor, _ in self._entries(unit, state=False)}

    @torch.no_grad()
    def model_pieces(self, units: Iterable[Unit]) -> dict[str, torch.Tensor]:
        """As :meth:`model_tensors`, each DTensor as this rank's local piece of it (sharing its storage); without
        grad mode, as :meth:`pieces`."""
        return {key: tensor for unit in units for key, tensor, _ in self._entries(unit, local=True, state=False)}

    def compute_dtype(self, key: str, tensor: torch.Tensor) -> torch.dtype:
        """The dtype a forward reads ``tensor``, the model tensor ``key`` (one of :meth:`model_tensors`), in: its
        parameter's :attr:`compute_dtypes` entry, else its own."""
        return self._compute_dtypes_by_key.get(key, tensor.dtype)

    @cached_property
    def _compute_dtypes_by_key(self) -> dict[str, torch.dtype]:
        return {
            param_key(unit, slot.local_name): self.compute_dtypes[slot.param]
            for unit, slots in self.slots.items() for slot in slots
            if not slot.buffer and slot.param in self.compute_dtypes
        }

    def unit_bytes(self, unit: Unit, local: bool = False) -> UnitBytes:
        """Bytes of the unit now, whole (a DTensor's global size); ``local``: of this rank's pieces of it (what
        its snapshot copies). Optimizer bytes are 0 until the optimizer has created its state."""
        sizes = {"weight": 0, "optimizer": 0, "buffer": 0}
        numel = compute = 0
        for key, tensor, kind in self._entries(unit):
            tensor = piece(tensor) if local else tensor
            sizes[kind] += tensor.numel() * tensor.element_size()
            if kind == "weight":
                numel += tensor.numel()
                compute += tensor.numel() * self.compute_dtype(key, tensor).itemsize
        return UnitBytes(
            weights=sizes["weight"], optimizer=sizes["optimizer"], weight_numel=numel, buffers=sizes["buffer"],
            compute_weights=compute,
        )

    def _entries(
        self, unit: Unit, local: bool = False, state: bool = True
    ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """``(key, tensor, kind)`` for each weight (then its optimizer state) and buffer of ``unit``; ``kind``
        is ``weight``, ``optimizer`` or ``buffer``. ``local``: each DTensor as this rank's piece of it; a DTensor
        parameter is not detached first then (a dispatch of its own; its piece does not require grad). ``state``:
        whether to yield the optimizer state; without it no view of it is built (a replay capture asks for the
        model tensors of most units every iteration)."""
        for slot in self.slots[unit]:
            if slot.buffer:
                buffer = self.buffers[slot.param]
                yield buffer_key(unit, slot.local_name), _take(buffer, slot, buffer.shape, local), "buffer"
                continue
            param = self.params[slot.param]
            weight = param if local and isinstance(param, DTensor) else param.detach()
            yield param_key(unit, slot.local_name), _take(weight, slot, param.shape, local), "weight"
            for state_name, value in (self._state(slot.param) if state else {}).items():
                yield state_key(unit, slot.local_name, state_name), _take(value, slot, param.shape, local), "optimizer"

    def shared_state_keys(self, units: Iterable[Unit]) -> dict[str, tuple[str, str]]:
        """Optimizer-state keys of ``units`` whose tensor all experts of a stacked parameter share (not sliced:
        Adam's scalar ``step``), each with ``(parameter, state name)``: the keys that hold one tensor."""
        shared = {}
        for unit in units:
            for slot in self.slots[unit]:
                if slot.buffer or slot.index is None:
                    continue
                shape = self.params[slot.param].shape
                for name, value in self._state(slot.param).items():
                    if not _sliced(value.shape, slot, shape):
                        shared[state_key(unit, slot.local_name, name)] = (slot.param, name)
        return shared

    def rollback_point(self) -> RollbackPoint:
        """Copies of the live weights, buffers and optimizer state, before a load that may fail part-way writes into
        them (a load copies a checkpoint's items in one by one, and a damaged item stops it). In a process that
        resumes, the optimizer has no state yet, so the weights and buffers are all that is copied."""
        model = {key: tensor.clone() for key, tensor in self.model_tensors(self.units).items()}
        return RollbackPoint(model, _copied_state({} if self.optimizer is None else self.optimizer.state))

    def roll_back(self, point: RollbackPoint) -> None:
        """Undo a failed load: the live tensors as at :meth:`rollback_point`, so that no byte it loaded survives into
        the next attempt (a unit the next one does not load keeps its state before either)."""
        with torch.no_grad():
            for key, tensor in self.model_tensors(self.units).items():
                tensor.copy_(point.model[key])
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.state.update(_copied_state(point.optimizer))  # the point stays intact for another failure

    def copy_in(self, loaded: Mapping[str, torch.Tensor]) -> None:
        """Copy loaded tensors into the live parameters and optimizer state, in place (this rank's pieces of them).

        A stacked parameter's non-sliceable state (Adam's scalar ``step``) is shared by all its experts,
        so it takes the value of whichever of them is copied last.
        """
        targets = self.pieces({_unit_of(key, self.slots) for key in loaded})
        missing = sorted(set(loaded) - set(targets))
        if missing:
            raise KeyError(
                f"no live tensor for keys {missing[:5]}{' ...' if len(missing) > 5 else ''}; optimizer state "
                "exists only after the first step (call reset_optimizer_state before loading)"
            )
        _copy_all(targets, loaded)

    @cached_property
    def partly_held_buffers(self) -> dict[str, tuple[int, ...]]:
        """Per-expert buffers of all N experts (a stacked ``experts`` module's, or one ``expert_buffers`` names) of which
        this rank's units own only some entries, those of its local experts (under EP, or stacked DTensor experts),
        though it holds the buffer whole: buffer name -> the entries its units own. :meth:`share_expert_entries` fills
        the others."""
        owned: dict[str, list[int]] = {}
        for unit_slots in self.slots.values():
            for slot in unit_slots:
                if slot.buffer and slot.index is not None:
                    owned.setdefault(slot.param, []).append(slot.index)
        return {
            name: tuple(sorted(entries)) for name, entries in owned.items() if len(entries) < self.buffers[name].shape[0]
        }

    def share_expert_entries(self, group: dist.ProcessGroup | None = None) -> None:
        """After a restore: every rank's per-expert buffers take each entry from a rank whose unit owns it (collective
        over ``group``, every rank alike; nothing to do where each rank owns every entry it holds).

        A restore puts a unit's entry in place only on the ranks that hold the unit, each from the step the unit
        came from; the other ranks hold the whole buffer too (the forward reads all of it) and must end with the same
        values, or the ranks would route tokens differently."""
        partial = self.partly_held_buffers
        if not partial:
            return
        mine = {name: {e: self.buffers[name][e].detach().cpu().clone() for e in owned} for name, owned in partial.items()}
        everyone: list[dict[str, dict[int, torch.Tensor]] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        with torch.no_grad():
            for name, owned in partial.items():
                buffer = self.buffers[name]
                for theirs in everyone:
                    assert theirs is not None  # all_gather_object filled every rank's entry
                    for e, value in theirs[name].items():
                        if e not in owned:
                            buffer[e].copy_(value)

    def state_keys(self, units: Iterable[Unit]) -> dict[Unit, set[str]]:
        """The optimizer-state keys (as :meth:`tensors` names them) each of ``units`` has now, without taking a view
        of any tensor."""
        return {
            unit: {
                state_key(unit, slot.local_name, name)
                for slot in self.slots[unit] if not slot.buffer for name in self._state(slot.param)
            }
            for unit in units
        }

    def reset_optimizer_state(self, units: Iterable[Unit], specs: Mapping[str, TensorSpec]) -> None:
        """Give the parameters of ``units`` exactly the optimizer state ``specs`` lists, as new zero tensors
        of the stored shapes and dtypes, ready to be loaded into in place.

        ``specs`` holds the optimizer-state keys a restore's sources hold (slot entries, DCP metadata); a
        parameter with none, or whose state another rank keeps (ZeRO), has no state afterwards, as it had none when it was saved (frozen, or an expert
        without tokens). Nothing is stepped: a zero-gradient step would decay state already loaded, and
        costs a full optimizer step. A stacked parameter's state is created whole (``[E, ...]``) from its
        experts' slices; a state that was not sliced (Adam's scalar ``step``) is shared by its experts. The state of
        a DTensor parameter is a DTensor placed as the parameter is (what the optimizer itself creates), but for
        scalar states.
        """
        self._create_state(units, specs, {})

    def restore_optimizer_state(self, units: Iterable[Unit], states: Mapping[str, torch.Tensor]) -> None:
        """Give the parameters of ``units`` exactly the optimizer state ``states`` holds (optimizer-state keys ->
        this rank's pieces, as a snapshot or replay window holds them), created from those tensors.

        As :meth:`reset_optimizer_state` from their shapes and dtypes, then loaded, but in one pass: a state tensor
        ``states`` fills wholly is allocated uninitialised and written once by the copy, since a zero fill first
        doubled the bytes a restore from memory moves (issue 14 item 7). One it fills in part (some experts of a
        stacked parameter) is zeros elsewhere, so a slice restored later never shows uninitialised memory.
        """
        specs = {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in states.items()}
        self._create_state(units, specs, states)

    def _create_state(
        self, units: Iterable[Unit], specs: Mapping[str, TensorSpec], values: Mapping[str, torch.Tensor]
    ) -> None:
        """New optimizer state of ``units``' parameters for ``specs`` (see :meth:`reset_optimizer_state`), with the
        tensors of ``values`` (keys of ``specs``) copied into it in one call; what they leave unwritten is zeros."""
        if self.optimizer is None:
            return
        wanted = self._state_entries(units, specs)
        matched = {key for states in wanted.values() for entries in states.values() for _, key, _ in entries}
        if stray := sorted(set(values) - matched):
            raise ValueError(f"optimizer state {stray[:5]} belongs to no parameter of the units restored; pass "
                             "their units too")
        scalars = _scalar_state_names(self.params, wanted)
        groups = {p: group for group in self.optimizer.param_groups for p in group["params"]}
        targets: dict[str, torch.Tensor] = {}
        for name, states in wanted.items():
            param = self.params[name]
            if not states or not self.keeps_state(name):
                self.optimizer.state.pop(param, None)
                continue
            fresh = {}
            for state_name, entries in states.items():
                slot, _, (shape, dtype) = entries[-1]
                scalar = len(shape) == 0 and state_name in scalars
                if slot.index is not None and tuple(shape) == _slice_shape(slot, param.shape) and not scalar:
                    shape = tuple(param.shape)  # an expert's slice of a stacked state
                sliced = _sliced(shape, slot, param.shape)
                given = [(s, key) for s, key, _ in entries if key in values]
                if not sliced:
                    given = given[-1:]  # held whole by each of its experts: the last one copied, as copy_in does
                whole = len({s.index for s, _ in given}) == (_experts_held(param, slot) if sliced else 1)
                group = groups.get(param, {})
                on_param = not scalar or group.get("capturable") or group.get("fused")
                fresh[state_name] = _new_tensor(
                    param if isinstance(param, DTensor) and not scalar else None,
                    shape, dtype, param.device if on_param else torch.device("cpu"), uninitialised=whole,
                )
                targets.update({key: piece(_take(fresh[state_name], s, param.shape)) for s, key in given})
            self.optimizer.state[param] = fresh
        _copy_all(targets, {key: values[key] for key in targets})

    def _state_entries(
        self, units: Iterable[Unit], specs: Mapping[str, TensorSpec]
    ) -> dict[str, dict[str, list[tuple[ParamSlot, str, TensorSpec]]]]:
        """Per parameter of ``units`` (every one, an empty dict where ``specs`` has no state of it), per state name, the
        ``(slot, key, spec)`` of each key of ``specs`` naming that state: several for a stacked parameter's experts."""
        wanted: dict[str, dict[str, list[tuple[ParamSlot, str, TensorSpec]]]] = {}
        for unit in (u for u in units if u in self.slots):
            for slot in self.slots[unit]:
                if slot.buffer:
                    continue
                states = wanted.setdefault(slot.param, {})
                prefix = state_key(unit, slot.local_name, "")
                for key, spec in specs.items():
                    if key.startswith(prefix):
                        states.setdefault(key[len(prefix) :], []).append((slot, key, spec))
        return wanted

    def _state(self, param_name: str) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {}
        state = self.optimizer.state.get(self.params[param_name], {})
        bad = [k for k, v in state.items() if v is not None and not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"optimizer state {bad} of parameter {param_name!r} is not a tensor; only optimizers whose "
                "per-parameter state is tensors are supported"
            )
        return {k: v for k, v in state.items() if v is not None}


def _unit_of(key: str, slots: Mapping[Unit, tuple[ParamSlot, ...]]) -> Unit:
    unit = parse_unit(key)
    if unit not in slots:
        raise KeyError(f"key {key!r} belongs to unit {unit.key!r}, which this layout does not hold")
    return unit


def _scalar_state_names(
    params: Mapping[str, nn.Parameter], wanted: Mapping[str, Mapping[str, Sequence[tuple[ParamSlot, str, TensorSpec]]]]
) -> set[str]:
    """Names of per-parameter *scalar* optimizer states (Adam's ``step``): 0-dim for a parameter that is not.

    Told apart from an expert's 0-dim slice of a stacked 1-D parameter's state by the other parameters; they
    live on the host unless the optimizer is capturable or fused, as torch's optimizers create them.
    """
    names = set()
    for name, states in wanted.items():
        for state_name, entries in states.items():
            slot, _, (shape, _) = entries[-1]
            if len(shape) == 0 and len(_slice_shape(slot, params[name].shape)) > 0:
                names.add(state_name)
    return names


def _new_tensor(
    like: DTensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, uninitialised: bool
) -> torch.Tensor:
    """A new state tensor: a DTensor placed as ``like`` (what the optimizer itself creates for a DTensor parameter)
    or a plain one of ``shape``; ``uninitialised`` only where a copy then writes every element (``torch.empty``),
    else zeros."""
    if like is not None:
        return (torch.empty_like if uninitialised else torch.zeros_like)(like, dtype=dtype)
    return (torch.empty if uninitialised else torch.zeros)(shape, dtype=dtype, device=device)


def _copy_all(targets: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``loaded`` into the tensor of ``targets`` under its key, after checking their shapes agree: one
    call for all rather than a dispatch per tensor (a restore copies thousands)."""
    wrong = [(k, list(t.shape), list(targets[k].shape)) for k, t in loaded.items() if t.shape != targets[k].shape]
    if wrong:
        raise ValueError(f"loaded tensors do not match the live shapes (key, loaded, live): {wrong[:5]}")
    if loaded:
        with torch.no_grad():
            torch._foreach_copy_([targets[key] for key in loaded], list(loaded.values()))


def _experts_held(param: torch.Tensor, slot: ParamSlot) -> int:
    """How many experts' slices of stacked parameter ``param`` this rank holds: all of them, or a stacked DTensor's
    local piece's (:func:`_local_experts`)."""
    return piece(param).shape[0] // (slot.view[1] if slot.view else 1)


def _slice_shape(slot: ParamSlot, param_shape: torch.Size) -> tuple[int, ...]:
    """Shape of the unit's part of the parameter: the whole parameter, or one expert's slice of it."""
    if slot.index is None:
        return tuple(param_shape)
    return tuple(slot.view or param_shape)[1:]


def _sliced(shape: Sequence[int], slot: ParamSlot, param_shape: torch.Size) -> bool:
    """Whether the unit holds a slice of a tensor of ``shape``: a stacked tensor shaped like its parameter. State
    that is not (a scalar step) is shared whole by the parameter's experts."""
    return slot.index is not None and len(shape) > 0 and shape[0] == param_shape[0]


def _take(tensor: torch.Tensor, slot: ParamSlot, param_shape: torch.Size, local: bool = False) -> torch.Tensor:
    """The expert's slice of a stacked tensor (through its ``[E, I, ...]`` view when flattened), or the whole
    tensor when it is not sliced (see :func:`_sliced`); ``local``: a whole DTensor as this rank's piece of it."""
    if not _sliced(tensor.shape, slot, param_shape):
        return piece(tensor) if local else tensor
    tensor = piece(tensor)  # a stacked DTensor's slice indices count in this rank's piece (:func:`_local_experts`)
    return (tensor.view(-1, *slot.view[1:]) if slot.view else tensor)[slot.index]


def _copied_state(states: Mapping[torch.Tensor, Mapping[str, Any]]) -> dict[torch.Tensor, dict[str, Any]]:
    """Optimizer state by parameter, each tensor in it copied (a load writes into the live ones in place)."""
    return {
        param: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in state.items()}
        for param, state in states.items()
    }


class RollbackPoint(NamedTuple):
    """The live state before a load (:meth:`Layout.rollback_point`)."""

    model: dict[str, torch.Tensor]
    """Copies of the weights and buffers, by key."""
    optimizer: dict[torch.Tensor, dict[str, Any]]
    """Copies of the optimizer state, by parameter."""


def build_layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    preset: str | Sequence[str] = "auto",
    expert_offset: ExpertOffset = 0,
    num_experts: int | None = None,
    expert_parallel: int = 1,
    expert_buffers: Sequence[str] = (),
) -> Layout:
    """Map every named parameter of ``model`` (and its optimizer state) to exactly one unit.

    Args:
        preset: ``"auto"``, ``"per_module"``, ``"stacked"``, a custom regular expression, or a sequence of
            regular expressions (:mod:`moc_lightning.engine.discovery` names their groups).
        expert_offset: global id of local expert 0 (per MoE layer prefix when a callable).
        num_experts: global experts per MoE layer; defaults to the experts found here times ``expert_parallel``.
        expert_parallel: how many ranks the experts of a layer are spread over (the EP degree).
        expert_buffers: regular expressions (``re.search`` on the fully qualified name) of per-expert buffers held by
            a MoE layer or its router that are expert state, not routing state: their entries go to the experts (see
            :mod:`moc_lightning.engine.discovery`; ``CheckpointConfig.expert_buffers``).
    """
    if expert_parallel < 1:
        raise ValueError(f"expert_parallel must be >= 1 (the ranks a layer's experts are on), got {expert_parallel}")
    patterns = compile_patterns(preset)
    params = dict(model.named_parameters())
    matches, views, routers = expert_claims(
        {name: m for name in params if (m := match_expert(name, patterns))}, params, num_experts, expert_parallel
    )
    if not matches:
        raise no_experts_error(preset, list(params), PRESETS)
    prefixes = list(dict.fromkeys(m.layer_prefix for m in matches.values()))
    layer_of = {prefix: i for i, prefix in enumerate(prefixes)}

    slots: dict[Unit, list[ParamSlot]] = {}
    for name, param in params.items():
        if (m := matches.get(name)) is None:
            dense = DenseUnit(dense_unit_name(name, prefixes))
            slots.setdefault(dense, []).append(ParamSlot(name, name[len(dense.name) :].lstrip(".") or name))
            continue
        offset = expert_offset_of(expert_offset, m.layer_prefix)
        for local_id, index in placements(name, param, m, views.get(name)):
            unit: Unit = ExpertUnit(layer_of[m.layer_prefix], offset + local_id)
            slots.setdefault(unit, []).append(ParamSlot(name, m.local_name, index, view=views.get(name)))

    whole = {  # a stacked DTensor's shape counts every expert of its layer, wherever they are held
        m.layer_prefix: (views.get(name) or params[name].shape)[0]
        for name, m in matches.items() if m.local_index is None and isinstance(params[name], DTensor)
    }
    moe_layers = tuple(
        moe_layer(i, prefix, slots, whole.get(prefix, num_experts), expert_parallel, routers[prefix])
        for i, prefix in enumerate(prefixes)
    )
    buffers = persistent_buffers(model)
    claimed = claimed_buffers(buffers, expert_buffers)
    for name, buffer in buffers.items():
        for unit, slot in buffer_slots(name, buffer, patterns, moe_layers, expert_offset, name in claimed):
            slots.setdefault(unit, []).append(slot)
    check_unique_keys(slots)
    return Layout(
        slots={unit: tuple(s) for unit, s in slots.items()},
        moe_layers=moe_layers,
        params=params,
        optimizer=optimizer,
        buffers=buffers,
        aliases=tied_aliases(model, {**params, **buffers}),
        compute_dtypes=compute_dtypes(model),
    )
