"""The manifest: newest versions, retention that never drops a unit's only version, strict parsing."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moc_lightning.engine.manifest import CheckpointRecord, Manifest, ManifestError
from moc_lightning.storage.sealed import seal

DENSE = ("dense/a", "dense/b")


def _record(step: int, experts: tuple[str, ...]) -> CheckpointRecord:
    return CheckpointRecord(
        name=f"step_{step:09d}", step=step, units=DENSE + experts, strategy="adaptive", world_size=2, ep=2,
        backend="filesystem",
    )


def _manifest() -> Manifest:
    m = Manifest()
    for step, experts in ((10, ("expert/L0/E0",)), (20, ("expert/L0/E1",)), (30, ("expert/L0/E0",)), (40, ())):
        m = m.with_record(_record(step, experts))
    return m


def test_newest_version_per_unit() -> None:
    m = _manifest()
    assert m.latest.step == 40
    assert m.newest("dense/a").step == 40
    assert m.newest("expert/L0/E0").step == 30
    assert m.newest("expert/L0/E0", at_or_before=25).step == 10
    assert m.newest("expert/L0/E1").step == 20
    assert m.newest("expert/L0/E7") is None


def test_retention_keeps_the_only_version_of_every_unit() -> None:
    kept, removed = _manifest().retire(retention=1)
    assert [r.step for r in kept.records] == [20, 30, 40]
    assert removed == ["step_000000010"]
    for unit in ("dense/a", "expert/L0/E0", "expert/L0/E1"):
        assert kept.newest(unit) == _manifest().newest(unit)


def test_records_must_be_newer() -> None:
    with pytest.raises(ValueError, match="not newer than step 40"):
        _manifest().with_record(_record(40, ()))


def test_json_round_trip() -> None:
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe", "has no CRC32C"),
        (b"{", "has no CRC32C"),
        (b'{"format": 1, "records": []}', "has no CRC32C"),  # written without a seal
        (seal({"format": 2, "records": []}), "manifest format must be 1"),
        (seal({"format": 1, "records": {}}), "'records' must be a list"),
        (seal({"format": 1, "records": [{"name": "x"}]}), "field 'step' must be int"),
    ],
)
def test_garbage_is_refused_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(data)


def test_every_byte_is_checked_before_parsing() -> None:
    """A flipped bit anywhere (a digit of a step, a letter of a key, whitespace) is refused, never misread."""
    data = _manifest().to_json()
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x01
        with pytest.raises(ManifestError, match="CRC32C"):
            Manifest.from_json(bytes(damaged))


@given(st.binary(max_size=300))
def test_random_bytes_never_parse_silently(data: bytes) -> None:
    try:
        manifest = Manifest.from_json(data)
    except ManifestError:
        return
    assert isinstance(manifest, Manifest)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12))
def test_random_json_documents_raise_only_manifest_errors(doc: object) -> None:
    """Any other exception (KeyError, TypeError, ...) fails the test: bad input gets a ManifestError."""
    try:
        manifest = Manifest.from_json(seal({"format": 1, "records": [doc]}))
    except ManifestError:
        return
    assert all(isinstance(r, CheckpointRecord) and r.step >= 0 for r in manifest.records)


def test_records_without_parts_are_whole_units_and_write_no_parts_field() -> None:
    """A manifest written before ``pec_scope`` (no ``parts``) loads as ``both``; a ``both`` one still writes none."""
    m = _manifest()
    assert all("parts" not in r for r in m.to_dict()["records"])
    assert all(r.parts == () for r in Manifest.from_json(m.to_json()).records)
    assert m.newest("expert/L0/E0", part="optimizer").step == 30


def test_newest_version_and_retention_per_part() -> None:
    """Under ``pec_scope=optimizer`` an expert's weights are stored at every persist, its optimizer state when
    selected; a later switch to ``both`` stores neither part of E1. Retention keeps each part's newest copy."""
    whole = _record(10, ("expert/L0/E0", "expert/L0/E1"))
    weights_only = dataclasses.replace(_record(20, ("expert/L0/E0",)), parts=("expert/L0/E1/weights",))
    m = Manifest((whole, weights_only, _record(30, ("expert/L0/E0",))))
    assert Manifest.from_json(m.to_json()) == m
    assert m.newest("expert/L0/E1", part="weights").step == 20
    assert m.newest("expert/L0/E1", part="optimizer").step == 10
    assert m.newest("expert/L0/E1").step == 10, "a whole version holds both parts"
    kept, removed = m.retire(retention=1)
    assert [r.step for r in kept.records] == [10, 20, 30] and removed == []
