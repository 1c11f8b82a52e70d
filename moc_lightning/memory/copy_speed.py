"""The speed of light of a snapshot: copy bandwidth into a reused, preallocated host buffer.

The benchmark reports it beside every snapshot; replay mode's ``checkpoint.replay.window=auto`` measures it at
start-up to size the window (:mod:`moc_lightning.replay.window_choice`). Its own module so the engine can measure it
without importing the benchmark.
"""

from __future__ import annotations

import math
import time

import torch

GB = 1e9


def copy_gbps(tensors: list[torch.Tensor], repeats: int = 3) -> float:
    """Best copy bandwidth of ``tensors`` into one reused, preallocated host buffer (pinned with CUDA), in one
    ``_foreach_copy_`` as a snapshot copies them.

    This bounds a snapshot: copying the same tensors somewhere training does not touch, with no allocation. The first
    repeat also touches the buffer's pages; the best of the others is the bound.
    """
    sources = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(s.numel() for s in sources)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    targets = list(buffer.split([s.numel() for s in sources]))
    best = math.inf
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            torch._foreach_copy_(targets, sources)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return total / best / GB
