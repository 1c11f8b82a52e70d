"""Run a function on N local ranks (gloo on CPU) and collect what each rank returns.

The ranks are forked from a fork server that has already imported torch, Lightning and moc_lightning
(:mod:`moc_lightning.runtime.launch` says why a server and not the test process), so a rank starts in well under a second
instead of paying several seconds of imports, most of a multi-process test's time on 2 cores. A rank gets what a
spawned one would inherit from the test at the call: its environment, working directory (``multiprocessing`` passes
that one), and standard output and error (pytest's capture of this test, not the one the fork server started under).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moc_lightning.runtime.launch import preload_fork_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Caller:
    """The test's environment and standard output and error, carried to a rank the fork server starts."""

    def __init__(self, env: dict[str, str], fds: Sequence[Any] = (1, 2)) -> None:
        self.env = env
        self.fds = fds

    def __reduce__(self) -> tuple:
        """Pickled while a rank is launched, so the file descriptors travel with it."""
        return (_Caller, (self.env, tuple(reduction.DupFd(fd) for fd in self.fds)))

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd.detach(), target)


def _entry(rank: int, fn: Callable, world_size: int, port: int, out: str, init: bool, args: tuple, caller: _Caller) -> None:
    caller.enter()
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
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; return their results by rank.

    With ``init_process_group=False`` the ranks only get torchrun's environment variables, so a Lightning
    Trainer inside ``fn`` sets the process group up itself, as under ``torchrun``.
    """
    out = tmp_path / "rank_results"
    out.mkdir(parents=True, exist_ok=True)
    preload_fork_server()
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), str(out), init_process_group, args, _Caller(dict(os.environ))),
        nprocs=world_size,
        start_method="forkserver",
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
