"""What the two levels did, counted where it happens and read by logs and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from moc_lightning.pec.persist import SaveReport
from moc_lightning.storage.location import s3_request_retries


@dataclass(frozen=True)
class StallPhases:
    """Where one snapshot's time on the training thread went, in seconds: the parts of its stall that the engine and
    its caller time (a caller's hook does more besides, such as reading the router counts)."""

    trainer_state: float
    """Capturing the trainer state the snapshot holds (the caller's, before the snapshot; 0 when it gives none)."""
    agreement: float
    """Agreeing with the other ranks: reading the persist vote (:mod:`~moc_lightning.memory.persist_vote`) and
    starting the sum of the router counts; a blocking vote, or a selection that needs the counts at once, waits here."""
    preparation: float
    """Everything else before and after the copy: the previous persist's accounting, the selection, the units' owners
    and tensors, the slot and its views, handing the rest to the copy thread."""
    copy: float
    """The copy into the slot done on the training thread (all of it for host tensors without a spare core; the
    buffers only with one; enqueuing it for GPU tensors)."""
    wait: float
    """The join before the next optimizer step: waiting for the copy thread's copy and commit."""
    blocking_vote: bool = False
    """Whether the persist vote was taken at the snapshot, blocking (no vote started ahead was recent enough)."""


@dataclass
class CheckpointStats:
    """What the two levels did, for logs and benchmarks."""

    snapshots: int = 0
    persists: int = 0
    skipped_persists: int = 0
    failed_persists: int = 0
    copy_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the copy into its slot (host buffers on the training thread, the rest on the copy thread)."""
    snapshot_seconds: list[float] = field(default_factory=list)
    """Per snapshot, from the start of its copy to its slot's commit (trainer state and metadata written)."""
    stall_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the training thread's time on it: taking it at the batch end, then waiting for its commit
    before the next optimizer step."""
    wait_seconds: list[float] = field(default_factory=list)
    """Per snapshot, the wait for its commit alone."""
    stall_phases: list[StallPhases] = field(default_factory=list)
    """Per snapshot, where its time on the training thread went."""
    snapshot_bytes: list[int] = field(default_factory=list)
    persist_reports: list[SaveReport] = field(default_factory=list)
    """The periodic persists (``persists`` counts them)."""
    final_persist: SaveReport | None = None
    """The persist of every unit when ``fit`` ended (``persist_on_fit_end``), kept apart from the periodic ones."""
    retries_at_start: int = field(default_factory=s3_request_retries)
    """TensorStore's count of retried S3 requests in this process when these stats began (the count is
    process-wide: :meth:`storage_retries` is the difference)."""

    retries_noted: int = 0
    """:meth:`storage_retries` when :meth:`retries_note` last counted some."""

    def retries_note(self, rank: int, what: str) -> str | None:
        """The log line of the S3 requests retried on ``rank`` since the last count, by ``what`` (a persist); ``None``
        when there were none."""
        retried = self.storage_retries()
        if retried <= self.retries_noted:
            return None
        new, self.retries_noted = retried - self.retries_noted, retried
        return (f"[moc_lightning] rank {rank}: {new} S3 requests retried by {what} ({retried} in this fit; "
                "bounded by checkpoint.storage.retries)")

    def storage_retries(self) -> int:
        """S3 requests retried (after a 5xx, 429 or ``SlowDown`` answer, or a failed connection) since these stats
        began, in this process: persists, restores and replay windows alike (``checkpoint.storage.retries``)."""
        return s3_request_retries() - self.retries_at_start

