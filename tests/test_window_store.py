"""The ranks' agreement on a replay window to resume from (:mod:`moc_lightning.window_store`) as pure functions:
the newest window every rank has, memory's copy on a tie, a re-store where only memory holds it, and why each rank
keeps three storage objects (with two, a fast and a slow storage can leave no window in common)."""

from __future__ import annotations

from typing import Any

import pytest

from moc_lightning.window_store import STORAGE_COPIES, Candidate, agree, pick, window_object

W = 3


def _candidate(window: int, source: str) -> Candidate:
    log: Any = None  # pick reads the end step and the source only
    return Candidate((window + 1) * W, source, log, 0, 0.0)


def _landed(windows: range, copies: int) -> set[int]:
    """Windows in a rank's storage after writing ``windows`` in turn into objects alternating by index."""
    objects: dict[int, int] = {}
    for index in windows:
        objects[index % copies] = index
    return set(objects.values())


def test_window_objects_alternate_over_three_per_rank() -> None:
    names = [window_object(1, index) for index in range(7)]
    assert len(set(names)) == STORAGE_COPIES == 3
    assert names[0] == names[3] == names[6] == "replay_window.rank1.0.pt"
    assert window_object(0, 4) != window_object(1, 4)


@pytest.mark.parametrize(("copies", "common"), [(3, 2), (2, None)])
def test_a_fast_and_a_slow_storage_keep_a_window_in_common_with_three_objects_only(
    copies: int, common: int | None
) -> None:
    """Rank 0 handed window 4 over and its fast storage landed it; rank 1 (a step behind) handed window 3 over, its
    slow storage has landed up to 2; rank 1's node is lost (no copy in memory)."""
    fast, slow = _landed(range(5), copies), _landed(range(3), copies)
    print(f"{copies} objects per rank: rank 0 stores windows {sorted(fast)}, rank 1 {sorted(slow)}")
    ends = [sorted((w + 1) * W for w in fast), sorted((w + 1) * W for w in slow)]
    assert agree(ends) == (None if common is None else (common + 1) * W)


def test_the_ranks_take_the_newest_window_every_rank_has() -> None:
    assert agree([[3, 6, 9], [6, 9, 12], [9, 6]]) == 9
    assert agree([[3], [6]]) is None
    assert agree([[], [6]]) is None
    assert agree([[6]]) == 6


def test_memory_is_preferred_on_a_tie_and_a_window_only_in_memory_is_re_stored() -> None:
    both = [_candidate(1, "storage"), _candidate(2, "storage"), _candidate(2, "memory")]
    chosen, restore = pick(both, 9)
    assert (chosen.end_step, chosen.source, restore) == (9, "memory", False), "storage has it already"
    only_memory = [_candidate(0, "storage"), _candidate(1, "storage"), _candidate(2, "memory")]
    chosen, restore = pick(only_memory, 9)
    assert (chosen.source, restore) == ("memory", True), "its storage write had not landed"
    chosen, restore = pick(only_memory, 6)
    assert (chosen.end_step, chosen.source, restore) == (6, "storage", False)
