"""The coordinator's commit of a persist: self-description, then the manifest (the commit point), then retention.

Durability order (DESIGN.md, hard part 5) lives here: a checkpoint becomes "latest" only by the manifest put, after
its bytes and its ``moc.json`` are written; the manifest it replaces is kept as the fallback; retention deletes
only what the new manifest no longer lists, after the commit, and retries what it could not delete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from moc_lightning.engine.lineage import Lineage, LineageError
from moc_lightning.engine.manifest import CheckpointRecord, Manifest
from moc_lightning.pec.stored import MANIFEST, PREVIOUS_MANIFEST, read_manifest
from moc_lightning.runtime.faults import fault_point
from moc_lightning.storage import CheckpointStorage
from moc_lightning.storage.sealed import seal

COMMIT_POINTS = ("commit:description", "commit:previous_manifest", "commit:manifest", "commit:retention")
"""The points of the coordinator's commit at which ``fault_hook`` (:class:`ManifestCommit`) is called, in order:

- ``commit:description``: before ``step_X/moc.json`` is put;
- ``commit:previous_manifest``: before ``manifest.previous.json`` (the manifest being replaced) is put;
- ``commit:manifest``: before ``manifest.json`` is put. That put is the commit point: a fault at any point
  up to here commits nothing (the manifest is unchanged) and the persist fails on every rank;
- ``commit:retention``: after the commit, before retention deletes the checkpoints the new manifest no
  longer lists. The persist is committed whatever happens from here on; a failed deletion is retried with
  the next commit.

Tests raise at these points; a chaos harness can SIGKILL at them.
"""


class ManifestCommit:
    """The coordinator's side of committing persists to one storage.

    Public: :meth:`commit`, :meth:`retire`, :meth:`discard_attempt`, :meth:`check_lineage`; ``fault_hook`` and
    ``reached`` (the last point a commit reached, named in a failure).
    """

    def __init__(
        self, storage: CheckpointStorage, retention: int, fault_hook: Callable[[str], None] | None = None
    ) -> None:
        """``fault_hook``, if given, is called with each name in :data:`COMMIT_POINTS` as a commit reaches it (fault
        injection: what it raises fails the commit there)."""
        self.storage = storage
        self.retention = retention
        self.fault_hook = fault_hook
        self.reached = ""
        """The last commit point the coordinator's commit reached (named in a failure)."""
        self._undeleted: list[str] = []
        """Checkpoints retention retired whose deletion failed: deleted with the next commit."""

    def commit(
        self,
        record: CheckpointRecord,
        describe: Callable[[], dict[str, Any]],
        lineage: Lineage | None,
        supersede: bool = False,
    ) -> list[str]:
        """Self-description (``describe()``) first, then the manifest (the commit point); returns what retention
        retired, for the caller to delete (:meth:`retire`) once every rank knows the commit is done."""
        self.reached = "describe"
        description = describe()
        self._at("commit:description")
        self.storage.put(f"{record.name}/moc.json", seal(description))
        current = read_manifest(self.storage)
        self.check_lineage(current, record.name, lineage)
        if supersede:
            replaced = current.latest
            assert replaced is not None, "a final persist supersedes the latest checkpoint"
            manifest, removed = current.superseded_by(record).retire(self.retention)
            removed.append(replaced.name)
        else:
            manifest, removed = current.with_record(record).retire(self.retention)
        self._at("commit:previous_manifest")
        self.storage.put(PREVIOUS_MANIFEST, current.to_json())  # the fallback if the new one gets damaged
        self._at("commit:manifest")
        fault_point("manifest_commit", record.step)
        try:
            self.storage.put(MANIFEST, manifest.to_json())
        except (Exception, CheckpointException):
            if not self._listed_safely(record.name):
                raise
            print(f"[moc_lightning] the manifest put for {record.name} raised after the manifest landed; committed")
        return removed

    def check_lineage(self, current: Manifest, name: str, lineage: Lineage | None) -> None:
        """Raise :class:`LineageError` unless the committed manifest ``current`` is of ``lineage`` (``None``: an
        engine used on its own, which checks nothing)."""
        if lineage is not None and (current.lineage is None or current.lineage.run_id != lineage.run_id):
            found = current.lineage.run_id if current.lineage else "none"
            raise LineageError(
                f"{self.storage.url} now belongs to lineage {found}, not to this run's ({lineage.run_id}); "
                f"checkpoint {name} is not committed (did another run start at the same storage URL?)"
            )

    def retire(self, retired: list[str]) -> None:
        """Delete checkpoints no committed manifest lists any more (and any whose deletion failed before).

        After the commit point: a failure here is logged and retried with the next commit, never a failed persist.
        """
        pending, self._undeleted = [*self._undeleted, *retired], []
        try:
            self._at("commit:retention")
            while pending:
                self.storage.delete(pending[0])
                pending.pop(0)
        except Exception as err:  # noqa: BLE001 - the persist is committed; the deletion is retried
            self._undeleted = pending
            print(f"[moc_lightning] retention could not delete {pending} ({err}); retried with the next commit")

    def discard_attempt(self, name: str) -> None:
        """Delete the location of a persist that failed, unless a committed manifest lists it (then it is not
        this attempt's to delete); best effort: what cannot be deleted is garbage no manifest names."""
        try:
            if self._listed(name):
                return
            self.storage.delete(name)
        except Exception as err:  # noqa: BLE001 - cleanup must not replace the failure being reported
            print(f"[moc_lightning] could not remove {name} after its failed persist ({err}); no manifest names it")

    def _at(self, point: str) -> None:
        """Reach commit point ``point`` (one of :data:`COMMIT_POINTS`)."""
        self.reached = point
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _listed(self, name: str) -> bool:
        return any(r.name == name for r in read_manifest(self.storage).records)

    def _listed_safely(self, name: str) -> bool:
        """Whether the committed manifest lists ``name``; ``False`` when it cannot be read."""
        try:
            return self._listed(name)
        except Exception:  # noqa: BLE001 - unknown: report the commit as failed
            return False
