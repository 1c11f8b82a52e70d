"""Token accounting between marks: each step's router counts added where they are, and a mark summing exactly the
steps since the last one (``moc_lightning/pec/tokens.py``). A GPU's counts: ``tests/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.routing import LayerCounts as Counts
from moc_lightning.pec.tokens import TokenAccounting


def _accounting(num_experts: list[int]) -> TokenAccounting:
    return TokenAccounting(CheckpointConfig(k_snapshot=1, k_persist=1), num_experts, rank=0)


def test_a_mark_sums_the_steps_since_the_last_mark_and_no_earlier_one() -> None:
    tokens = _accounting([3, 2])
    tokens.record([Counts(torch.tensor([1, 0, 2]), 6), Counts(torch.tensor([2, 1]), 6)])
    tokens.record([Counts(torch.tensor([0, 3, 0]), 6), Counts(torch.tensor([1, 2], dtype=torch.int32), 6)])
    tokens.mark_step(2)
    tokens.record([Counts(torch.tensor([4, 0, 0]), 8), Counts(torch.tensor([0, 4]), 8)])
    tokens.mark_step(3)
    marks = tokens.ledger.state_dict()["marks"]
    assert marks[2] == {"processed": [[1, 3, 2], [3, 3]], "assigned": [12, 12]}
    assert marks[3] == {"processed": [[5, 3, 2], [3, 7]], "assigned": [20, 20]}, "step 3 adds only its own step"


def test_a_step_s_counts_are_added_on_their_own_device() -> None:
    """Counts on a device no copy can leave (``meta``) are recorded: no step copies them to the host, as a GPU's
    would have to wait for the step's kernels (once per MoE layer). Failed on 1018099 (``Cannot copy out of meta``)."""
    tokens = _accounting([3, 2])
    for _ in range(3):
        tokens.record([Counts(torch.zeros(3, dtype=torch.int64, device="meta"), 6),
                       Counts(torch.zeros(2, dtype=torch.int64, device="meta"), 6)])
    with pytest.raises(NotImplementedError, match="meta"):
        tokens.mark_step(3)  # the mark copies the sum to the host: once a checkpoint, where the steps did not
