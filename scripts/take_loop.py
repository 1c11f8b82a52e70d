"""The training thread's work to prepare a K=1 snapshot of ``small_16e``, timed hot and cold, one process.

What each step of :meth:`~moc_lightning.memory.snapshotting.SnapshotTaker.take` besides the copy costs when the
caches are warm (the same call over and over), and when they are cold: each call right after writing over twice the
last-level cache, as a training step's forward, backward and optimizer step do before a snapshot. Both are the
floors that the bench's stall phases (``docs/performance.md``, issue 30 item 3) are compared with; each line prints
the median call of each and their ratio. Run: ``.venv/bin/python scripts/take_loop.py``.
"""

from __future__ import annotations

import statistics
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
from moc_lightning.pec.tokens import TokenAccounting
from moc_lightning.sharding.ownership import forget_plans
from moc_lightning.storage import make_storage

CALLS = 200
SMALL_16E = Path(__file__).resolve().parents[1] / "conf" / "model" / "small_16e.yaml"
"""The quick bench's model."""
FALLBACK_CACHE_BYTES = 64 << 20
"""The last-level cache assumed where sysfs does not say."""


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of this CPU's highest-level cache, from sysfs; :data:`FALLBACK_CACHE_BYTES` where it is not there."""
    sizes = {}
    for index in cpu.glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sizes[max(sizes)] if sizes else FALLBACK_CACHE_BYTES


def per_call_us(what: str, call: Callable[[], Any], evict: torch.Tensor) -> None:
    """Print the median microseconds of ``call`` hot, then with the caches evicted (``evict`` written over) before
    each call, and their ratio."""
    call()
    hot, cold = [], []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        hot.append(time.perf_counter() - start)
    for _ in range(CALLS):
        evict.add_(1)
        start = time.perf_counter()
        call()
        cold.append(time.perf_counter() - start)
    hot_us, cold_us = statistics.median(hot) * 1e6, statistics.median(cold) * 1e6
    print(f"{what:40s} hot {hot_us:8.1f} us   cold {cold_us:8.1f} us   {cold_us / hot_us:5.1f}x")


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
    cache = last_level_cache_bytes()
    evict = torch.zeros(2 * cache // 4)  # float32: twice the last-level cache
    print(f"{len(mine)} units, {len(layout.pieces(mine))} tensors; median of {CALLS} calls each, hot and with "
          f"{2 * cache / 2**20:.0f} MiB written over before each (last-level cache {cache / 2**20:.0f} MiB)")
    per_call_us("the views (Layout.pieces)", lambda: layout.pieces(mine), evict)
    per_call_us("the selection", lambda: pec.selector.select(next(index), False, None), evict)
    per_call_us("the owners (cached per unit set)", lambda: taker._owners(units, parts), evict)
    planned = "the owners (planned: a new unit set)"
    per_call_us(planned, lambda: (forget_plans(), taker._plan_owners(units, parts)), evict)
    per_call_us("this rank's units", lambda: [u for u in units if owners[u.key] == 0], evict)
    per_call_us("the slot's choice", lambda: engine.store.choose_slot(engine.persists.slots_in_use()), evict)
    per_call_us("the router counts' all-reduce, started", lambda: pec.tokens.start_mark(1, None), evict)
    deep = TokenAccounting(config, [256] * 58, rank=0)  # DeepSeek-V3's MoE layers: the accounting's cost per layer
    per_call_us("a mark started, 58 x 256 experts", lambda: deep.start_mark(1, None), evict)
    per_call_us("a mark started and finished, 58 x 256", lambda: deep.finish_mark(deep.start_mark(1, None)), evict)
    engine.finish()
    engine.store.remove()


if __name__ == "__main__":
    main()
