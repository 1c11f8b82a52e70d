"""A window slot's file between windows (:class:`~moc_lightning.replay.window_file.WindowSlot`): a new window gives the file
back only the pages the last seal cut off, and regions that overrun the reservation a little map the file once more,
not once per region. Both costs fall on the training thread, in the first capture of a window."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import torch

from moc_lightning.memory import snapshot
from moc_lightning.replay.window_file import OVERRUN, WindowSlot, read_file


def _filled(slot: WindowSlot, sizes: list[int], first: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    """One float32 region per size, the ``i``-th keyed and filled with ``first + i``."""
    views = {}
    for i, n in enumerate(sizes, start=first):
        views[(0, f"t{i}")] = view = slot.buffer((0, f"t{i}"), torch.empty(n))
        view.fill_(i)
    return views


def test_a_new_window_allocates_only_the_pages_the_seal_cut_off(tmp_path: Path) -> None:
    """Fails on cd434d1: ``begin`` fallocated the whole file again (17-37 ms for 338 MB of tmpfs, every window)."""
    slot = WindowSlot(tmp_path / "rank0.win")
    slot.reserve(1 << 20)
    whole = os.path.getsize(slot.path)
    _filled(slot, [1000, 2000])
    length = slot.seal({"note": "first"})
    assert os.path.getsize(slot.path) == length < whole
    with mock.patch.object(os, "posix_fallocate", wraps=os.posix_fallocate) as fallocate:
        slot.begin()
    assert [c.args[1:] for c in fallocate.call_args_list] == [(length, whole - length)]
    assert os.path.getsize(slot.path) == whole, "the file is whole again for the next window's captures"
    views = _filled(slot, [1000, 2000])  # the next window reuses the regions
    slot.seal({"note": "second"})
    tail = read_file(slot.path)
    assert tail == {"note": "second"}
    assert all(float(v.float().mean()) == i for i, v in enumerate(views.values()))


def test_regions_that_overrun_the_reservation_remap_the_file_once(tmp_path: Path) -> None:
    """A window's regions exceed the estimate by their alignment and by state the estimate missed: the reservation's
    margin takes a small overrun without mapping the file again; past it, one remap takes the next regions too.
    Growing the mapping to each new end remapped the whole file (fallocate and populate) once per region (fails on
    cd434d1: 20 remaps)."""
    slot = WindowSlot(tmp_path / "rank0.win")
    reserved = 4 << 20
    slot.reserve(reserved)
    assert os.path.getsize(slot.path) == reserved + int(reserved * OVERRUN)
    with mock.patch("moc_lightning.replay.window_file.map_file", wraps=snapshot.map_file) as map_file:
        views = _filled(slot, [(reserved // 4) - 256] + [1000] * 8)  # the first fills it; 8 regions overrun by 0.8%
        assert map_file.call_count == 0, "within the reservation's margin"
        views |= _filled(slot, [1000] * 12, first=len(views))  # 1.15% more: past the margin
        assert map_file.call_count == 1
    for i, view in enumerate(views.values()):
        assert float(view.mean()) == i, i
