"""Run a function on N local ranks (gloo on CPU) and collect what each rank returns."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out: str, init: bool, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = fn(rank, world_size, *args)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any, init_process_group: bool = True) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return their results by rank.

    With ``init_process_group=False`` the ranks only get torchrun's environment variables, so a Lightning
    Trainer inside ``fn`` sets the process group up itself, as under ``torchrun``.
    """
    out = tmp_path / "rank_results"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(fn, world_size, free_port(), str(out), init_process_group, args), nprocs=world_size)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
