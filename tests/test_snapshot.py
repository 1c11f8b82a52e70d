"""Snapshot slots: reused buffers, atomic commit, torn slots ignored, triple-buffer slot choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moc_lightning.snapshot import SnapshotStore


def _tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(10.0), "b": torch.ones(3, 5, dtype=torch.bfloat16), "s": torch.tensor(7, dtype=torch.int64)}


def test_write_commit_read_bitwise(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    meta = store.write(0, step=4, units=("dense/x",), tensors=_tensors(), extra={"k": 1})
    assert [m.step for m in store.committed()] == [4]
    reopened = SnapshotStore(tmp_path)  # a restarted process finds the slot
    loaded = reopened.read(reopened.committed()[0])
    for key, tensor in _tensors().items():
        assert torch.equal(loaded[key], tensor) and loaded[key].dtype == tensor.dtype
    assert reopened.committed()[0].extra == {"k": 1} and meta.units == ("dense/x",)


def test_buffer_is_reused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(0, 1, (), _tensors(), {})
    first = store._mappings[0]
    store.write(0, 2, (), _tensors(), {})
    assert store._mappings[0] is first


def test_torn_slot_is_ignored(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.write(0, 1, (), _tensors(), {})

    def crash() -> None:
        raise KeyboardInterrupt("killed in the middle of the copy")

    with pytest.raises(KeyboardInterrupt):
        store.write(1, 2, (), _tensors(), {}, midway=crash)
    assert [m.step for m in SnapshotStore(tmp_path).committed()] == [1]


def test_choose_slot_spares_busy_and_takes_oldest(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    assert store.choose_slot(busy=set()) == 0
    for slot, step in ((0, 10), (1, 20), (2, 30)):
        store.write(slot, step, (), _tensors(), {})
    assert store.choose_slot(busy=set()) == 0
    assert store.choose_slot(busy={0}) == 1
    with pytest.raises(RuntimeError, match="no snapshot slot free"):
        store.choose_slot(busy={0, 1, 2})


def test_reserve_allocates_every_slot_once(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.reserve(4096)
    mapped = dict(store._mappings)
    assert sorted(mapped) == [0, 1, 2] and all(len(m) >= 4096 for m in mapped.values())
    for slot in range(3):
        store.write(slot, slot + 1, (), _tensors(), {})
    assert all(store._mappings[slot] is mapping for slot, mapping in mapped.items())
    store.write(0, 4, (), {"big": torch.zeros(2048)}, {})  # 8 KiB: the slot grows, and still commits
    assert len(store._mappings[0]) >= 8192 and [m.step for m in store.committed()] == [2, 3, 4]
