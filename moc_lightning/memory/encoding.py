"""The trainer state as text: it travels inside a slot's JSON metadata and a persist's per-rank bytes item.

Decoding reads what shared memory or storage holds, so it is untrusted input: torch's weights-only unpickler, which
refuses any global MoC does not write there (:mod:`~moc_lightning.storage.unpickling`).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch

from moc_lightning.storage.unpickling import load_torch_saved


def encode_state(state: Any) -> str:
    """A picklable object as text for a slot's JSON metadata."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_state(text: str, what: str = "the trainer state") -> Any:
    """The trainer state :func:`encode_state` wrote; :class:`~moc_lightning.storage.unpickling.UntrustedPickle`,
    naming ``what``, if the text names a global it would not have written."""
    return load_torch_saved(io.BytesIO(base64.b64decode(text)), what)
