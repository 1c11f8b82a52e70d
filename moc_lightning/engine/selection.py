"""Selection: which experts of every MoE layer a checkpoint takes at each level.

A checkpoint snapshots ``k_snapshot`` experts per MoE layer and, when it also persists, writes
``k_persist`` of those to storage. Policies sit behind the small ``SelectionPolicy`` protocol and keep
their cursor in a small serialisable dict, so rotation continues across restarts.

Sequential selection (paper section 3.2, Figure 4). Experts of a layer are walked in *rank-interleaved*
order: position ``j`` is local expert ``j // D`` of EP rank ``j % D`` (D = EP degree), so a window of
consecutive positions visits EP ranks round robin. Each layer has two cursors into that order:

- the persist cursor takes the next ``k_persist`` positions at every persist. Persists therefore cover all
  N experts of a layer within ``ceil(N / k_persist)`` persists, whichever checkpoints persist.
- the snapshot cursor fills the rest of the snapshot with the next positions not already persisted in this
  checkpoint, and advances by the number it was asked for. Without persists it covers all experts within
  ``ceil(N / k_snapshot)`` checkpoints; with persists within ``ceil(N / (k_snapshot - k_persist))``
  (the persisted ones are snapshotted too). ``ceil(N / K)`` at both levels at once is impossible in
  general, even with a persist at every checkpoint: for N=10, k_snapshot=3, k_persist=2 no nested
  schedule persists every expert within 5 persists and snapshots it within 4 checkpoints. Durability wins.

Layer ``i`` starts ``i * k`` positions after layer 0, so the windows of consecutive layers continue each
other round robin over EP ranks: the experts a level saves differ by at most one between EP ranks (for a
snapshot that also persists, that holds for its persisted part; the rest is best effort). When K changes
(Dynamic-K), cursors step *back* to restore that spacing: a few experts are saved again, none is skipped.

Load-aware selection saves the experts with the most tokens not yet saved at each level (ties rotate).

A lineage's first persist takes every expert (:func:`every_expert`, ``checkpoint.complete_first_persist``);
the engine asks the policy all the same, so the rotation advances as if that checkpoint had been a PEC one
and the schedule from the second checkpoint on is plain PEC's (see :meth:`ExpertSelector.select`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moc_lightning.engine.ledger import check_k
from moc_lightning.engine.units import ExpertUnit


@dataclass(frozen=True)
class Selection:
    """Global expert ids per MoE layer (by ordinal), sorted; ``persist[i]`` is a subset of ``snapshot[i]``."""

    snapshot: tuple[tuple[int, ...], ...]
    persist: tuple[tuple[int, ...], ...]

    def snapshot_units(self) -> frozenset[ExpertUnit]:
        return _units(self.snapshot)

    def persist_units(self) -> frozenset[ExpertUnit]:
        return _units(self.persist)


def every_expert(num_experts: Sequence[int]) -> Selection:
    """A checkpoint that snapshots and persists every expert of every MoE layer (a complete one, eq. 5)."""
    every = tuple(tuple(range(n)) for n in num_experts)
    return Selection(snapshot=every, persist=every)


def _units(per_layer: Sequence[Sequence[int]]) -> frozenset[ExpertUnit]:
    return frozenset(ExpertUnit(layer, e) for layer, ids in enumerate(per_layer) for e in ids)


@dataclass(frozen=True)
class UnsavedTokens:
    """Per MoE layer, tokens each expert processed since it was last saved at each level (``[N]`` int64)."""

    snapshot: tuple[torch.Tensor, ...]
    persist: tuple[torch.Tensor, ...]


class SelectionPolicy(Protocol):
    """What the checkpoint engine needs from a policy."""

    def select(
        self,
        checkpoint_index: int,
        k_snapshot: int,
        k_persist: int,
        *,
        persist: bool = True,
        unsaved: UnsavedTokens | None = None,
    ) -> Selection:
        """Experts to save at checkpoint ``checkpoint_index``; ``persist=False`` when it is snapshot only.

        ``unsaved`` feeds policies that rank by tokens (load-aware); sequential ignores it.
        """
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def rank_interleaved(num_experts: int, ep_degree: int) -> tuple[int, ...]:
    """Expert at each position: position ``j`` is local expert ``j // D`` of EP rank ``j % D``.

    EP rank ``p`` holds experts ``[p * N/D, (p+1) * N/D)``.
    """
    per_rank = num_experts // ep_degree
    return tuple((j % ep_degree) * per_rank + j // ep_degree for j in range(num_experts))


def _realign(cursors: Sequence[int], k: int, ep_degree: int) -> list[int]:
    """Step each layer's cursor back (never forward) so layer ``i`` sits ``i * k`` positions after layer 0."""
    return [c - (c - cursors[0] - i * k) % ep_degree for i, c in enumerate(cursors)]


class SequentialSelection:
    """Sequential, interleaved across MoE layers and EP ranks (see module docstring)."""

    def __init__(self, num_experts: Sequence[int], ep_degree: int = 1) -> None:
        bad = [n for n in num_experts if n % ep_degree]
        if ep_degree < 1 or bad:
            raise ValueError(
                f"ep_degree must be >= 1 and divide the experts of every MoE layer, got ep_degree={ep_degree} "
                f"for num_experts={list(num_experts)}"
            )
        self.num_experts = tuple(num_experts)
        self.ep_degree = ep_degree
        self._order = tuple(rank_interleaved(n, ep_degree) for n in self.num_experts)
        self._state: dict[str, Any] = {
            "last_index": -1,
            "snapshot": {"k": None, "cursors": [0] * len(self.num_experts)},
            "persist": {"k": None, "cursors": [0] * len(self.num_experts)},
        }

    def select(
        self,
        checkpoint_index: int,
        k_snapshot: int,
        k_persist: int,
        *,
        persist: bool = True,
        unsaved: UnsavedTokens | None = None,
    ) -> Selection:
        check_k(k_snapshot, k_persist, min(self.num_experts))
        _check_index(checkpoint_index, self._state["last_index"])
        if persist:
            persisted = [set(ids) for ids in self._take("persist", k_persist, k_persist, _nothing)]
            extra = k_snapshot - k_persist
        else:
            persisted = [set() for _ in self.num_experts]
            extra = k_snapshot
        extras = self._take("snapshot", k_snapshot, extra, lambda layer, e: e in persisted[layer])
        self._state["last_index"] = checkpoint_index
        return Selection(
            snapshot=tuple(tuple(sorted(p | set(x))) for p, x in zip(persisted, extras)),
            persist=tuple(tuple(sorted(p)) for p in persisted),
        )

    def _take(self, level: str, k: int, count: int, skip: Callable[[int, int], bool]) -> list[list[int]]:
        """Next ``count`` experts per layer from the level's cursors, passing over ``skip``ped ones.

        The cursors advance by ``count`` whatever was passed over, so all layers keep their spacing;
        passed-over experts come again next time.
        """
        state = self._state[level]
        if state["k"] is None:
            state["cursors"] = [i * k for i in range(len(self.num_experts))]
        elif state["k"] != k:
            state["cursors"] = _realign(state["cursors"], k, self.ep_degree)
        state["k"] = k
        out = []
        for i, (order, cursor) in enumerate(zip(self._order, state["cursors"])):
            walk = (order[(cursor + j) % len(order)] for j in range(len(order)))
            out.append([e for e in walk if not skip(i, e)][:count])
            state["cursors"][i] = (cursor + count) % len(order)
        return out

    def state_dict(self) -> dict[str, Any]:
        return _copy_state(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        layers = {len(state[level]["cursors"]) for level in ("snapshot", "persist")}
        if layers != {len(self.num_experts)}:
            raise ValueError(
                f"selection state has cursors for {sorted(layers)} MoE layers, the model has {len(self.num_experts)}"
            )
        self._state = _copy_state(state)


def _copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "last_index": int(state["last_index"]),
        **{
            level: {"k": state[level]["k"], "cursors": list(state[level]["cursors"])}
            for level in ("snapshot", "persist")
        },
    }


def _nothing(layer: int, expert_id: int) -> bool:
    return False


def _check_index(checkpoint_index: int, last_index: int) -> None:
    """Selecting twice for one checkpoint would advance the rotation twice and skip experts."""
    if checkpoint_index <= last_index:
        raise ValueError(f"checkpoint_index must increase, got {checkpoint_index} after {last_index}")


class LoadAwareSelection:
    """Experts with the most tokens not yet saved at each level first; ties rotate with the checkpoint.

    The persisted experts are the ones most behind in storage; the rest of the snapshot the ones most
    behind in memory. No coverage bound: an expert that receives no tokens loses none.
    """

    def __init__(self, num_experts: Sequence[int]) -> None:
        self.num_experts = tuple(num_experts)
        self._last_index = -1

    def select(
        self,
        checkpoint_index: int,
        k_snapshot: int,
        k_persist: int,
        *,
        persist: bool = True,
        unsaved: UnsavedTokens | None = None,
    ) -> Selection:
        check_k(k_snapshot, k_persist, min(self.num_experts))
        if unsaved is None:
            raise ValueError(
                "selection policy 'load_aware' needs unsaved token counts: pass unsaved=UnsavedTokens(...)"
            )
        _check_index(checkpoint_index, self._last_index)
        rotation = checkpoint_index * k_snapshot
        snapshot, persisted = [], []
        for layer in range(len(self.num_experts)):
            p = set(_most_unsaved(unsaved.persist[layer], set(), k_persist, rotation)) if persist else set()
            extra = _most_unsaved(unsaved.snapshot[layer], p, k_snapshot - len(p), rotation)
            snapshot.append(tuple(sorted(p | set(extra))))
            persisted.append(tuple(sorted(p)))
        self._last_index = checkpoint_index
        return Selection(snapshot=tuple(snapshot), persist=tuple(persisted))

    def state_dict(self) -> dict[str, Any]:
        return {"last_index": self._last_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._last_index = int(state["last_index"])


def _most_unsaved(counts: torch.Tensor, exclude: set[int], count: int, rotation: int) -> list[int]:
    """The ``count`` experts not in ``exclude`` with most unsaved tokens; ties go to the rotating order."""
    n = len(counts)
    candidates = [e for e in range(n) if e not in exclude]
    return sorted(candidates, key=lambda e: (-int(counts[e]), (e - rotation) % n))[:count]


POLICIES: tuple[str, ...] = ("sequential", "load_aware")


def make_policy(name: str, num_experts: Sequence[int], ep_degree: int = 1) -> SelectionPolicy:
    """The policy called ``name`` for MoE layers with ``num_experts`` experts each."""
    if name == "sequential":
        return SequentialSelection(num_experts, ep_degree)
    if name == "load_aware":
        return LoadAwareSelection(num_experts)
    raise ValueError(f"unknown selection policy {name!r}; allowed: {list(POLICIES)}")
