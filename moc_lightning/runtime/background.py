"""Background threads for snapshot copies and persists that do not slow the training thread down.

With PyTorch's OpenMP backend, every OS thread that runs a parallel ATen kernel (a large ``copy_``, say)
gets an OpenMP team of its own, sized like the training thread's. Once a long-lived worker thread has
made such a team, the training thread's kernels run measurably slower for the rest of the run: on 2 cores,
one 40 MB ``copy_`` on a pool thread made every later AdamW step of a small MLP ~20% slower, and every
training step of the quick benchmark's GPT-MoE ~35% slower (112 -> 155 ms, with no checkpoint running).

A worker that keeps to one intra-op thread avoids that, and loses little: a single thread already copies
at memory bandwidth (a 40 MB copy: 2.1 ms on one thread, 1.9 ms on two).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch


def _one_intra_op_thread() -> None:
    """Run in the new worker: OpenMP's thread count is per thread, so the training thread keeps its own.

    ``torch.set_num_threads`` also records the count for threads started later (they read it when they
    first run a parallel kernel); the training thread has done so long before any worker exists.
    """
    torch.set_num_threads(1)


def background_executor(name: str) -> ThreadPoolExecutor:
    """A one-worker executor whose thread runs ATen kernels on one intra-op thread. Its thread starts now: started at
    the first submit, its start (1-3 ms on the reference machine) would fall in a snapshot's stall."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_one_intra_op_thread)
    executor.submit(_started)
    return executor


def _started() -> None:
    """Nothing: the first task of an executor, so that its thread exists before any real one."""


def spare_core() -> bool:
    """Whether this node has a core that its ranks' training threads leave free, for a copy thread to run on.

    Without one, a host copy on a thread of its own costs more than it hides: the training thread's intra-op team
    waits for its preempted members (OpenMP threads spin meanwhile). Measured on 2 cores with 2 intra-op threads
    (``recipes/bench.py preset=quick``, replay captures of 86 MB an iteration): CPU time per iteration +66-70% with
    the copy behind the next forward, +21-32% with it on the training thread. A node's ranks share its cores:
    ``LOCAL_WORLD_SIZE`` (torchrun's) ranks of ``torch.get_num_threads()`` threads each.
    """
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return len(os.sched_getaffinity(0)) > ranks * torch.get_num_threads()
