"""The trainer state as text: it travels inside a slot's JSON metadata and a persist's per-rank bytes item.

Decoding is a full unpickle (``weights_only=False``), of a slot's metadata or a persist's ``rank_state`` item.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch


def encode_state(state: Any) -> str:
    """A picklable object as text for a slot's JSON metadata."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_state(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)
