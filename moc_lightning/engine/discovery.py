"""Discovery: how :func:`~moc_lightning.engine.layout.build_layout` finds a model's units in its names and shapes.

Detection is by name and shape alone: a per-module expert pattern (``expert`` group) or a stacked pattern's
``experts`` module marks expert state; everything else under the MoE layer's prefix is the layer's or its router's.
A user whose layer holds per-expert state that is not routing (a per-expert statistic that should follow its expert's
version) names it in ``expert_buffers`` (``CheckpointConfig.expert_buffers``: regular expressions, ``re.search`` on the
fully qualified name); such a buffer is sliced to the experts like a stacked ``experts`` buffer, and a pattern that
names no buffer, or a buffer outside the MoE layers or without one entry per expert, is refused.

Experts are found by regular expressions over parameter names. A pattern is matched at the start of the
name (``re.match``) and has a named group ``layer`` (the MoE layer's module prefix) and, for one module per
expert, a group ``expert`` (the expert's index); the rest of the name after the match is the parameter's
name inside the expert. A pattern without an ``expert`` group matches a *stacked* parameter of shape
``[E, ...]`` whose slice ``[i]`` is local expert ``i``. ``expert_offset`` turns local indices (stacked
positions, Megatron ``local_experts.{i}``, DeepSpeed ``deepspeed_experts.{i}``) into global ids; the
reference model already names experts by global id, so it needs the default offset 0.

A stacked claim must be consistent, or it is not experts: every ``[E, ...]`` tensor of the layer has the same
E on dim 0, and the layer's router (a module named ``router``, ``gate`` or ``gating`` below the layer, holding
a 2-D weight) has one output per expert. A tensor whose dim 0 is a multiple of the router's E is a flattened
stack ``[E*I, ...]`` (DBRX) and is sliced through the view ``[E, I, ...]``. A 1-D tensor is an expert slice
only beside expert matrices of the same E, so a bias vector of the hidden size is never taken for experts.

Non-expert parameters form dense units at layer granularity: the module one level below the MoE layer
(its router) or below the transformer block (the first integer-indexed module in the name: attention,
FFN, norms), and otherwise the parameter's own module (embeddings, final norm, head).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # what DCP places pieces by

from moc_lightning.engine.claims import Router, find_router, stacked_views
from moc_lightning.engine.slots import MoeLayer, ParamSlot, slot_key
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit

PER_MODULE_PATTERNS: tuple[str, ...] = (
    # reference model (moe.experts.{e}.fc.weight), Mixtral (block_sparse_moe.experts.{e}.w1.weight),
    # Qwen-MoE / DeepSeek (mlp.experts.{e}.gate_proj.weight), in transformers 4.x
    r"(?P<layer>.+?)\.experts\.(?P<expert>\d+)\.",
    # Switch Transformers (mlp.experts.expert_{e}.wi.weight)
    r"(?P<layer>.+?)\.experts\.expert_(?P<expert>\d+)\.",
    # DeepSpeed-MoE
    r"(?P<layer>.+?\.deepspeed_moe)\.experts\.deepspeed_experts\.(?P<expert>\d+)\.",
    # Megatron-LM SequentialMLP
    r"(?P<layer>.+?)\.experts\.local_experts\.(?P<expert>\d+)\.",
)
STACKED_PATTERNS: tuple[str, ...] = (
    # a parameter held directly by an ``experts`` module with leading dim E (grouped GEMM, transformers 5.x
    # fused experts: Mixtral, Qwen-MoE, DeepSeek-V3, GraniteMoe; torchtitan's w1/w2/w3)
    r"(?P<layer>.+?)\.experts\.(?=[^.]+$)",
    # DBRX: ffn.experts.mlp.{w1,v1,w2}, flattened [E*I, H]
    r"(?P<layer>.+?)\.experts\.mlp\.(?=[^.]+$)",
    # JetMoe (mlp and self_attention.experts) and GraniteMoe 4.x: {input,output}_linear.weight, [E, out, in]
    r"(?P<layer>.+?)\.(?=(?:input|output)_linear\.weight$)",
)
PRESETS: Mapping[str, tuple[str, ...]] = {
    "auto": PER_MODULE_PATTERNS + STACKED_PATTERNS,
    "per_module": PER_MODULE_PATTERNS,
    "stacked": STACKED_PATTERNS,
}

ExpertOffset = int | Callable[[str], int]
"""Global id of local expert 0: one int for every MoE layer, or a function of the MoE layer's prefix."""


@dataclass(frozen=True)
class ExpertMatch:
    """A parameter an expert pattern matched: its MoE layer, its name inside the expert, and the expert's index."""

    layer_prefix: str
    local_name: str
    local_index: int | None
    """Captured expert index; ``None`` for a stacked parameter."""


def compile_patterns(preset: str | Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """The expert patterns of a preset name, one regular expression or several; a clear error for a bad one."""
    sources = PRESETS.get(preset, (preset,)) if isinstance(preset, str) else tuple(preset)
    patterns = []
    for source in sources:
        try:
            pattern = re.compile(source)
        except re.error as err:
            raise ValueError(
                f"preset {source!r} is neither one of {sorted(PRESETS)} nor a valid regular expression: {err}"
            ) from None
        if "layer" not in pattern.groupindex:
            raise ValueError(
                f"expert pattern {source!r} needs a named group 'layer' (the MoE layer prefix); it may also "
                "have a group 'expert' (the expert index; without it the parameter is a stacked [E, ...] tensor)"
            )
        patterns.append(pattern)
    return tuple(patterns)


def match_expert(name: str, patterns: Sequence[re.Pattern[str]]) -> ExpertMatch | None:
    """What the one pattern that matches parameter ``name`` says of it; ``None`` if none does."""
    hits = [(p, m) for p in patterns if (m := p.match(name))]
    if len(hits) > 1:
        raise ValueError(
            f"parameter {name!r} matches more than one expert pattern: {[p.pattern for p, _ in hits]}; "
            "give patterns that match each expert parameter once"
        )
    if not hits:
        return None
    pattern, m = hits[0]
    local_name = name[m.end() :].lstrip(".")
    if not local_name:
        raise ValueError(
            f"expert pattern {pattern.pattern!r} consumed all of parameter {name!r}; "
            "it must stop before the name inside the expert"
        )
    index = int(m["expert"]) if "expert" in pattern.groupindex else None
    return ExpertMatch(layer_prefix=m["layer"], local_name=local_name, local_index=index)


def dense_unit_name(name: str, moe_prefixes: Iterable[str]) -> str:
    """Module at layer granularity owning non-expert parameter ``name`` (see the module docstring)."""
    parts = name.split(".")
    anchor = next((len(p.split(".")) for p in moe_prefixes if name.startswith(p + ".")), None)
    if anchor is None:
        anchor = next((i + 1 for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    if anchor is None:
        return ".".join(parts[:-1]) or name
    return ".".join(parts[: min(anchor + 1, len(parts) - 1)])


def expert_offset_of(expert_offset: ExpertOffset, prefix: str) -> int:
    """The global id of local expert 0 of the MoE layer at ``prefix``."""
    return expert_offset(prefix) if callable(expert_offset) else expert_offset


def expert_claims(
    found: Mapping[str, ExpertMatch], params: Mapping[str, nn.Parameter], num_experts: int | None, expert_parallel: int
) -> tuple[dict[str, ExpertMatch], dict[str, tuple[int, ...] | None], dict[str, Router | None]]:
    """The matches that are experts (per-module ones, and stacked ones that pass :func:`stacked_views`), the
    view of each stacked one, and each MoE layer's router."""
    shapes = {name: param.shape for name, param in params.items()}
    kept: dict[str, ExpertMatch] = {}
    views: dict[str, tuple[int, ...] | None] = {}
    routers: dict[str, Router | None] = {}
    for prefix in dict.fromkeys(m.layer_prefix for m in found.values()):
        names = [name for name, m in found.items() if m.layer_prefix == prefix]
        router = find_router(prefix, shapes, found)
        stacked = {name: shapes[name] for name in names if found[name].local_index is None}
        ep = 1 if any(isinstance(params[name], DTensor) for name in stacked) else expert_parallel  # whole shapes
        layer_views = stacked_views(prefix, stacked, router, num_experts, ep) if stacked else {}
        experts = [name for name in names if found[name].local_index is not None or name in layer_views]
        if experts:
            kept.update({name: found[name] for name in experts})
            views.update(layer_views)
            routers[prefix] = router
    return kept, views, routers


def tied_aliases(model: nn.Module, named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each name of ``model.state_dict()`` that is not in ``named`` but holds one of its tensors, to that tensor's
    name in ``named``: ``named_parameters()`` lists a tied tensor once, ``state_dict()`` under every name."""
    first = {id(tensor): name for name, tensor in named.items()}
    return {
        name: first[id(tensor)]
        for name, tensor in model.state_dict(keep_vars=True).items()
        if name not in named and id(tensor) in first
    }


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that ``model.state_dict()`` holds (not the non-persistent ones), by fully qualified name."""
    return {
        f"{prefix}.{name}" if prefix else name: buffer
        for prefix, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def buffer_slots(
    name: str,
    buffer: torch.Tensor,
    patterns: Sequence[re.Pattern[str]],
    moe_layers: Sequence[MoeLayer],
    expert_offset: ExpertOffset,
    claimed: bool,
) -> list[tuple[Unit, ParamSlot]]:
    """The unit (or, for a per-expert buffer of experts, the experts) owning buffer ``name`` (see the module
    docstring); ``claimed``: an ``expert_buffers`` pattern names it expert state."""
    m = match_expert(name, patterns)
    layer = next((layer for layer in moe_layers if m is not None and layer.prefix == m.layer_prefix), None)
    if m is not None and layer is not None and m.local_index is not None:  # inside one expert's module
        unit: Unit = ExpertUnit(layer.index, expert_offset_of(expert_offset, layer.prefix) + m.local_index)
        return [(unit, ParamSlot(name, m.local_name, buffer=True))]
    holder, leaf = name.rpartition(".")[::2]
    if layer is not None:  # inside a stacked ``experts`` module: its experts' entries
        per_expert = _one_per_expert(buffer, layer)
    else:  # held by a MoE layer module itself or by its router (routing state), or outside every MoE layer
        layer = max((x for x in moe_layers if name.startswith(x.prefix + ".")), key=lambda x: len(x.prefix),
                    default=None)  # the innermost, were MoE layers nested
        per_expert = layer is not None and (claimed or (holder == layer.prefix and _differs_per_rank(buffer, layer)))
    if claimed:
        _check_claim(name, buffer, layer, moe_layers)
    if per_expert and layer is not None:  # per_expert is only ever True with a layer
        whole = buffer.shape[0] == layer.num_experts  # entry e is expert e's; else the local experts' in order
        return [
            (ExpertUnit(layer.index, e), ParamSlot(name, leaf, index=e if whole else i, buffer=True))
            for i, e in enumerate(layer.local_experts)
        ]
    prefixes = [x.prefix for x in moe_layers]
    if layer is not None and layer.router is not None and holder == layer.prefix:  # routing state: the router's unit
        return [(DenseUnit(dense_unit_name(f"{layer.router}.{leaf}", prefixes)), ParamSlot(name, leaf, buffer=True))]
    unit = DenseUnit(dense_unit_name(name, prefixes))
    return [(unit, ParamSlot(name, name[len(unit.name) :].lstrip(".") or name, buffer=True))]


def _one_per_expert(buffer: torch.Tensor, layer: MoeLayer) -> bool:
    """Whether ``buffer`` has one entry per expert of ``layer`` along dim 0: all N, or this rank's local experts."""
    return buffer.dim() > 0 and buffer.shape[0] in (layer.num_experts, len(layer.local_experts))


def _differs_per_rank(buffer: torch.Tensor, layer: MoeLayer) -> bool:
    """Whether a buffer of the MoE layer module itself has one entry per *local* expert under expert parallelism
    (``[E_local]``, E_local < N): its values differ per rank, so no dense unit (which every rank holds alike, written
    once) can hold it, and its entries stay with the local experts, in order."""
    return buffer.dim() > 0 and buffer.shape[0] == len(layer.local_experts) < layer.num_experts


def _check_claim(name: str, buffer: torch.Tensor, layer: MoeLayer | None, moe_layers: Sequence[MoeLayer]) -> None:
    """Refuse an ``expert_buffers`` claim on a buffer that cannot be expert state: outside every MoE layer, or without
    one entry per expert."""
    if layer is None:
        raise ValueError(
            f"expert_buffers names buffer {name!r}, which is not held by a MoE layer or its router (MoE layers: "
            f"{[x.prefix for x in moe_layers]}); only a per-expert buffer of a MoE layer can be expert state"
        )
    if not _one_per_expert(buffer, layer):
        raise ValueError(
            f"expert_buffers names buffer {name!r} of shape {tuple(buffer.shape)}, whose dim 0 is not one entry per "
            f"expert of MoE layer {layer.prefix!r} ({layer.num_experts} experts, {len(layer.local_experts)} on this "
            "rank); an expert buffer has one entry per expert"
        )


def claimed_buffers(buffers: Iterable[str], expert_buffers: Sequence[str]) -> set[str]:
    """The buffers that ``expert_buffers`` names (each pattern found in the fully qualified name, ``re.search``); a
    pattern that names none is refused, so that a misspelt override does not silently leave a buffer dense."""
    names = list(buffers)
    claimed: set[str] = set()
    for source in expert_buffers:
        found = {name for name in names if re.search(source, name)}
        if not found:
            raise ValueError(
                f"expert_buffers pattern {source!r} matches no buffer of the model (persistent buffers: "
                f"{names[:10]}{' ...' if len(names) > 10 else ''}); name per-expert buffers of MoE layers"
            )
        claimed |= found
    return claimed


def placements(
    name: str, param: nn.Parameter, m: ExpertMatch, view: tuple[int, ...] | None
) -> Sequence[tuple[int, int | None]]:
    """``(local expert id, slice index)`` of each expert holding a part of expert parameter ``name``."""
    if m.local_index is not None:
        return [(m.local_index, None)]
    if param.dim() == 0:
        raise ValueError(f"stacked expert parameter {name!r} is a scalar; it needs a leading expert dim [E, ...]")
    if isinstance(param, DTensor):
        return _local_experts(name, param, view)
    return [(i, i) for i in range((view or param.shape)[0])]


def _local_experts(name: str, param: DTensor, view: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """``(expert id, slice index)`` of each expert whose rows this rank's piece of the stacked DTensor ``name`` holds:
    sharded along the expert dim (torchtitan's layout under ``fully_shard``), the piece is whole experts, their ids
    counted in the whole tensor, their slices in the piece. A piece that splits an expert is refused."""
    if any(p != Shard(0) and not p.is_replicate() for p in param.placements):
        raise ValueError(
            f"stacked expert parameter {name!r} is a DTensor placed {tuple(param.placements)}; MoC slices a stacked "
            "[E, ...] DTensor into experts only when it is sharded along dim 0, the expert dim, or replicated (shard "
            "it along dim 0, e.g. fully_shard's default shard_placement_fn)"
        )
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    rows = view[1] if view else 1
    if offset[0] % rows or shape[0] % rows:
        raise ValueError(
            f"stacked expert parameter {name!r} is a DTensor whose piece on this rank (rows [{offset[0]}, "
            f"{offset[0] + shape[0]}) of dim 0) splits an expert of {rows} rows; shard it so that each rank holds "
            "whole experts"
        )
    return [(offset[0] // rows + j, j) for j in range(shape[0] // rows)]


def moe_layer(
    index: int,
    prefix: str,
    slots: Mapping[Unit, list[ParamSlot]],
    num_experts: int | None,
    expert_parallel: int,
    router: Router | None,
) -> MoeLayer:
    experts = {
        u.expert: {s.local_name for s in unit_slots}
        for u, unit_slots in slots.items()
        if isinstance(u, ExpertUnit) and u.layer == index
    }
    local = tuple(sorted(experts))
    if not local:
        raise ValueError(
            f"MoE layer {prefix!r} has no expert on this rank: its stacked experts are sharded over more ranks than "
            "it has experts; MoC needs each rank to hold at least one whole expert"
        )
    shapes = {tuple(sorted(names)) for names in experts.values()}
    if len(shapes) > 1:
        raise ValueError(
            f"experts of MoE layer {prefix!r} hold different parameters {sorted(shapes)}; stacked tensors must "
            "share their leading dim E and every expert module must have the same parameters"
        )
    n = len(local) * expert_parallel if num_experts is None else num_experts
    if local[-1] >= n:
        raise ValueError(
            f"MoE layer {prefix!r} has global expert ids {list(local)} but num_experts={n}; ids must be in "
            "[0, num_experts) (check num_experts, expert_parallel and expert_offset)"
        )
    return MoeLayer(
        index=index, prefix=prefix, num_experts=n, local_experts=local, router=router.module if router else None
    )


def check_unique_keys(slots: Mapping[Unit, list[ParamSlot]]) -> None:
    """Two tensors must not land on the same key (e.g. an expert offset that folds ids together)."""
    for unit, unit_slots in slots.items():
        seen: dict[str, str] = {}
        for slot in unit_slots:
            key = slot_key(unit, slot)
            if key in seen:
                raise ValueError(
                    f"parameters {seen[key]!r} and {slot.param!r} both map to "
                    f"{key!r}; check expert_offset and the expert patterns"
                )
            seen[key] = slot.param
