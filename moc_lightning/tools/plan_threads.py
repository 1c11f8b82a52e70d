"""Which thread plans a persist, measured on a real engine (issue 30, item 2: plans off the training thread).

One process drives the two-level engine over a small GPT-MoE as the callback does (a snapshot that is persisted in
the background, then the final persist), under ZeRO-2 or DDP, and records the thread of every write plan
(:meth:`~moc_lightning.pec.write_plan.WritePlan.persisted_state`) and of every ownership computation
(:func:`~moc_lightning.sharding.ownership.plan_ownership`, as the write plan and the snapshot's owners call it).
The scale report puts the figure beside ``plan_s``; ``tests/test_plan_cost.py`` holds the engine to it.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.memory import snapshotting
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.pec import write_plan
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.sharding.zero import ZeroAdamW, partition_by_units
from moc_lightning.storage import make_storage

MODEL = GPTMoEConfig(block_size=16, n_layer=2, n_embd=32, n_head=2, num_experts=4)
"""Small enough to persist in well under a second; its MoE layer gives the snapshot's owners experts to place."""


@dataclass(frozen=True)
class PlanCall:
    """One planning call: what planned, for which persist, and whether it ran on the training thread."""

    what: str
    """``write plan`` (a persist's :meth:`WritePlan.persisted_state`), ``ownership (write plan)`` or
    ``ownership (snapshot owners)``."""
    persist: str
    """``periodic`` (a snapshot's persist, from its slot) or ``final`` (from the live tensors at fit end)."""
    thread: str
    """The thread's name."""
    on_training_thread: bool


@contextmanager
def _recorded(calls: list[PlanCall], persist: Callable[[], str]) -> Iterator[None]:
    """Record every write plan and ownership computation, with its thread, while the body runs."""
    training = threading.get_ident()

    def recording(what: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            calls.append(PlanCall(what, persist(), thread.name, thread.ident == training))
            return function(*args, **kwargs)

        return call

    persisted_state = write_plan.WritePlan.persisted_state
    with (
        mock.patch.object(write_plan.WritePlan, "persisted_state", recording("write plan", persisted_state)),
        mock.patch.object(write_plan, "plan_ownership", recording("ownership (write plan)", write_plan.plan_ownership)),
        mock.patch.object(
            snapshotting, "plan_ownership", recording("ownership (snapshot owners)", snapshotting.plan_ownership)
        ),
    ):
        yield


def _engine(root: Path, zero: bool) -> tuple[TwoLevelCheckpointer, GPTMoE, torch.optim.Optimizer]:
    topology = ExpertParallelTopology()
    model = GPTMoE(MODEL, topology, seed=0)
    if zero:
        partition = partition_by_units(build_layout(model, None, expert_parallel=topology.ep), topology)
        optimizer: torch.optim.Optimizer = ZeroAdamW(model.parameters(), partition, lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    url = (root / "ckpt").as_uri()
    config = CheckpointConfig(
        k_snapshot=1, k_persist=1, every_n_train_steps=1, persist_every_n_snapshots=1, complete_first_persist=False,
        storage=StorageConfig(url=url), shm_root=str(root / "shm"),
    )  # fmt: skip
    layout = build_layout(model, optimizer, num_experts=MODEL.num_experts)
    pec = PECCheckpointer(config, layout, topology, make_storage("filesystem", url))
    return TwoLevelCheckpointer(pec, SnapshotStore(root / "shm")), model, optimizer


def _step(model: GPTMoE, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (4, MODEL.block_size + 1), generator=generator)
    _, loss, _ = model(tokens[:, :-1], tokens[:, 1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def plan_calls(zero: bool) -> list[PlanCall]:
    """Two steps, each snapshotted and persisted in the background, then a third and the final persist: every
    planning call."""
    calls: list[PlanCall] = []
    phase = ["periodic"]
    with tempfile.TemporaryDirectory(prefix="moc-plan-threads-") as root:
        engine, model, optimizer = _engine(Path(root), zero)
        with _recorded(calls, lambda: phase[0]):
            for step in (1, 2):
                _step(model, optimizer, step)
                engine.snapshot(step, {"step": step})
                engine.finish()  # the persist done before the next snapshot, which would skip one still running
            _step(model, optimizer, 3)
            phase[0] = "final"
            engine.persist_final(3, {"step": 3})
    return calls


def plan_threads() -> dict[str, Any]:
    """The scale report's ``plan_on_training_thread`` (a periodic persist's plan on the training thread, under
    ZeRO-2 as the report's rows are) and ``plan_thread`` (every call, under ZeRO-2 and DDP, in words)."""
    by_mode = {mode: plan_calls(zero=mode == "zero2") for mode in ("zero2", "ddp")}
    periodic = [c for c in by_mode["zero2"] if c.persist == "periodic" and c.what != "ownership (snapshot owners)"]
    if not periodic:
        raise RuntimeError("no periodic persist planned in the probe: nothing measured")

    def where(calls: list[PlanCall]) -> str:
        seen = sorted({(c.persist, c.what, "training thread" if c.on_training_thread else c.thread) for c in calls})
        return "; ".join(f"{persist} {what}: {thread}" for persist, what, thread in seen)

    return {
        "plan_on_training_thread": any(c.on_training_thread for c in periodic),
        "plan_thread": "measured in one process: " + " | ".join(f"{mode}: {where(c)}" for mode, c in by_mode.items()),
    }
