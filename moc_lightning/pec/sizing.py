"""Sizing a snapshot slot before anything is copied into it.

Slots are allocated once and reused (DESIGN.md, hard part 3), so their size is estimated up front: from the write
plan's view of who holds what (DDP, ZeRO owners, FSDP2 pieces), the current ``k_snapshot``, and, before the
optimizer's first step, the optimizer state it will create.
"""

from __future__ import annotations

import torch

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.parts import always_saved
from moc_lightning.engine.size_model import stated_state_bytes
from moc_lightning.engine.units import ExpertUnit, Unit
from moc_lightning.pec.write_plan import WritePlan


def snapshot_share_bytes(
    plan: WritePlan, k_snapshot: int, with_optimizer_state: bool = False, complete: bool = False
) -> int:
    """What one rank's snapshot slot should hold at ``k_snapshot`` (``complete``: with every expert, as the
    snapshot of a complete first persist).

    Snapshot ownership spreads the dense units and ``k_snapshot`` experts per MoE layer over the ranks
    in whole units, balanced by bytes: an even share plus the largest unit covers the imbalance. Under
    ZeRO each unit is snapshotted by its state owner: this rank's dense units and, per MoE layer, its
    ``k_snapshot`` largest experts; under FSDP2 each holder snapshots its pieces of them, so the same count
    over the local bytes. Under a ``pec_scope`` other than ``both`` the other experts' non-PEC part is added.
    ``with_optimizer_state``: before the optimizer's first step (no state yet), count the state it will create
    (:func:`expected_state_bytes`).
    """
    layout, owners = plan.layout, plan.state_owners
    rest = always_saved(plan.cfg.pec_scope)
    local = plan.piece_holders is not None

    def nbytes(unit: Unit, part: str | None = None) -> int:
        size = layout.unit_bytes(plan.local_twin(unit), local=local)
        state = size.optimizer
        if with_optimizer_state and state == 0:
            state = expected_state_bytes(layout, plan.local_twin(unit), local=local)
        weights = size.weights + size.buffers
        return {None: weights + state, "weights": weights, "optimizer": state}[part]

    if owners is not None or local:
        mine = [u for u in layout.units if local or (owners is not None and owners[u.key] == plan.topology.rank)]
        total = sum(nbytes(u) for u in mine if not isinstance(u, ExpertUnit))
        for layer, n in enumerate(layout.num_experts):
            layer_units = sorted(
                (u for u in mine if isinstance(u, ExpertUnit) and u.layer == layer), key=nbytes, reverse=True
            )
            k = n if complete else k_snapshot
            total += sum(nbytes(u) for u in layer_units[:k])
            total += sum(nbytes(u, rest) for u in layer_units[k:]) if rest is not None else 0
        return total

    dense = [nbytes(u) for u in layout.dense_units]
    experts = [ExpertUnit(layer, 0) for layer in range(len(layout.num_experts))]
    per_layer = list(layout.num_experts) if complete else [k_snapshot] * len(experts)
    total = sum(dense) + sum(k * nbytes(unit) for k, unit in zip(per_layer, experts))
    if rest is not None:
        total += sum((n - k) * nbytes(unit, rest) for n, k, unit in zip(layout.num_experts, per_layer, experts))
    return -(-total // plan.topology.world_size) + max(dense + [nbytes(u) for u in experts], default=0)


def expected_state_bytes(layout: Layout, unit: Unit, local: bool = False) -> int:
    """Optimizer state ``unit`` will have once stepped, for sizing before the optimizer has created any: what the
    optimizer states (:func:`stated_state_bytes`), else :func:`expected_state_ratio` of its weights (``local``: of
    this rank's pieces of them)."""
    stated = stated_state_bytes(layout, unit)
    if stated is not None:
        return stated
    return int(layout.unit_bytes(unit, local=local).weights * expected_state_ratio(layout.optimizer))


def expected_state_ratio(optimizer: torch.optim.Optimizer | None) -> float:
    """Optimizer state per byte of weights, for sizing before the optimizer has created any: two moments for
    the Adam family, one buffer for SGD with momentum and Adagrad, two (the Adam case) when unknown."""
    if optimizer is None:
        return 0.0
    name = type(optimizer).__name__
    if name == "SGD":
        return 1.0 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0.0
    return {"Adagrad": 1.0, "RMSprop": 1.0, "Adadelta": 2.0}.get(name, 2.0)
