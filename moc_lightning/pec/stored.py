"""What a persisted checkpoint looks like in storage, and reading its catalog back.

One place names the files a persist leaves (the manifest, the manifest it replaced, each checkpoint's directory,
its ``moc.json`` and each rank's trainer-state item), so that the writer, the loader and ``moc-consolidate`` read
the same layout and verify it the same way.
"""

from __future__ import annotations

from typing import Any

from moc_lightning.engine.manifest import Manifest, ManifestError
from moc_lightning.storage import CheckpointStorage
from moc_lightning.storage.sealed import SealError, unseal

MANIFEST = "manifest.json"
RANK_STATE = "rank_state/{rank}"
"""DCP key of one rank's trainer state (loops, RNG, data position, ...) inside a persist: a bytes item each
rank writes itself, checksummed and committed with the checkpoint's tensors."""
PREVIOUS_MANIFEST = "manifest.previous.json"


class UnreadableCheckpoint(Exception):
    """A stored checkpoint failed verification; recovery plans again without it."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"checkpoint {name} is unreadable: {detail}")
        self.name = name


def checkpoint_name(step: int, final: bool = False) -> str:
    """Where the checkpoint of ``step`` lives; ``final``: the complete persist that supersedes a partial one
    of the same step (a separate location, so the committed partial one is never overwritten)."""
    return f"step_{step:09d}" + ("_final" if final else "")


def read_manifest(storage: CheckpointStorage) -> Manifest:
    """The committed manifest under ``storage``; if it is unreadable (damaged, or failing its CRC32C), the one
    committed before it, saying so. No manifest is an empty one."""
    data = storage.get(MANIFEST)
    if data is None:
        return Manifest()
    try:
        return Manifest.from_json(data)
    except ManifestError as err:
        previous = storage.get(PREVIOUS_MANIFEST)
        if previous is None:
            raise ManifestError(f"{storage.url}/{MANIFEST} is unreadable ({err}) and no previous "
                                "manifest exists to fall back to") from err
        manifest = Manifest.from_json(previous)
        print(f"[moc_lightning] {MANIFEST} is unreadable ({err}); using the previous manifest "
              f"(latest step {manifest.latest.step if manifest.latest else None})")
        return manifest


def read_description(storage: CheckpointStorage, name: str) -> dict[str, Any]:
    """The verified ``moc.json`` of checkpoint ``name``; :class:`UnreadableCheckpoint` if missing or damaged."""
    data = storage.get(f"{name}/moc.json")
    if data is None:
        raise UnreadableCheckpoint(name, f"{name}/moc.json is missing")
    try:
        return unseal(data)
    except SealError as err:
        raise UnreadableCheckpoint(name, f"{name}/moc.json {err}") from err


def stored_steps(manifest: Manifest) -> dict[str, int]:
    """Unit key -> step of its newest version listed in ``manifest``."""
    return {unit: record.step for record in manifest.records for unit in record.units}
