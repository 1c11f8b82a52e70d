"""Lineage: which training run a checkpoint or a snapshot slot belongs to, and whether it may be loaded.

A *lineage* is one training run's history of checkpoints. It is named by a run id drawn when the run
starts fresh and carries the *fingerprint* of what its checkpoints hold (unit keys, tensor shapes and
dtypes, the number of experts per MoE layer). The manifest, every checkpoint's ``moc.json`` and every
snapshot slot carry both, and recovery loads nothing whose run id or fingerprint differ: a fresh start,
``resume=never``, a deleted run directory or another model never resurrects another run's bytes.

A lineage is also a chain of *segments*: every recovery starts a new segment at its resume step, because
training after a recovery leaves the timeline it resumed from. Slots are stamped with the segment
(``generation``) that wrote them. A slot of step ``s`` written in segment ``g`` belongs to the current
timeline only if no later segment resumed before ``s``; otherwise it holds a state the run no longer
had (a world-size change 4 -> 2 -> 4 would otherwise bring back the 4-rank timeline's slots).

Pure data: the collective steps that create or extend a lineage live in :mod:`moc_lightning.runtime.agreement`.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.units import ExpertUnit


class LineageError(ValueError):
    """Stored state belongs to another run or another model; the message says which and what to do."""


@dataclass(frozen=True)
class Segment:
    """One stretch of training between two (re)starts: its generation number and the step it began at."""

    generation: int
    start_step: int


@dataclass(frozen=True)
class Lineage:
    """A run's identity, the fingerprint of its state, and its segments (oldest first)."""

    run_id: str
    fingerprint: str
    segments: tuple[Segment, ...] = (Segment(0, 0),)

    @classmethod
    def start(cls, fingerprint: str) -> Lineage:
        """A new lineage with a fresh run id, beginning at step 0."""
        return cls(run_id=uuid.uuid4().hex[:16], fingerprint=fingerprint)

    @property
    def generation(self) -> int:
        """The current segment: what new slots are stamped with."""
        return self.segments[-1].generation

    def resumed_at(self, step: int) -> Lineage:
        """This lineage after a recovery to ``step`` (a fresh start within the lineage is step 0)."""
        return Lineage(self.run_id, self.fingerprint, (*self.segments, Segment(self.generation + 1, step)))

    def stamp(self) -> dict[str, Any]:
        """What a slot or checkpoint written now records of its lineage."""
        return {"run_id": self.run_id, "fingerprint": self.fingerprint, "generation": self.generation}

    def admits(self, stamp: Mapping[str, Any] | None, step: int) -> bool:
        """Whether a slot stamped ``stamp`` holding step ``step`` belongs to this lineage's current timeline."""
        if not isinstance(stamp, Mapping):
            return False
        if stamp.get("run_id") != self.run_id or stamp.get("fingerprint") != self.fingerprint:
            return False
        generation = stamp.get("generation")
        if not isinstance(generation, int) or generation > self.generation:
            return False
        return all(s.start_step >= step for s in self.segments if s.generation > generation)

    def check_same_run(self, other: Lineage, where: str) -> None:
        """Refuse state of another run (``where`` names it for the message)."""
        if other.fingerprint != self.fingerprint:
            raise LineageError(
                f"{where} holds a model with another fingerprint ({other.fingerprint[:12]}, this model: "
                f"{self.fingerprint[:12]}): unit keys, shapes or dtypes differ; point checkpoint.storage.url at "
                "this model's checkpoints, or set checkpoint.resume=never to start a new lineage there"
            )
        if other.run_id != self.run_id:
            raise LineageError(f"{where} belongs to run {other.run_id}, not to this run ({self.run_id})")

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "fingerprint": self.fingerprint,
            "segments": [[s.generation, s.start_step] for s in self.segments],
        }

    @classmethod
    def from_json(cls, raw: Any) -> Lineage:
        """Parse and validate; raises ``ValueError`` naming the problem."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"lineage must be an object, got {raw!r:.80}")
        run_id, fingerprint, segments = raw.get("run_id"), raw.get("fingerprint"), raw.get("segments")
        if not isinstance(run_id, str) or not run_id or not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError("lineage needs a non-empty 'run_id' and 'fingerprint'")
        if not isinstance(segments, list) or not segments:
            raise ValueError("lineage 'segments' must be a non-empty list")
        parsed = []
        for i, segment in enumerate(segments):
            ok = isinstance(segment, list) and len(segment) == 2 and all(type(x) is int for x in segment)
            if not ok or segment[0] != i or segment[1] < 0:
                raise ValueError(f"lineage segment {i} must be [{i}, start step >= 0], got {segment!r:.80}")
            parsed.append(Segment(segment[0], segment[1]))
        return cls(run_id, fingerprint, tuple(parsed))


def fingerprint(layout: Layout) -> str:
    """A digest of what checkpoints of this model hold, the same on every rank and under any EP degree.

    Dense units contribute every weight's and buffer's key, shape and dtype; each MoE layer its number of
    experts and the key, shape and dtype of one expert's tensors (experts of a layer share them), so ranks that hold
    different experts agree. Optimizer state is left out: it exists only after the first step.
    """
    lines = []
    for unit in layout.dense_units:
        lines += [_describe(unit.key, key, tensor) for key, tensor in layout.model_tensors([unit]).items()]
    for layer in layout.moe_layers:
        twin = ExpertUnit(layer.index, layer.local_experts[0])
        lines.append(f"moe L{layer.index} N={layer.num_experts}")
        twins = layout.model_tensors([twin]).items()
        lines += [_describe(f"L{layer.index}", key.split("/", 3)[-1], t) for key, t in twins]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _describe(owner: str, key: str, tensor: Any) -> str:
    return f"{owner} {key} {tuple(tensor.shape)} {tensor.dtype}"
