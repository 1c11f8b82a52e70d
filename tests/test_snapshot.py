"""Snapshot slots: reused buffers, atomic commit, torn slots ignored, triple-buffer slot choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moc_lightning.memory.snapshot import SnapshotStore


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


def test_a_slot_reused_for_other_units_of_the_same_shapes_names_them(tmp_path: Path) -> None:
    """The sequential selection's next experts have the shapes of the last ones: the slot's layout is reused, and
    the committed entries name the new tensors, each holding its own values."""
    store = SnapshotStore(tmp_path)
    store.write(0, 1, ("expert/L0/E0",), {"e0.w": torch.zeros(4, 3), "e0.b": torch.zeros(3)}, {})
    views = store._targets[next(iter(store._targets))][1]
    new = {"e1.w": torch.arange(12.0).view(4, 3), "e1.b": torch.full((3,), 5.0)}
    meta = store.write(0, 2, ("expert/L0/E1",), new, {})
    assert len(store._targets) == 1 and store._targets[next(iter(store._targets))][1] is views  # none built again
    loaded = SnapshotStore(tmp_path).read(SnapshotStore(tmp_path).committed()[0])
    assert sorted(meta.entries) == sorted(loaded) == ["e1.b", "e1.w"]
    for key, tensor in new.items():
        assert torch.equal(loaded[key], tensor)


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


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records each call with the device current at the time."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.current: int | None = None
        self.calls: list[tuple[str, int | None]] = []

    def __getattr__(self, name: str) -> object:
        if not name.startswith("cudaHost"):
            raise AttributeError(name)

        def call(*args: int) -> int:
            self.calls.append((name, self.current))
            return self.code

        return call


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()

    class device:  # torch.cuda.device, without a CUDA build
        def __init__(self, which: torch.device) -> None:
            self.index = which.index

        def __enter__(self) -> None:
            fake.current = self.index

        def __exit__(self, *args: object) -> None:
            fake.current = None

    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", device)
    return fake


@pytest.mark.parametrize("pin_device", [None, torch.device("cpu")])
def test_cpu_training_pins_nothing(tmp_path: Path, cudart: FakeCudart, pin_device: torch.device | None) -> None:
    store = SnapshotStore(tmp_path, pin_device=pin_device)
    store.reserve(4096)
    store.write(0, 1, (), _tensors(), {})
    store.remove()
    assert cudart.calls == []


def test_slots_are_pinned_on_the_ranks_device_and_unpinned_on_remove(tmp_path: Path, cudart: FakeCudart) -> None:
    """7dbc115 pinned every slot from the copier thread, whose current device is 0, for every rank."""
    store = SnapshotStore(tmp_path, pin_device=torch.device("cuda", 3))
    store.reserve(4096)
    assert cudart.calls == [("cudaHostRegister", 3)] * 3
    store.remove()
    assert cudart.calls[3:] == [("cudaHostUnregister", 3)] * 3


def test_a_failed_pin_is_an_error_that_says_what_to_check(tmp_path: Path, cudart: FakeCudart) -> None:
    cudart.code = 2  # cudaErrorMemoryAllocation: the locked-memory limit was reached
    store = SnapshotStore(tmp_path, pin_device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"cudaHostRegister failed on cuda:0 with CUDA error 2 .*\(ulimit -l\)"):
        store.reserve(4096)

