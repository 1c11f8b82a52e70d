"""Parts of a unit, and which of them PEC applies to (``checkpoint.pec_scope``, paper Figure 13a).

A unit's state has two parts: its **weights** (parameters and persistent buffers: the model's own tensors)
and its **optimizer** state. ``pec_scope`` says which parts of an expert unit follow PEC, i.e. are saved for
only the K selected experts of each MoE layer at a checkpoint; the other part of every expert is saved at
every checkpoint, as dense units are (always whole):

- ``both`` ("WO", the default): weights and optimizer state of K experts; the others are not saved at all.
- ``optimizer`` ("O"): every expert's weights, the optimizer state of K.
- ``weights`` ("W"): every expert's optimizer state, the weights of K.

A checkpoint therefore holds whole units and, under ``optimizer``/``weights``, one part of each other expert.
That part is named by its *part key*, ``<unit key>/<part>`` (``expert/L0/E3/weights``), in the manifest and
in snapshot slots, so a recovery can take each part from its own newest surviving copy.
"""

from __future__ import annotations

from moc_lightning.engine.units import parse_unit

PARTS = ("weights", "optimizer")
SCOPES = ("both", "optimizer", "weights")


def part_of(key: str) -> str:
    """The part a state-dict key belongs to: ``optimizer`` for ``<unit>/optim/...``, else ``weights``."""
    return "optimizer" if "/optim/" in key else "weights"


def part_key(unit_key: str, part: str) -> str:
    """The key of one part of a unit (``expert/L0/E3/weights``)."""
    if part not in PARTS:
        raise ValueError(f"unit part must be one of {', '.join(PARTS)}, got {part!r}")
    return f"{unit_key}/{part}"


def always_saved(scope: str) -> str | None:
    """The part of every expert a checkpoint saves under ``scope`` besides the K whole experts; ``None`` for
    ``both``, where the other experts are not saved at all."""
    if scope not in SCOPES:
        raise ValueError(f"checkpoint.pec_scope={scope!r} is not allowed; choose one of: {', '.join(SCOPES)}")
    return {"both": None, "optimizer": "weights", "weights": "optimizer"}[scope]


def part_key_of(key: str) -> str:
    """The part key a state-dict key belongs to (``expert/L0/E3/optim/fc.weight/exp_avg`` -> ``expert/L0/E3/optimizer``)."""
    return part_key(parse_unit(key).key, part_of(key))


def split_part_key(key: str) -> tuple[str, str]:
    """``expert/L0/E3/weights`` -> ``("expert/L0/E3", "weights")``."""
    unit_key, _, part = key.rpartition("/")
    if part not in PARTS:
        raise ValueError(f"not a part key: {key!r}; expected '<unit key>/<{'|'.join(PARTS)}>'")
    return unit_key, part
