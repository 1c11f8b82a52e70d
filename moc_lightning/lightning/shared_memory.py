"""Where a run keeps its snapshot slots and replay windows in node-local shared memory, whether they fit, and their
removal once the run is done.

Each run has a folder per storage URL under ``checkpoint.shm_root``, a node folder in it (simulated nodes are rank
blocks, ``checkpoint.ranks_per_node``) and a folder per rank in that. The checks here run before training, so a
tmpfs too small fails at once rather than at the first snapshot.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from moc_lightning.config import CheckpointConfig
from moc_lightning.memory.snapshot import NUM_SLOTS, SnapshotStore
from moc_lightning.memory.two_level import node_root
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.replay.memory import WindowMemory
from moc_lightning.replay.window_store import WINDOW_SUFFIX


def slot_root(config: CheckpointConfig, rank: int) -> Path:
    """Rank ``rank``'s folder in its node's folder of this run (the run: one per storage URL)."""
    run_id = hashlib.sha1(config.storage.url.encode()).hexdigest()[:12]
    return node_root(config.shm_root, run_id, rank, config.ranks_per_node) / f"rank{rank}"


def check_shm_root(config: CheckpointConfig, pec: PECCheckpointer, node_root: Path) -> None:
    """Fail before training when the shared-memory root is missing or cannot hold this node's slots.

    Every rank of the node keeps ``NUM_SLOTS`` slots there, each sized by
    :meth:`PECCheckpointer.snapshot_share_bytes` (with the optimizer state a step creates, when the
    optimizer has none yet), one of them for every expert with ``complete_first_persist`` (the slot of the
    complete first snapshot keeps its size). Slots this run already has on the node (``node_root``, every
    local rank's, from before a restart) are reused, so they count as free: a restart of a job that fitted fits.
    """
    per_slot = pec.snapshot_share_bytes(with_optimizer_state=True)
    complete = config.complete_first_persist
    first_slot = pec.snapshot_share_bytes(with_optimizer_state=True, complete=True) if complete else per_slot
    local_ranks = _local_ranks(config)
    needed = int(((NUM_SLOTS - 1) * per_slot + first_slot) * local_ranks)
    free = _shm_free(config, node_root)
    if free < needed:
        first = f", one of them {first_slot / 1e6:.1f} MB for the complete first snapshot" if complete else ""
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} has {free / 1e6:.1f} MB free, but the snapshot slots need "
            f"about {needed / 1e6:.1f} MB ({NUM_SLOTS} slots x {local_ranks} ranks x {per_slot / 1e6:.1f} MB at "
            f"k_snapshot={pec.dynamic_k.k_snapshot}{first}); use a larger tmpfs, a smaller checkpoint.k_snapshot"
            + (", or checkpoint.complete_first_persist=false" if complete else "")
        )


def check_window_memory(config: CheckpointConfig, memory: WindowMemory, node_root: Path) -> None:
    """``mode=replay``: fail before training when the shared-memory root cannot hold the window copies of this
    node's ranks (:mod:`moc_lightning.replay.memory`), counted as :func:`check_shm_root` counts PEC's slots."""
    local_ranks = _local_ranks(config)
    needed = memory.in_shared_memory * local_ranks
    free = _shm_free(config, node_root)
    if free < needed:
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} has {free / 1e6:.1f} MB free, but the replay windows need about "
            f"{needed / 1e6:.1f} MB ({memory.slots} window slots x {local_ranks} ranks x "
            f"{memory.window_bytes / 1e6:.1f} MB a window at checkpoint.replay.window={memory.window}, up to "
            f"{max(memory.per_iteration) / 1e6:.1f} MB per iteration); use a larger tmpfs, a smaller "
            "checkpoint.replay.window (a window holds every unit's full state once plus the weights of the units "
            "still frozen), or checkpoint.mode=pec"
        )


def remove_slots(config: CheckpointConfig, store: SnapshotStore, rank: int) -> None:
    """A finished run's slots are of no further use (its last step is persisted): free the shared memory.

    Every rank removes its own slots (``store``'s), then (after all have) the node's folder of this run, which may
    hold slots of ranks an earlier world size had.
    """
    store.remove()
    if dist.is_initialized():
        dist.barrier()
    node = slot_root(config, rank).parent
    shutil.rmtree(node, ignore_errors=True)
    with contextlib.suppress(OSError):
        node.parent.rmdir()  # the run's folder, once no node of it is left on this machine


def _local_ranks(config: CheckpointConfig) -> int:
    """Ranks sharing this node's shared-memory root."""
    return config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _shm_free(config: CheckpointConfig, node_root: Path) -> int:
    """Bytes available under the shared-memory root, counting this run's existing slots on the node as free (they
    are reused: a restart of a job that fitted fits); refuses a root that cannot be created."""
    root = Path(config.shm_root)
    if not root.parent.is_dir():
        raise ValueError(
            f"checkpoint.shm_root={config.shm_root} cannot be created: {root.parent} does not exist; "
            "point it at a node-local tmpfs such as /dev/shm/moc_lightning"
        )
    return shutil.disk_usage(root if root.exists() else root.parent).free + _already_used(node_root)


def _already_used(node_root: Path) -> int:
    """Bytes this run's existing slots and replay windows on this node occupy (they are reused, so they count as
    available)."""
    if not node_root.exists():
        return 0
    return sum(p.stat().st_size for p in node_root.rglob("*") if p.name == "data" or p.name.endswith(WINDOW_SUFFIX))
