"""Small helpers for the collectives MoC runs on the training process group (gloo or NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives must live: NCCL only moves CUDA tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreement_group() -> dist.ProcessGroup | None:
    """A new gloo group of every rank for the small agreements a snapshot starts on the training thread and reads
    later (:class:`~moc_lightning.runtime.agreement.StartedReduction`): CPU tensors whatever the training backend, so
    reading one never waits for a device stream, and a queue of its own, behind no gradient all-reduce. Collective:
    every rank calls it at the same point (an engine's construction). ``None`` without a process group."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None
