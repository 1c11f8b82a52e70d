"""The ranks' agreement on a replay window to resume from (:mod:`moc_lightning.replay.window_store`): as pure functions
the newest window every rank has, memory's copy on a tie, a re-store where only memory holds it, and why each rank
keeps three storage objects (with two, a fast and a slow storage can leave no window in common); on real windows,
that a resume deserializes one window only, and that a re-store failing on one rank fails on every rank."""

from __future__ import annotations

import _pickle
import errno
import pickle
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.utilities.migration import pl_legacy_patch
from storage_faults import FaultyStorage

from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.units import dense
from moc_lightning.replay.core import WindowRecord
from moc_lightning.replay.driver import WindowLog
from moc_lightning.replay.window_store import (
    STORAGE_COPIES,
    Candidate,
    WindowHead,
    WindowStore,
    agree,
    memory_head,
    pick,
    window_object,
)
from moc_lightning.storage import make_storage
from moc_lightning.storage.sealed import checksum

W = 3


def _candidate(window: int, source: str) -> Candidate:
    place: Any = SimpleNamespace(source=source)  # pick reads the end step and the source only
    return Candidate(place, WindowHead(None, window * W, W, 0, None))


def _landed(windows: range, copies: int) -> set[int]:
    """Windows in a rank's storage after writing ``windows`` in turn into objects alternating by index."""
    objects: dict[int, int] = {}
    for index in windows:
        objects[index % copies] = index
    return set(objects.values())


def test_window_objects_alternate_over_three_per_rank() -> None:
    names = [window_object(1, index) for index in range(7)]
    assert len(set(names)) == STORAGE_COPIES == 3
    assert names[0] == names[3] == names[6] == "replay_window.rank1.0.win"
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


LINEAGE = Lineage("run-14", "fingerprint")


LIKE = torch.empty(64)


def _capture(store: WindowStore, window: int) -> WindowLog:
    """Window number ``window`` of a one-unit model, captured into its slot of ``store``: a few logged weights per
    offset."""
    slot = store.open_slot(window)
    record = WindowRecord({dense("head"): 0}, W, slot)
    for t in range(W):
        record.logged.append({"head.weight": slot.buffer((t, "head.weight"), LIKE).fill_(float(window * W + t))})
    return WindowLog(record, start_step=window * W)


def _store(root: Path, rank: int = 0, storage: Any = None, persist_every: int = 1) -> WindowStore:
    storage = storage or make_storage("filesystem", (root / "ckpt").as_uri())
    return WindowStore(storage, root / "shm" / f"rank{rank}", rank, persist_every)


def _hand_over(store: WindowStore, windows: range) -> None:
    for window in windows:
        store.hand_over(_capture(store, window), LINEAGE)
    store.flush()


def _lose_memory(store: WindowStore) -> None:
    """The node's shared memory is lost: every slot and its head."""
    for slot in store.slots:
        for path in (slot.path, memory_head(slot.path)):
            path.unlink(missing_ok=True)


class CountedLoads:
    """Counts the windows deserialized (:meth:`WindowLog.from_bytes`, or :meth:`WindowLog.from_file` mapping a
    local copy)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loads = 0
        for name in ("from_bytes", "from_file"):
            load = getattr(WindowLog, name)

            def counted(source: Any, load: Any = load) -> Any:
                self.loads += 1
                return load(source)

            monkeypatch.setattr(WindowLog, name, staticmethod(counted))


def test_a_resume_among_several_candidates_deserializes_one_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory holds windows 2 and 3, storage windows 1 to 3: the listing reads what identifies each, and only the
    chosen window (memory's copy of window 3) is opened."""
    _hand_over(_store(tmp_path), range(4))
    counted = CountedLoads(monkeypatch)
    store = _store(tmp_path)
    candidates = store.candidates(LINEAGE)
    print(f"candidates: {[(c.end_step, c.source) for c in candidates]}")
    assert sorted((c.end_step, c.source) for c in candidates) == [
        (2 * W, "storage"), (3 * W, "memory"), (3 * W, "storage"), (4 * W, "memory"), (4 * W, "storage")
    ]
    found = store.restore(LINEAGE)
    assert found is not None and (found.end_step, found.source) == (4 * W, "memory")
    assert found.log.end_step == 4 * W and torch.equal(found.log.record.logged[0]["head.weight"], torch.full((64,), 9.0))
    assert counted.loads == 1


def test_a_window_is_read_by_the_c_unpickler_whatever_pickle_unpickler_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning loads a ``ckpt_path`` (where a replay resume opens its window) with ``pickle.Unpickler`` swapped for
    a pure-Python one (``pl_legacy_patch``), which read a window's tail 2-4x slower (7-11 ms of a 120 ms restore
    from memory at the quick bench); the window is read by C's unpickler whatever is in force."""
    with pl_legacy_patch():
        assert pickle.Unpickler is not _pickle.Unpickler, "Lightning's patch swaps the unpickler"
    _hand_over(_store(tmp_path), range(1))

    class PurePython(pickle._Unpickler):  # type: ignore[name-defined]
        def load(self) -> Any:
            raise AssertionError("the window's tail was read by the pure-Python unpickler in force")

    monkeypatch.setattr(pickle, "Unpickler", PurePython)
    found = _store(tmp_path).restore(LINEAGE)
    assert found is not None and torch.equal(found.log.record.logged[1]["head.weight"], torch.full((64,), 1.0))


def test_a_window_is_its_slot_in_memory_and_storage_gets_a_copy_of_that_file(tmp_path: Path) -> None:
    """The captures copy into the slot's file in shared memory, the hand-over only seals it (its tail), and storage
    gets a copy of that file: the same bytes, the storage head naming their length and CRC32C, the memory head their
    length (a slot is trusted by its length, as a snapshot slot by its commit)."""
    store = _store(tmp_path)
    _hand_over(store, range(1))
    data = store.slots[0].path.read_bytes()
    assert (tmp_path / "ckpt" / window_object(0, 0)).read_bytes() == data
    heads = {c.source: c.head for c in store.candidates(LINEAGE)}
    print(f"{len(data)} bytes, CRC32C {checksum(data):08x}; heads {heads}")
    assert heads.keys() == {"memory", "storage"}
    assert (heads["memory"].length, heads["memory"].crc) == (len(data), None)
    assert (heads["storage"].length, heads["storage"].crc) == (len(data), checksum(data))
    assert data[: W * LIKE.nbytes] == torch.arange(W).float().repeat_interleave(64).numpy().tobytes(), (
        "the logged weights lie at the start of the file, where the captures wrote them"
    )
    found = _store(tmp_path).restore(LINEAGE)
    assert found is not None and torch.equal(found.log.record.logged[2]["head.weight"], torch.full((64,), 2.0))


def test_every_nth_window_goes_to_storage_and_a_lost_node_resumes_from_the_newest_stored(tmp_path: Path) -> None:
    """``persist_every=2``: windows 0, 2 and 4 of 0..4 reach storage (by index: the same windows on every rank), in
    three alternating objects; memory holds 3 and 4. A crash resumes from memory's 4; a lost node from storage's 4,
    then (that one gone too) storage's 2."""
    store = _store(tmp_path, persist_every=2)
    _hand_over(store, range(5))
    ends = sorted((c.end_step, c.source) for c in store.candidates(LINEAGE))
    print(f"candidates: {ends}")
    assert ends == [(W, "storage"), (3 * W, "storage"), (4 * W, "memory"), (5 * W, "memory"), (5 * W, "storage")]
    assert [window_object(0, n) for n in (0, 1, 2)] == sorted(p.name for p in (tmp_path / "ckpt").glob("*.win"))
    found = _store(tmp_path, persist_every=2).restore(LINEAGE)
    assert found is not None and (found.end_step, found.source) == (5 * W, "memory")
    _lose_memory(store)
    found = _store(tmp_path, persist_every=2).restore(LINEAGE)
    assert found is not None and (found.end_step, found.source) == (5 * W, "storage")
    (tmp_path / "ckpt" / window_object(0, 2)).unlink()
    found = _store(tmp_path, persist_every=2).restore(LINEAGE)
    assert found is not None and (found.end_step, found.source) == (3 * W, "storage")
    assert torch.equal(found.log.record.logged[1]["head.weight"], torch.full((64,), float(2 * W + 1)))


def test_a_window_in_a_remote_storage_is_read_whole_and_resumed_from(tmp_path: Path) -> None:
    """Storage that is no local directory (a kvstore, here ``memory://``) gets the window's bytes read from the file
    in shared memory, and a lost node resumes from them (read whole, not mapped)."""
    storage = make_storage("tensorstore", "memory://ckpt")
    store = _store(tmp_path, storage=storage)
    _hand_over(store, range(2))
    _lose_memory(store)
    found = _store(tmp_path, storage=storage).restore(LINEAGE)
    assert found is not None and (found.end_step, found.source) == (2 * W, "storage")
    assert torch.equal(found.log.record.logged[0]["head.weight"], torch.full((64,), float(W)))


@pytest.mark.parametrize(
    ("damaged", "resumed"), [("memory", (2 * W, "storage")), ("storage", (W, "storage"))], ids=["memory", "storage"]
)
def test_a_damaged_window_behind_a_valid_header_is_skipped_with_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], damaged: str,
    resumed: tuple[int, str],
) -> None:
    """A copy damaged after its head was written fails its check before it is opened, is skipped with one line, and
    the resume takes the next copy: memory's copy of window 1, torn (its length is checked), gives way to storage's
    copy of the same window; storage's copy of window 1 with a flipped bit (its CRC32C is checked;
    memory's copy gone, as on a lost node) gives way to storage's window 0."""
    store = _store(tmp_path)
    _hand_over(store, range(2))
    if damaged == "memory":
        memory = store.slots[1].path
        memory.write_bytes(memory.read_bytes()[:-1])
    else:
        _lose_memory(store)
        stored = tmp_path / "ckpt" / window_object(0, 1)
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0x01
        stored.write_bytes(bytes(data))
    counted = CountedLoads(monkeypatch)
    found = _store(tmp_path).restore(LINEAGE)
    out = capsys.readouterr().out
    print(out)
    assert found is not None and (found.end_step, found.source) == resumed
    assert f"skipping the replay window in {damaged}" in out and "do not match the head" in out
    assert counted.loads == 1, "the damaged copy failed its check before it was deserialized"


def _restore_with_rank1_storage_full(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Both ranks hold window 1 in memory only (its storage write never landed); rank 1's storage is full, so its
    re-store fails. Returns what each rank raised."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    _hand_over(_store(Path(root), rank), range(2))
    for lost in (Path(root) / "ckpt").glob(f"*rank{rank}.1.*"):
        lost.unlink()
    storage = make_storage("filesystem", (Path(root) / "ckpt").as_uri())
    if rank == 1:
        storage = FaultyStorage(storage, fail_puts={1: errno.ENOSPC})
    try:
        _store(Path(root), rank, storage).restore(LINEAGE)
    except Exception as err:  # what the test checks, on every rank
        return {"error": f"{type(err).__name__}: {err}"}
    dist.barrier()  # the next collective of training: a rank that raised alone would leave this one waiting
    return {"error": None}


@pytest.mark.slow
def test_a_re_store_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    ranks = run_ranks(_restore_with_rank1_storage_full, 2, tmp_path, str(tmp_path), init_process_group=False)
    for rank, outcome in enumerate(ranks):
        print(f"rank {rank}: {outcome['error']}")
        error = outcome["error"]
        assert error is not None, f"rank {rank} went on to train"
        assert "rank 1" in error and window_object(1, 1) in error and "No space left on device" in error
    assert ranks[0]["error"] == ranks[1]["error"]
