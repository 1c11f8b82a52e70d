"""The manifest: the durable catalog of persisted checkpoints and which units each one holds.

A checkpoint becomes visible only when the manifest that lists it is committed (one atomic ``put``), after
every rank's bytes are durable: a half-written checkpoint is a directory no manifest names, and is never
read. The newest stored version of a unit is the newest listed checkpoint that holds it; retention keeps
the newest ``retention`` checkpoints and, beyond them, every checkpoint that still holds some unit's
newest version, so it never removes the only stored version of a unit.

Under ``checkpoint.pec_scope`` other than ``both`` a checkpoint also holds one part of the experts it does
not hold whole (:mod:`moc_lightning.engine.parts`), listed as part keys in ``parts``: the newest version of a part is
the newest checkpoint holding the unit whole or that part, and retention keeps every part's newest version.
A record without ``parts`` (every manifest written before the field, and every ``both`` one) holds whole
units only.

Pure data: (de)serialisation validates everything and raises :class:`ManifestError` on bad bytes. The JSON
is sealed (:mod:`moc_lightning.storage.sealed`): its CRC32C is checked before anything in it is believed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.parts import PARTS, part_key, split_part_key
from moc_lightning.storage.sealed import SealError, seal, unseal

FORMAT_VERSION = 1


class ManifestError(ValueError):
    """The manifest bytes are not a valid MoC manifest."""


@dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint: what it holds and how it was written (a self-description)."""

    name: str
    """Location under the storage root (``step_00000120``)."""
    step: int
    """Optimizer step the state belongs to."""
    units: tuple[str, ...]
    """Keys of the units stored in it (every dense unit, and the persisted experts)."""
    strategy: str
    """Sharding strategy that wrote it."""
    world_size: int
    """Ranks that wrote it."""
    ep: int
    """Expert-parallel degree when it was written."""
    backend: str
    """Storage backend (``filesystem`` or ``tensorstore``)."""
    parts: tuple[str, ...] = ()
    """Part keys (``expert/L0/E3/weights``) of the units stored here as that part only (``pec_scope``)."""
    digests: tuple[str, ...] = ()
    """A final persist's: per rank, the digest of the live state it wrote (:func:`~moc_lightning.engine.completeness.state_digest`
    of the rank's pieces), which a later "persisted already" decision compares with the live state; empty otherwise."""

    def holds(self, unit_key: str, part: str | None = None) -> bool:
        """Whether the unit is stored here whole or, with ``part``, whether that part of it is."""
        return unit_key in self._unit_set or (part is not None and part_key(unit_key, part) in self._part_set)

    def part_keys(self) -> set[str]:
        """Every part stored here, whole units' both parts included."""
        return {part_key(u, p) for u in self.units for p in PARTS} | set(self.parts)

    @cached_property
    def _unit_set(self) -> frozenset[str]:
        return frozenset(self.units)

    @cached_property
    def _part_set(self) -> frozenset[str]:
        return frozenset(self.parts)


@dataclass(frozen=True)
class Manifest:
    """Committed checkpoints, oldest first, and the lineage they belong to."""

    records: tuple[CheckpointRecord, ...] = field(default_factory=tuple)
    lineage: Lineage | None = None
    """The run these checkpoints belong to (``None`` for a manifest written by the engine alone)."""

    @property
    def latest(self) -> CheckpointRecord | None:
        return self.records[-1] if self.records else None

    def newest(
        self, unit_key: str, at_or_before: int | None = None, part: str | None = None
    ) -> CheckpointRecord | None:
        """The newest checkpoint holding ``unit_key`` (whole, or the ``part`` of it) at or before step
        ``at_or_before`` (any step if ``None``)."""
        for record in reversed(self.records):
            if (at_or_before is None or record.step <= at_or_before) and record.holds(unit_key, part):
                return record
        return None

    def at_step(self, step: int) -> CheckpointRecord:
        for record in self.records:
            if record.step == step:
                return record
        raise KeyError(f"no committed checkpoint of step {step}")

    def by_name(self, name: str) -> CheckpointRecord:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(f"no committed checkpoint named {name!r}")

    def with_record(self, record: CheckpointRecord) -> Manifest:
        """This manifest plus ``record``, which must be newer than every listed checkpoint."""
        if self.records and record.step <= self.records[-1].step:
            raise ValueError(f"checkpoint at step {record.step} is not newer than step {self.records[-1].step}")
        return replace(self, records=self.records + (record,))

    def superseded_by(self, record: CheckpointRecord) -> Manifest:
        """This manifest with ``record`` replacing the latest checkpoint, which is of the same step and holds a
        subset of ``record``'s units (the complete final persist of a step that was persisted partially)."""
        latest = self.latest
        if latest is None or latest.step != record.step or not latest.part_keys() <= record.part_keys():
            raise ValueError(f"checkpoint {record.name} does not supersede the latest checkpoint {latest}")
        return replace(self, records=self.records[:-1] + (record,))

    def without(self, names: set[str]) -> Manifest:
        """This manifest without the checkpoints called ``names`` (a fallback after corruption)."""
        return replace(self, records=tuple(r for r in self.records if r.name not in names))

    def with_lineage(self, lineage: Lineage) -> Manifest:
        return replace(self, lineage=lineage)

    def retire(self, retention: int) -> tuple[Manifest, list[str]]:
        """Apply retention: keep the newest ``retention`` checkpoints and any holding a unit's newest version.

        Returns the manifest to commit and the checkpoints to delete *after* committing it.
        """
        if retention < 1:
            raise ValueError(f"checkpoint.retention must be >= 1, got {retention}")
        keep = {r.name for r in self.records[-retention:]}
        parts = {split_part_key(key) for r in self.records for key in r.part_keys()}
        newest_of_some_part = {r.name for unit, part in parts if (r := self.newest(unit, part=part)) is not None}
        kept = tuple(r for r in self.records if r.name in keep or r.name in newest_of_some_part)
        removed = [r.name for r in self.records if r not in kept]
        return replace(self, records=kept), removed

    def to_json(self) -> bytes:
        return seal(self.to_dict(), indent=1)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this manifest (what :meth:`to_json` seals)."""
        records = [{k: v for k, v in asdict(r).items() if k not in _OPTIONAL_FIELDS or v} for r in self.records]
        raw: dict[str, Any] = {"format": FORMAT_VERSION, "records": records}
        if self.lineage is not None:
            raw["lineage"] = self.lineage.to_json()
        return raw

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Verify, parse and validate; anything damaged or malformed raises :class:`ManifestError` naming it."""
        try:
            raw = unseal(data)
        except SealError as err:
            raise ManifestError(f"manifest {err}") from err
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        """Validate the JSON object of a manifest (:meth:`from_json` after the checksum)."""
        if raw.get("format") != FORMAT_VERSION:
            raise ManifestError(f"manifest format must be {FORMAT_VERSION}, got {raw.get('format')!r:.80}")
        records = raw.get("records")
        if not isinstance(records, list):
            raise ManifestError("manifest 'records' must be a list")
        parsed = tuple(_record(r) for r in records)
        steps = [r.step for r in parsed]
        if steps != sorted(set(steps)):
            raise ManifestError(f"manifest steps must be strictly increasing, got {steps}")
        try:
            lineage = Lineage.from_json(raw["lineage"]) if "lineage" in raw else None
        except ValueError as err:
            raise ManifestError(f"manifest lineage is invalid: {err}") from err
        return cls(parsed, lineage)


_OPTIONAL_FIELDS = ("parts", "digests")
"""Record fields written only when not empty (a manifest from before they existed reads the same)."""
_FIELD_TYPES = {"name": str, "step": int, "strategy": str, "world_size": int, "ep": int, "backend": str}


def _record(raw: object) -> CheckpointRecord:
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest record must be an object, got {raw!r:.80}")
    for name, kind in _FIELD_TYPES.items():
        if not isinstance(raw.get(name), kind) or isinstance(raw.get(name), bool):
            raise ManifestError(f"manifest record field {name!r} must be {kind.__name__}, got {raw.get(name)!r:.80}")
    units = raw.get("units")
    if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        raise ManifestError("manifest record field 'units' must be a list of unit keys")
    parts = raw.get("parts", [])
    if not isinstance(parts, list) or not all(isinstance(p, str) and p.rpartition("/")[2] in PARTS for p in parts):
        raise ManifestError(f"manifest record field 'parts' must be a list of part keys, got {parts!r:.80}")
    digests = raw.get("digests", [])
    if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
        raise ManifestError(f"manifest record field 'digests' must be a list of strings, got {digests!r:.80}")
    if raw["step"] < 0 or raw["world_size"] < 1 or raw["ep"] < 1 or "/" in raw["name"] or not raw["name"]:
        raise ManifestError(f"manifest record {raw['name']!r} has out-of-range fields")
    return CheckpointRecord(
        name=raw["name"],
        step=raw["step"],
        units=tuple(units),
        strategy=raw["strategy"],
        world_size=raw["world_size"],
        ep=raw["ep"],
        backend=raw["backend"],
        parts=tuple(parts),
        digests=tuple(digests),
    )
