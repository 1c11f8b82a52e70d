"""Checkpointing methods side by side on one machine: stall, overhead, bytes, throughput, recovery.

``recipes/bench.py`` is the Hydra front end; everything here also runs from Python (:func:`run_bench`).
Every method trains the same GPT-MoE from the same seed on the same batches in the same processes (one, or
``devices`` under ``torchrun`` in a ``data_parallel`` mode), so the differences between rows are the
checkpointing and nothing else. With several processes a row's stalls are, checkpoint by checkpoint, the
slowest rank's (synchronous training waits for it), and its recovery is the slowest rank's. Durations come from
timers wrapped around the code that does the work (:func:`timed`), not from differences of iteration
times, because a 2-core machine's iteration times are too noisy to subtract.

Recovery is measured in process: after a method's run, a fresh module and Trainer are built and resumed
from that method's newest checkpoint, the way a restarted rank would after its process was killed (files
on disk and the shared-memory snapshot slots outlive a process), up to the first training step.
"""

from moc_lightning.tools.bench.bounds import write_fsync_gbps
from moc_lightning.tools.bench.config import (
    METHODS,
    PAPER_K,
    BenchConfig,
    MethodUnavailable,
    register_configs,
    scaled_k,
)
from moc_lightning.tools.bench.methods import disk_bytes, tensor_bytes
from moc_lightning.tools.bench.run import run_bench
from moc_lightning.tools.bench.table import markdown_table

__all__ = [
    "METHODS", "PAPER_K", "BenchConfig", "MethodUnavailable", "disk_bytes", "markdown_table", "register_configs",
    "run_bench", "scaled_k", "tensor_bytes", "write_fsync_gbps",
]  # fmt: skip
