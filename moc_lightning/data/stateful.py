"""A ``DataLoader`` that resumes mid-epoch: Lightning's ``state_dict``/``load_state_dict`` protocol on the loader.

Every MoC resume point is mid-epoch. Lightning saves a stateful train loader's ``state_dict()`` in its fit
loop state (which MoC captures with every snapshot) and hands it back to ``load_state_dict`` before it
creates the epoch's iterator. The state is the epoch's position: batches yielded so far, and the state of
the loader's epoch and seed. On resume the generator is seeded as it was for that epoch, so the sampler draws
the same order (a ``RandomSampler`` shuffles with the loader's generator; Lightning's ``DistributedSampler``
shuffles from its seed and the epoch, which the fit loop restores), and the batches already seen are skipped
as indices, without loading their samples.

The order resumes exactly when it is drawn from the loader's ``generator`` or from the epoch (pass a seeded
``generator`` with ``shuffle=True`` on one device); a sampler that draws from the global RNG cannot be
replayed. Lightning rebuilds the loader with a ``DistributedSampler`` under DDP; this class survives that
(it adds no constructor arguments). With an unsized dataset Lightning prefetches one batch, so the saved
position would be one batch ahead: use a sized dataset.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader


class _Skip:
    """An index sampler whose first iteration skips its first ``skip`` items (the resumed epoch's seen batches).

    Only the first: a persistent-workers iterator iterates the same sampler object again each epoch.
    """

    def __init__(self, sampler: Iterable[Any], skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip  # type: ignore[arg-type]


class StatefulDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` plus ``state_dict``/``load_state_dict`` of its position in the epoch.

    Epoch ``e`` draws its order from the loader's ``generator`` seeded with ``seed + e`` (``seed``: the
    generator's own initial seed), so an epoch's order does not depend on how far the previous epoch's
    iterator was driven (an exhausted ``RandomSampler`` draws once more than one stopped at its last batch).
    """

    _moc_resume: dict[str, Any] | None = None
    _moc_skip_now = 0
    _moc_skipped = 0
    _moc_next_epoch = 0
    _moc_epoch = 0
    _moc_seed: int | None = None
    _moc_iterator: Any = None

    @property
    def _index_sampler(self) -> Any:  # read once by each new iterator, to draw its batches of indices
        base = super()._index_sampler
        return _Skip(base, self._moc_skip_now) if self._moc_skip_now else base

    def __iter__(self) -> Any:
        resume, self._moc_resume = self._moc_resume, None
        skip = 0
        if resume is not None:
            self._moc_next_epoch, skip = resume["epoch"], resume["batches"]
            self._moc_seed = resume["seed"] if resume["seed"] is not None else self._moc_seed
        if self.generator is not None:
            if self._moc_seed is None:
                self._moc_seed = self.generator.initial_seed()
            self.generator.manual_seed(self._moc_seed + self._moc_next_epoch)
        self._moc_epoch = self._moc_next_epoch
        self._moc_next_epoch += 1
        self._moc_skip_now = skip
        try:
            iterator = super().__iter__()
        finally:
            self._moc_skip_now = 0
        self._moc_skipped, self._moc_iterator = skip, iterator
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out; a finished epoch resumes at the start of the next."""
        iterator = self._moc_iterator
        if iterator is None:
            return {"epoch": self._moc_next_epoch, "batches": 0, "seed": self._moc_seed}
        batches = self._moc_skipped + iterator._num_yielded
        try:
            finished = batches >= len(super()._index_sampler)
        except TypeError:  # an iterable dataset has no length
            finished = False
        if finished:
            return {"epoch": self._moc_epoch + 1, "batches": 0, "seed": self._moc_seed}
        return {"epoch": self._moc_epoch, "batches": batches, "seed": self._moc_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume there at the next ``iter()`` (Lightning calls this before it creates the epoch's iterator)."""
        self._moc_resume = {
            "epoch": int(state_dict["epoch"]), "batches": int(state_dict["batches"]), "seed": state_dict.get("seed")
        }
