"""The engines MoC runs on, built when a fit (or an evaluation given the storage URL) sets up.

From the LightningModule come the expert-parallel topology (``expert_topology``; without one every rank holds every
expert) and the layout of its units; over them a :class:`PECCheckpointer` on this run's storage, and for a fit the
:class:`TwoLevelCheckpointer` with its snapshot slots in shared memory. The order matters where it is collective:
process groups are created in the same order on every rank (the persist group with the PEC engine, then the
snapshots' agreement group with the two-level one), and a node an injected fault loses is gone before any rank takes
inventory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.layout import Layout, build_layout
from moc_lightning.engine.lineage import Lineage, fingerprint
from moc_lightning.engine.pieces import check_supported
from moc_lightning.export.hf_format import describe_model
from moc_lightning.lightning.shared_memory import slot_root
from moc_lightning.lightning.start import begin_lineage
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer, lose_node
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.runtime.expert_parallel import ExpertParallelTopology
from moc_lightning.runtime.faults import FaultInjector, FaultPlan
from moc_lightning.storage import CheckpointStorage, make_storage


def open_storage(config: CheckpointConfig) -> CheckpointStorage:
    """This run's storage (``checkpoint.storage``)."""
    storage = config.storage
    return make_storage(storage.backend, storage.url, storage.endpoint, storage.retries)


def model_topology(module: L.LightningModule) -> ExpertParallelTopology:
    """Where this rank sits among the module's experts, once its parameters are known to be ones MoC can write."""
    check_supported(dict(module.named_parameters()), type(module).__name__)
    return getattr(module, "expert_topology", None) or ExpertParallelTopology.replicated()


def model_layout(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer | None,
    topology: ExpertParallelTopology,
    config: CheckpointConfig,
    preset: str,
) -> Layout:
    """The module's units (with ``optimizer``'s state, when given), by the layout ``preset``."""
    return build_layout(
        module, optimizer, preset=preset, expert_parallel=topology.ep, expert_buffers=config.expert_buffers
    )


def new_pec(
    config: CheckpointConfig,
    module: L.LightningModule,
    layout: Layout,
    topology: ExpertParallelTopology,
    engine: TwoLevelCheckpointer | None,
) -> PECCheckpointer:
    """A PEC engine on this run's storage, with a process group of its own (``engine``'s, once there is one:
    creating a group is collective)."""
    storage = open_storage(config)
    if engine is not None:
        group = engine.pec.process_group
    else:
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    pec = PECCheckpointer(config, layout, topology, storage, backend=config.storage.backend, process_group=group)
    pec.model_description = describe_model(module)
    return pec


def new_engine(
    config: CheckpointConfig, pec: PECCheckpointer, device: torch.device, check_node: Callable[[Path], None]
) -> TwoLevelCheckpointer:
    """The two-level engine over ``pec``, its snapshot slots in this rank's folder of the node's shared memory.

    An injected fault that loses this rank's node acts first, and every rank waits for it; then ``check_node`` gets
    the node's folder of this run, to refuse a shared memory that cannot hold what the mode keeps there.
    """
    rank = pec.topology.rank
    faults = FaultInjector(FaultPlan.from_env(), rank)
    slots = slot_root(config, rank)
    lost = faults.faulty_rank if faults.lost_node else None
    if lost is not None and slots.parent == slot_root(config, lost).parent:
        lose_node(slots.parent)
    if dist.is_initialized():
        dist.barrier()  # a lost node is gone before anyone takes inventory (of its slots here, too)
    check_node(slots.parent)
    return TwoLevelCheckpointer(pec, SnapshotStore(slots, pin_device=device), faults)


def ensure_lineage(engine: TwoLevelCheckpointer, reason: str) -> Lineage:
    """``engine``'s lineage; unless it is in one already (a resume), a new one (collective) with empty snapshot
    slots. ``reason`` says why the run does not resume."""
    lineage = engine.lineage
    if lineage is None:
        lineage = engine.lineage = begin_lineage(engine.pec, fingerprint(engine.pec.layout), reason)
        engine.store.clear()
    return lineage
