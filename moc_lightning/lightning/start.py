"""How a run starts: on an agreed view of storage, either in its own lineage or in a new one.

Every rank reads the same manifest (the coordinator reads it and shares it), so every rank takes the same
path. A run that does not resume begins a new lineage: whatever an earlier run left at the storage URL
is set aside under ``previous_lineages/`` (never deleted, never mixed with the new run), and an empty
manifest naming the new lineage is committed before the first snapshot, so that even snapshots taken
before the first persist can be told apart from another run's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moc_lightning.engine.lineage import Lineage
from moc_lightning.engine.manifest import Manifest, ManifestError
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.stored import MANIFEST, PREVIOUS_MANIFEST
from moc_lightning.runtime.agreement import from_coordinator
from moc_lightning.storage.location import local_path
from moc_lightning.storage.objects import fsync_dir

SET_ASIDE = "previous_lineages"
"""Folder under the storage root that receives the lineages earlier runs left there."""


def agreed_manifest(pec: PECCheckpointer) -> Manifest:
    """The committed manifest as the coordinator reads it, on every rank (collective)."""
    return from_coordinator(pec.read_manifest)


def begin_lineage(pec: PECCheckpointer, fingerprint: str, reason: str) -> Lineage:
    """Start a new lineage at the storage URL (collective); returns it on every rank.

    ``reason`` says why the run does not resume, for the log line that reports what happened to the
    previous lineage.
    """

    def begin() -> Lineage:
        lineage = Lineage.start(fingerprint)
        moved = _set_aside(pec, lineage)
        begun = Manifest(lineage=lineage).to_json()
        pec.storage.put(PREVIOUS_MANIFEST, begun)  # the fallback if this one is damaged before a persist lands
        pec.storage.put(MANIFEST, begun)
        if moved is not None:
            print(f"[moc_lightning] {reason}: the checkpoints found at {pec.storage.url} were moved aside to "
                  f"{moved}; new lineage {lineage.run_id}")
        return lineage

    return from_coordinator(begin)


def _set_aside(pec: PECCheckpointer, lineage: Lineage) -> Path | None:
    """Move everything at the storage root to ``previous_lineages/<run id>/``; ``None`` if it was empty."""
    root = local_path(pec.storage.url)
    if root is None:
        old = _old_manifest(pec)
        if old.lineage is None and not old.records:
            return None
        raise ValueError(
            f"checkpoint.storage.url={pec.storage.url} holds lineage {old.lineage.run_id if old.lineage else '?'} "
            "and a non-local storage root cannot be moved aside; give a new checkpoint.storage.url or delete it"
        )
    names = _root_entries(root)
    if not names:
        return None
    old = _old_manifest(pec)
    label = old.lineage.run_id if old.lineage is not None else f"unnamed-{time.strftime('%Y%m%dT%H%M%S')}"
    target = root / SET_ASIDE / label
    if target.exists():
        target = root / SET_ASIDE / f"{label}-{lineage.run_id}"
    target.mkdir(parents=True)
    for name in names:
        os.replace(root / name, target / name)
    fsync_dir(target)
    fsync_dir(root)
    return target


def _old_manifest(pec: PECCheckpointer) -> Manifest:
    """The manifest an earlier run left (empty where it is unreadable: its files are set aside all the same)."""
    try:
        return pec.read_manifest()
    except ManifestError:
        return Manifest()


def _root_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != SET_ASIDE) if root.exists() else []
