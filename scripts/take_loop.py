"""The training thread's work to prepare a K=1 snapshot of ``small_16e``, timed in a hot loop, one process.

What each step of :meth:`~moc_lightning.memory.snapshotting.SnapshotTaker.take` besides the copy costs when the
interpreter's caches are warm: the floor that the bench's stall phases (``docs/performance.md``, issue 30 item 3) are
compared with. Run: ``.venv/bin/python scripts/take_loop.py``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.storage import make_storage

CALLS = 500
SMALL_16E = Path(__file__).resolve().parents[1] / "conf" / "model" / "small_16e.yaml"
"""The quick bench's model."""


def per_call_us(what: str, call: Callable[[], Any]) -> None:
    call()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    print(f"{what:40s} {(time.perf_counter() - start) / CALLS * 1e6:8.1f} us")


def main() -> None:
    cfg = GPTMoEConfig(**OmegaConf.to_container(OmegaConf.load(SMALL_16E)))  # type: ignore[arg-type]
    model = GPTMoE(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1))
    _, loss, aux = model(batch[:, :-1], batch[:, 1:])
    (loss + aux).backward()
    optimizer.step()  # the optimizer state exists, as at any snapshot
    root = Path(tempfile.mkdtemp())
    config = CheckpointConfig(k_snapshot=1, k_persist=1, storage=StorageConfig(url=(root / "ckpt").as_uri()))
    layout = build_layout(model, optimizer, num_experts=cfg.num_experts)
    pec = PECCheckpointer(config, layout, ExpertParallelTopology(), make_storage("filesystem", config.storage.url))
    engine = TwoLevelCheckpointer(pec, SnapshotStore(root / "shm"))
    taker = engine.snapshots
    index = iter(range(1, 10**6))
    selection = pec.selector.select(0, False, None)
    units = layout.dense_units + tuple(sorted(selection.snapshot_units()))
    parts = pec.plan.partial_parts(units)
    owners = taker._owners(units, parts)
    mine = [u for u in units if owners[u.key] == 0]
    print(f"{len(mine)} units, {len(layout.pieces(mine))} tensors; mean of {CALLS} calls")
    per_call_us("the views (Layout.pieces)", lambda: layout.pieces(mine))
    per_call_us("the selection", lambda: pec.selector.select(next(index), False, None))
    per_call_us("the owners (cached per unit set)", lambda: taker._owners(units, parts))
    per_call_us("this rank's units", lambda: [u for u in units if owners[u.key] == 0])
    per_call_us("the slot's choice", lambda: engine.store.choose_slot(engine.persists.slots_in_use()))
    per_call_us("the router counts' all-reduce, started", lambda: pec.tokens.start_mark(1, None))
    engine.finish()
    engine.store.remove()


if __name__ == "__main__":
    main()
