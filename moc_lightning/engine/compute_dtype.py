"""The dtype a forward computes each parameter in, where a sharding wrapper casts it exactly: FSDP2's mixed precision.

Under ``fully_shard`` with a ``MixedPrecisionPolicy(param_dtype=bf16)`` (``trainer.precision=bf16-mixed`` under
``trainer.data_parallel=fsdp2|hsdp``, :func:`~moc_lightning.models.sharded.mixed_precision_policy`) the fp32 shard is
the master weight, and the all-gather casts it to bf16 before anything reads it: the forward and the backward see
``bf16(w)`` and nothing else of ``w``. Replay mode logs a frozen unit's weights for its forward and backward only (the
unit gets no optimizer step), so it logs ``bf16(w)``, half the bytes; written back as ``float(bf16(w))`` into the fp32
shard, the all-gather casts it to the same ``bf16(w)`` (bf16 -> fp32 -> bf16 round-trips exactly), and the replayed
iteration is bitwise the fault-free one.

Only there: autocast (``bf16-mixed`` under DDP or ZeRO-2) keeps the fp32 weights and runs some ops on them in fp32
(layer norm, the loss), so logging them in bf16 would change those ops. The dtype comes from FSDP2's own state, per
parameter (each ``fully_shard`` call has its own policy), never from the trainer's configuration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def compute_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Name -> the dtype FSDP2 all-gathers it in for compute, for each parameter of ``model`` whose ``fully_shard``
    policy casts it (``param_dtype`` set and other than the parameter's own floating dtype, as FSDP2 itself decides);
    the other parameters are read in their own dtype. Reads FSDP2's per-module state (private: its parameter groups'
    ``mp_policy`` and ``fsdp_params``, :func:`param_groups`); a model without ``fully_shard`` modules gives none."""
    names = {id(param): name for name, param in model.named_parameters()}
    found: dict[str, torch.dtype] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in param_groups(module._get_fsdp_state()):
            dtype = group.mp_policy.param_dtype
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                if dtype is not None and param.dtype.is_floating_point and dtype != param.dtype and id(param) in names:
                    found[names[id(param)]] = dtype
    return found


def param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``); torch 2.11, which GPU images
    ship, one group or ``None`` (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
