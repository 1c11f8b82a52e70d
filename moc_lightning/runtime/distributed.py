"""Small helpers for the collectives MoC runs on the training process group (gloo or NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives must live: NCCL only moves CUDA tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
