"""Whether the live training state is restored completely, and what a committed final checkpoint held.

A restore may take more than one call: a two-level recovery loads units one source at a time, and replay mode brings
the model to the resume step by replaying a window once Lightning has set up the strategy and the optimizers. Until
it has finished, the live tensors are a mix of steps that no run ever had. DESIGN hard part 13: nothing may observe or
write such a state. :class:`RestoreGuard` says whether a restore is still pending; every snapshot and persist asks it
first, and refuses (:class:`IncompleteRestore`) rather than commit the mix. Every rank takes the same restore path
(the decisions are collective), so every rank refuses alike.

A final persist records the digest of what each rank wrote (:func:`state_digest`), so that a later fit ending at the
same step decides "persisted already" by comparing the live state with it, not by the step alone: a final checkpoint
committed from a wrong state (by an older version that persisted a replay-mode resume before its replay) is then
written again from the live state, not kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moc_lightning.storage.sealed import checksum, checksum_view


class IncompleteRestore(RuntimeError):
    """A snapshot, persist or evaluation of a live state whose restore has not finished."""


class RestoreGuard:
    """Whether a restore of the live state is under way (:meth:`begin`) or finished (:meth:`complete`)."""

    def __init__(self) -> None:
        self.pending: str | None = None
        """What is still to be done (``"the replay of the window from step 12"``), or ``None``: the state is complete."""

    def begin(self, what: str) -> None:
        """A restore starts: until :meth:`complete`, :meth:`check` refuses; ``what`` names it in that error."""
        self.pending = what

    def complete(self) -> None:
        """The live state is restored completely (or left as it was before :meth:`begin`)."""
        self.pending = None

    def check(self, action: str, would: str = "commit") -> None:
        """Raise :class:`IncompleteRestore` naming ``action`` while a restore is pending. ``would``: what ``action``
        would do with the mixed state (``commit`` it, for a snapshot or persist; ``train from`` it; ``evaluate`` it)."""
        if self.pending is not None:
            raise IncompleteRestore(
                f"{action} refused: the live training state is not restored completely ({self.pending} has not "
                f"finished), so it would {would} a state no run had; nothing was written"
            )


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """CRC32C of ``tensors`` in key order: each key, dtype, shape and bytes (a rank's pieces of the live state)."""
    crc = 0
    for key in sorted(tensors):
        tensor = tensors[key].detach()
        crc = checksum(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}".encode(), crc)
        if tensor.numel():
            crc = checksum_view(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"
