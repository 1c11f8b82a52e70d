import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moc_lightning.engine.selection import (
    LoadAwareSelection,
    Selection,
    SequentialSelection,
    UnsavedTokens,
    make_policy,
    rank_interleaved,
)
from moc_lightning.engine.units import expert


@st.composite
def setups(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """(N, EP degree, MoE layers, k_snapshot, k_persist)."""
    ep = draw(st.integers(1, 4))
    n = ep * draw(st.integers(1, 4))
    k_snapshot = draw(st.integers(1, n))
    return n, ep, draw(st.integers(1, 5)), k_snapshot, draw(st.integers(1, k_snapshot))


def run(policy: SequentialSelection, k_snapshot: int, k_persist: int, schedule: Sequence[bool]) -> list[Selection]:
    return [policy.select(c, k_snapshot, k_persist, persist=p) for c, p in enumerate(schedule)]


def spread(per_layer: Sequence[Sequence[int]], n: int, ep: int) -> int:
    """Max minus min number of experts saved per EP rank, over all MoE layers."""
    counts = [0] * ep
    for ids in per_layer:
        for e in ids:
            counts[e // (n // ep)] += 1
    return max(counts) - min(counts)


def assert_covers(saved: Sequence[Sequence[Sequence[int]]], n: int, window: int) -> None:
    """Every ``window`` consecutive entries of ``saved`` (per entry: per layer ids) save every expert of every layer."""
    for start in range(len(saved) - window + 1):
        for layer in range(len(saved[0])):
            covered = {e for entry in saved[start : start + window] for e in entry[layer]}
            assert covered == set(range(n)), (start, layer, sorted(covered))


def test_figure_4() -> None:
    policy = SequentialSelection([3] * 4, ep_degree=3)
    first, second = run(policy, 1, 1, [False, False])
    assert first.snapshot == ((0,), (1,), (2,), (0,))
    assert second.snapshot == ((1,), (2,), (0,), (1,))


def test_rank_interleaved_order_alternates_ranks() -> None:
    assert rank_interleaved(6, 3) == (0, 2, 4, 1, 3, 5)
    assert rank_interleaved(4, 1) == (0, 1, 2, 3)


@settings(max_examples=60, deadline=None)
@given(setup=setups(), schedule=st.lists(st.booleans(), min_size=1, max_size=40))
def test_sequential_nesting_sizes_balance_and_coverage(
    setup: tuple[int, int, int, int, int], schedule: list[bool]
) -> None:
    n, ep, layers, k_s, k_p = setup
    selections = run(SequentialSelection([n] * layers, ep), k_s, k_p, schedule)
    for sel, persisted in zip(selections, schedule):
        for snap, pers in zip(sel.snapshot, sel.persist):
            assert len(snap) == k_s and len(set(snap)) == k_s
            assert len(pers) == (k_p if persisted else 0)
            assert set(pers) <= set(snap)
        assert sel.persist_units() <= sel.snapshot_units()
        assert spread(sel.persist, n, ep) <= 1
        if not persisted:
            assert spread(sel.snapshot, n, ep) <= 1
    assert_covers([s.persist for s, p in zip(selections, schedule) if p], n, math.ceil(n / k_p))
    if k_s > k_p:
        assert_covers([s.snapshot for s in selections], n, math.ceil(n / (k_s - k_p)))


@settings(max_examples=40, deadline=None)
@given(setup=setups(), persist_every_time=st.booleans())
def test_sequential_snapshot_covers_every_ceil_n_over_k_without_persist_or_with_equal_k(
    setup: tuple[int, int, int, int, int], persist_every_time: bool
) -> None:
    n, ep, layers, k_s, _ = setup
    k_p = k_s if persist_every_time else 1
    selections = run(SequentialSelection([n] * layers, ep), k_s, k_p, [persist_every_time] * 3 * n)
    assert_covers([s.snapshot for s in selections], n, math.ceil(n / k_s))


@settings(max_examples=40, deadline=None)
@given(setup=setups(), k_new=st.integers(1, 16), before=st.integers(1, 6))
def test_sequential_k_change_skips_nothing_and_rebalances(
    setup: tuple[int, int, int, int, int], k_new: int, before: int
) -> None:
    n, ep, layers, k_old, _ = setup
    k_new = min(k_new, n)
    policy = SequentialSelection([n] * layers, ep)
    selections = run(policy, k_old, 1, [False] * before)
    selections += [policy.select(before + c, k_new, 1, persist=False) for c in range(3 * n)]
    assert all(spread(s.snapshot, n, ep) <= 1 for s in selections[before:])
    assert_covers([s.snapshot for s in selections], n, math.ceil((n + ep - 1) / min(k_old, k_new)))


def test_state_dict_resumes_the_rotation() -> None:
    policy = SequentialSelection([8, 8, 8], ep_degree=2)
    run(policy, 3, 2, [True, False, True])
    state = policy.state_dict()
    expected = [policy.select(c, 3, 2, persist=p) for c, p in [(3, True), (4, False), (5, True)]]
    restored = SequentialSelection([8, 8, 8], ep_degree=2)
    restored.load_state_dict(state)
    assert [restored.select(c, 3, 2, persist=p) for c, p in [(3, True), (4, False), (5, True)]] == expected
    assert restored.state_dict() == policy.state_dict()
    assert all(isinstance(c, int) for level in ("snapshot", "persist") for c in state[level]["cursors"])


def test_checkpoint_index_must_increase() -> None:
    policy = SequentialSelection([4])
    policy.select(5, 1, 1)
    with pytest.raises(ValueError, match="checkpoint_index must increase, got 5 after 5"):
        policy.select(5, 1, 1)


def test_invalid_arguments_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"k_snapshot must be in \[1, 4\]"):
        SequentialSelection([4, 8]).select(0, 5, 1)
    with pytest.raises(ValueError, match=r"k_persist must be in \[1, k_snapshot=2\], got 3"):
        SequentialSelection([4]).select(0, 2, 3)
    with pytest.raises(ValueError, match="ep_degree must be >= 1 and divide"):
        SequentialSelection([6], ep_degree=4)
    with pytest.raises(ValueError, match=r"unknown selection policy 'random'; allowed: \['sequential', 'load_aware'\]"):
        make_policy("random", [4])


def unsaved(snapshot: Sequence[Sequence[int]], persist: Sequence[Sequence[int]]) -> UnsavedTokens:
    return UnsavedTokens(tuple(torch.tensor(s) for s in snapshot), tuple(torch.tensor(p) for p in persist))


def test_load_aware_saves_most_unsaved_tokens_first_at_each_level() -> None:
    policy = make_policy("load_aware", [4, 4])
    assert isinstance(policy, LoadAwareSelection)
    counts = unsaved(snapshot=[[5, 9, 1, 7], [0, 0, 3, 0]], persist=[[50, 1, 2, 3], [1, 2, 3, 4]])
    sel = policy.select(0, 3, 1, unsaved=counts)
    assert sel.persist == ((0,), (3,))
    assert sel.snapshot == ((0, 1, 3), (0, 2, 3))  # layer 1: persisted 3, most unsaved 2, then 0 wins a tie
    snap_only = policy.select(1, 2, 1, persist=False, unsaved=counts)
    assert snap_only.persist == ((), ()) and snap_only.snapshot[0] == (1, 3)


def test_load_aware_ties_rotate_and_counts_are_required() -> None:
    policy = LoadAwareSelection([4])
    zeros = unsaved([[0, 0, 0, 0]], [[0, 0, 0, 0]])
    seen = {e for c in range(4) for e in policy.select(c, 1, 1, unsaved=zeros).snapshot[0]}
    assert seen == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="needs unsaved token counts"):
        policy.select(9, 1, 1)
    policy.load_state_dict({"last_index": 20})
    assert policy.state_dict() == {"last_index": 20}


def test_selection_units() -> None:
    sel = Selection(snapshot=((0, 2), (1,)), persist=((2,), ()))
    assert sel.snapshot_units() == {expert(0, 0), expert(0, 2), expert(1, 1)}
    assert sel.persist_units() == {expert(0, 2)}
