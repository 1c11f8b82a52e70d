"""Unit identities: the atoms that PEC selects, shards and restores.

A unit is either one expert of one MoE layer or one non-expert module at layer granularity. Its string key
is the prefix of every state-dict key the unit owns, so it must be stable across runs, world sizes and EP
degrees: expert units carry the MoE layer *ordinal* and the *global* expert id, never a module path or a
rank-local index (two ranks holding different experts under a local name would collapse on save).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Union

_EXPERT_KEY = re.compile(r"^expert/L(?P<layer>\d+)/E(?P<expert>\d+)(?:/|$)")
_DENSE_KEY = re.compile(r"^dense/(?P<name>[^/]+)(?:/|$)")


def _natural(text: str) -> tuple[str | int, ...]:
    """Sort key that orders ``blocks.2`` before ``blocks.10``.

    ``re.split`` with a capturing group alternates text and digits, so tuples compare like with like.
    """
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text)))


@functools.total_ordering
class _Ordered:
    """Total order over all units: dense units first (natural name order), then experts by (layer, id)."""

    def _sort_key(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, _Ordered):
            return NotImplemented
        return self._sort_key() < other._sort_key()


@dataclass(frozen=True, eq=True)
class ExpertUnit(_Ordered):
    """Expert ``expert`` (global id) of the MoE layer with ordinal ``layer`` (0-based, order of appearance)."""

    layer: int
    expert: int

    def __post_init__(self) -> None:
        if self.layer < 0 or self.expert < 0:
            raise ValueError(
                f"expert unit needs layer >= 0 and expert >= 0, got layer={self.layer}, expert={self.expert}"
            )

    @property
    def key(self) -> str:
        return f"expert/L{self.layer}/E{self.expert}"

    def _sort_key(self) -> tuple[object, ...]:
        return (1, self.layer, self.expert)


@dataclass(frozen=True, eq=True)
class DenseUnit(_Ordered):
    """A non-expert module at layer granularity, named by its module prefix (e.g. ``model.blocks.0.attn``)."""

    name: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"dense unit name must be a non-empty module path without '/', got {self.name!r}")

    @property
    def key(self) -> str:
        return f"dense/{self.name}"

    def _sort_key(self) -> tuple[object, ...]:
        return (0, _natural(self.name))


Unit = Union[ExpertUnit, DenseUnit]


def expert(layer: int, expert_id: int) -> ExpertUnit:
    """The unit of global expert ``expert_id`` in MoE layer ``layer``."""
    return ExpertUnit(layer, expert_id)


def dense(name: str) -> DenseUnit:
    """The unit of the non-expert module ``name``."""
    return DenseUnit(name)


def parse_unit(key: str) -> Unit:
    """The unit whose key is ``key`` or a prefix of it (``expert/L1/E3/param/fc.weight`` -> ``expert(1, 3)``).

    Lets a loader route any state-dict key back to its unit without a lookup table.
    """
    if match := _EXPERT_KEY.match(key):
        return ExpertUnit(int(match["layer"]), int(match["expert"]))
    if match := _DENSE_KEY.match(key):
        return DenseUnit(match["name"])
    raise ValueError(f"not a unit key: {key!r}; expected 'expert/L<layer>/E<expert>[/...]' or 'dense/<module>[/...]'")
