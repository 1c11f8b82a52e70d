"""``torchrun --standalone`` from inside one process, with every rank forked from a server that imported once.

A rank that ``torchrun`` starts is a fresh interpreter importing torch, Lightning and moc_lightning again: about six
seconds of CPU each on the reference machine, most of a short multi-rank job there (a fault drill's two incarnations
of 4 ranks, a chaos trial's incarnations). :func:`standalone` runs a function on local ranks through torch's own
elastic agent (``elastic_launch``: the same rendezvous, rank environment, restarts and failure report as
``torchrun --standalone``), but starts each rank from a fork server that imported :data:`PRELOAD` once. The ranks are
still separate processes, forked from one that has run nothing but imports: forking the caller instead would copy
the state of its threads (tensorstore aborts such a child, and OpenMP's thread pool does not survive a fork).

The training recipes keep ``torchrun``, what users run; this is for the harnesses that launch many short jobs.
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

PRELOAD = ("torch", "torch.distributed.checkpoint", "lightning", "moc_lightning.lightning.callback", "moc_lightning.models.lightning")
"""Modules the fork server imports before it forks any rank (tensorstore is imported with them, but not started:
a rank starts its own threads)."""


def preload_fork_server(modules: Sequence[str] = PRELOAD) -> None:
    """Have the fork server import ``modules`` when it starts (no effect once it has started)."""
    multiprocessing.set_forkserver_preload(list(modules))


def standalone(fn: Callable[..., Any], args: tuple, nproc: int, max_restarts: int = 0) -> dict[int, Any]:
    """``torchrun --standalone --nproc-per-node=nproc --max-restarts=max_restarts`` of ``fn(*args)``; each rank's
    return value by local rank. Raises torch's ``ChildFailedError`` when the job fails after its restarts."""
    preload_fork_server()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        start_method="forkserver",
    )
    return elastic_launch(config, fn)(*args)
