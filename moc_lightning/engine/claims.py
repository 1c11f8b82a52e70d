"""Which parameters an expert pattern matched really are experts: routers found by name, stacked claims
checked for consistency, and what to tell a user whose model shows no experts at all.

A name pattern alone over-claims: JetMoe's attention module holds ``experts.bias``, a ``[hidden]`` vector
that the stacked pattern ``...experts.<leaf>`` would take for ``hidden`` experts. What a stacked claim must
satisfy (:func:`stacked_views`) is what expert tensors always do: the layer's ``[E, ...]`` tensors agree on
E, and its router has one output per expert. The router also tells a flattened stack ``[E*I, ...]`` (DBRX)
apart, which no name can. These are pure functions of names and shapes.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

ROUTER_NAMES: frozenset[str] = frozenset({"router", "gate", "gating"})
"""Module names that mark a MoE layer's router (Mixtral's ``gate``, Switch's ``router.classifier``, ...)."""
LOOKS_LIKE_MOE = re.compile(r"expert|moe|router|gate|gating|switch", re.IGNORECASE)
"""Parameter names a "no experts found" error lists: the ones a user's regular expression should match."""
_LISTED = 12
"""How many such names the error lists."""


@dataclass(frozen=True)
class Router:
    """A MoE layer's router as its parameters show it."""

    module: str
    """Fully qualified module name (``model.layers.0.mlp.gate``)."""
    experts: int
    """Rows of its 2-D weight: the number of experts it scores (global, under expert parallelism)."""


def find_router(prefix: str, shapes: Mapping[str, torch.Size], claimed: Collection[str]) -> Router | None:
    """The router of the MoE layer at ``prefix``: the outermost module below it named one of
    :data:`ROUTER_NAMES` that holds a 2-D parameter not claimed by an expert; ``None`` if there is none."""
    for name, shape in shapes.items():
        if not name.startswith(prefix + ".") or name in claimed or len(shape) != 2:
            continue
        parts = name[len(prefix) + 1 :].split(".")
        hit = next((i for i, part in enumerate(parts[:-1]) if part in ROUTER_NAMES), None)
        if hit is not None:
            return Router(module=".".join([prefix, *parts[: hit + 1]]), experts=shape[0])
    return None


def stacked_views(
    prefix: str,
    shapes: Mapping[str, torch.Size],
    router: Router | None,
    num_experts: int | None,
    expert_parallel: int,
) -> dict[str, tuple[int, ...] | None]:
    """The stacked candidates of the MoE layer ``prefix`` that are expert tensors, each with the view that
    exposes its expert dim (``None``: dim 0 already is; ``(E, I, ...)`` for a flattened ``[E*I, ...]``).

    Expert matrices (2-D and up) are the claim: dim 0 is the number of experts this rank holds, or a multiple
    of it when the router (or ``num_experts``) says how many that is; all must agree, and the router must have
    one output per expert. A 1-D candidate is kept only when its length is that number (a per-expert scalar);
    a layer with 1-D candidates alone is no MoE layer (returns ``{}``). Raises ``ValueError`` for a claim
    that is inconsistent.
    """
    matrices = {name: tuple(shape) for name, shape in shapes.items() if len(shape) >= 2}
    if not matrices:
        return {}
    if router is not None and num_experts is not None and router.experts != num_experts:
        raise _inconsistent(prefix, matrices, router, f"num_experts={num_experts}")
    known = num_experts if num_experts is not None else (router.experts if router is not None else None)
    per_rank = known // expert_parallel if known is not None else None
    views: dict[str, tuple[int, ...] | None] = {}
    for name, shape in matrices.items():
        rows = shape[0]
        if per_rank is None or rows == per_rank or (num_experts is not None and rows < per_rank):
            views[name] = None  # dim 0 is the expert dim (fewer than per_rank: a slice given by expert_offset)
        elif per_rank > 0 and rows % per_rank == 0:
            views[name] = (per_rank, rows // per_rank, *shape[1:])
        else:
            raise _inconsistent(prefix, matrices, router, f"{per_rank} experts on this rank")
    counts = {name: view[0] if view else matrices[name][0] for name, view in views.items()}
    if len(set(counts.values())) > 1:
        raise _inconsistent(prefix, matrices, router, "one E for all of them")
    experts = next(iter(counts.values()))
    if router is not None and num_experts is None and router.experts != experts * expert_parallel:
        raise _inconsistent(prefix, matrices, router, f"{experts} experts x expert_parallel={expert_parallel}")
    vectors = {name: None for name, shape in shapes.items() if len(shape) == 1 and shape[0] == experts}
    return {**views, **vectors}


def _inconsistent(
    prefix: str, matrices: Mapping[str, tuple[int, ...]], router: Router | None, expected: str
) -> ValueError:
    said = f"router {router.module!r} has {router.experts} outputs" if router else "no router found"
    return ValueError(
        f"the stacked expert tensors of MoE layer {prefix!r} do not agree on the number of experts E: shapes "
        f"{ {name: list(shape) for name, shape in matrices.items()} }, {said}, expected {expected}. Each must be "
        "[E, ...] (or a flattened [E*I, ...] with a router of E outputs); give num_experts/expert_offset, or a "
        "preset that matches only expert tensors"
    )


def no_experts_error(preset: str | Sequence[str], names: Sequence[str], presets: Collection[str]) -> ValueError:
    """The error for a model in which ``preset`` finds no experts: the names that look like experts or routers,
    and a regular expression to start from."""
    hints = [name for name in names if LOOKS_LIKE_MOE.search(name)]
    listed = f"names that look like experts or routers: {hints[:_LISTED]}{' ...' if len(hints) > _LISTED else ''}"
    return ValueError(
        f"no expert parameters found with preset {preset!r} among {len(names)} parameters ("
        f"{listed if hints else 'none looks like an expert or a router'}). Choose one of {sorted(presets)}, or "
        "give a regular expression as the preset (MoCCheckpoint(layout_preset=...)): a named group 'layer' for "
        "the MoE layer's module and, for one module per expert, a group 'expert' for its index; e.g. "
        f"{suggest_pattern(hints)!r}"
    )


def suggest_pattern(names: Sequence[str]) -> str:
    """A regular expression for the first name with an ``expert`` component: per module when an index follows
    it, stacked otherwise."""
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if "expert" in part.lower()), None)
        if at is None:
            continue
        following = parts[at + 1]
        if following.isdigit():
            return rf"(?P<layer>.+?)\.{re.escape(parts[at])}\.(?P<expert>\d+)\."
        if at + 2 == len(parts):
            return rf"(?P<layer>.+?)\.{re.escape(parts[at])}\.(?=[^.]+$)"
    return r"(?P<layer>.+?\.moe)\.experts\.(?P<expert>\d+)\."
