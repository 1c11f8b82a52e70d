import json

import pytest
import torch

from moc_lightning.engine.ledger import NEVER, DynamicK, FaultReport, TokenLedger, check_k, proportion_lost


def record(ledger: TokenLedger, layer0: list[int], assigned0: int, layer1: list[int], assigned1: int) -> None:
    ledger.record(0, torch.tensor(layer0), assigned0)
    ledger.record(1, torch.tensor(layer1), assigned1)


@pytest.fixture
def ledger() -> TokenLedger:
    """Two MoE layers (3 and 2 experts), checkpoints marked at steps 1 and 3, and one step after the last mark."""
    ledger = TokenLedger([3, 2])
    record(ledger, [2, 1, 0], 4, [1, 1], 4)  # step 1
    ledger.mark(1)
    record(ledger, [0, 3, 1], 4, [2, 0], 4)  # step 2 (capacity dropped some tokens)
    record(ledger, [1, 1, 1], 4, [0, 3], 4)  # step 3
    ledger.mark(3)
    record(ledger, [5, 0, 0], 6, [1, 1], 2)  # step 4: trained again after the fault
    return ledger


def test_recording_every_layer_at_once_is_recording_each(ledger: TokenLedger) -> None:
    at_once = TokenLedger([3, 2])
    at_once.load_state_dict(ledger.state_dict())
    record(ledger, [1, 0, 2], 6, [3, 0], 6)
    at_once.record_all(torch.tensor([1, 0, 2, 3, 0]), torch.tensor([6, 6]))
    ledger.mark(5)
    at_once.mark(5)
    assert at_once.state_dict() == ledger.state_dict()
    restored_from = [[3, 1, NEVER], [1, 3]]
    assert at_once.recover(5, restored_from).lost_per_layer == ledger.recover(5, restored_from).lost_per_layer
    with pytest.raises(ValueError, match=r"must have shape \[5\] and assigned \[2\], got \[4\] and \[2\]"):
        at_once.record_all(torch.tensor([1, 0, 2, 3]), torch.tensor([6, 6]))


def test_plt_of_one_fault_equals_eq7_by_hand(ledger: TokenLedger) -> None:
    # cumulative at step 3: layer 0 [3, 5, 2] of 12 assigned, layer 1 [3, 4] of 12; at step 1: [2, 1, 0] and [1, 1]
    report = ledger.recover(3, restored_from=[[3, 1, NEVER], [1, 3]])
    assert [t.tolist() for t in report.lost] == [[0, 5 - 1, 2 - 0], [3 - 1, 0]]
    assert report.assigned == (12, 12)
    assert report.plt == pytest.approx((6 / 12 + 2 / 12) / 2)
    assert ledger.accumulated_plt == pytest.approx(report.plt)


def test_second_fault_accumulates_and_does_not_count_a_loss_twice(ledger: TokenLedger) -> None:
    ledger.recover(3, restored_from=[[3, 1, NEVER], [1, 3]])
    record(ledger, [1, 2, 3], 6, [4, 0], 4)  # step 4 again, then step 5 is a checkpoint
    ledger.mark(5)
    # cumulative at 5: layer 0 [4, 7, 5] of 18, layer 1 [7, 4] of 16. Expert (0, 1) still has only its step-1
    # version, which was its state at the resume step 3: it loses what it processed after step 3 only.
    assert [t.tolist() for t in ledger.tokens_since([[5, 1, NEVER], [5, 5]])] == [[0, 2, 3], [0, 0]]
    report = ledger.recover(5, restored_from=[[5, 1, NEVER], [5, 5]])
    assert report.lost_per_layer == (2 + 3, 0)
    assert report.plt == pytest.approx((5 / 18 + 0 / 16) / 2)
    assert ledger.accumulated_plt == pytest.approx(((6 + 5) / 18 + (2 + 0) / 16) / 2)


def test_recover_rolls_counts_back_to_the_resume_step(ledger: TokenLedger) -> None:
    ledger.mark(4)
    ledger.recover(3, restored_from=[[3, 3, 3], [3, 3]])
    assert ledger.marked_steps == (NEVER, 1, 3)
    assert [t.tolist() for t in ledger.tokens_since([[1, 1, 1], [1, 1]])] == [[1, 4, 2], [2, 3]]


def test_recover_rejects_impossible_steps(ledger: TokenLedger) -> None:
    with pytest.raises(
        ValueError, match=r"restored from steps after resume step 1: \(layer, expert, step\) \[\(0, 0, 3\)\]"
    ):
        ledger.recover(1, restored_from=[[3, 1, 1], [1, 1]])
    with pytest.raises(KeyError, match=r"no ledger mark at step 2; marked steps: \[-1, 1, 3\]"):
        ledger.recover(3, restored_from=[[2, 1, 1], [1, 1]])
    with pytest.raises(ValueError, match=r"one step per expert of every MoE layer, shaped \[3, 2\]"):
        ledger.recover(3, restored_from=[[1, 1], [1, 1]])
    with pytest.raises(ValueError, match=r"counts of MoE layer 1 must have shape \[2\], got \[3\]"):
        ledger.record(1, torch.tensor([1, 2, 3]), 3)


def test_prune_keeps_only_marks_still_needed(ledger: TokenLedger) -> None:
    ledger.prune(oldest_needed=3)
    assert ledger.marked_steps == (NEVER, 3), "the never-saved mark survives: experts may have no version left"
    with pytest.raises(KeyError, match="pruned too far"):
        ledger.tokens_since([[1, 3, 3], [3, 3]])
    assert [t.tolist() for t in ledger.tokens_since([[NEVER, 3, 3], [3, 3]])]


def test_state_dict_survives_json(ledger: TokenLedger) -> None:
    ledger.recover(3, restored_from=[[3, 1, NEVER], [1, 3]])
    restored = TokenLedger([3, 2])
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.accumulated_plt == ledger.accumulated_plt
    assert restored.marked_steps == ledger.marked_steps
    steps = [[1, 1, NEVER], [NEVER, 3]]
    assert [t.tolist() for t in restored.tokens_since(steps)] == [t.tolist() for t in ledger.tokens_since(steps)]
    with pytest.raises(ValueError, match=r"num_experts=\[3, 2\], this ledger has \[3\]"):
        TokenLedger([3]).load_state_dict(ledger.state_dict())


def test_proportion_lost_ignores_layers_without_tokens() -> None:
    assert proportion_lost([3, 0], [12, 0]) == pytest.approx(3 / 12 / 2)
    assert TokenLedger([2]).accumulated_plt == 0.0


def report(lost: int, assigned: int) -> FaultReport:
    return FaultReport(resume_step=0, lost=(torch.tensor([lost, 0]),), assigned=(assigned,))


def test_dynamic_k_doubles_before_the_next_fault_could_pass_the_threshold() -> None:
    dynamic = DynamicK(k_snapshot=2, k_persist=1, num_experts=8)
    assert not dynamic.after_recovery(report(15, 1000), accumulated_plt=0.015)  # 1.5% + 1.5% fits under 3.75%
    assert (dynamic.k_snapshot, dynamic.k_persist) == (2, 1)
    assert dynamic.after_recovery(report(15, 1000), accumulated_plt=0.030)  # 3.0% + 1.5% would not
    assert (dynamic.k_snapshot, dynamic.k_persist) == (4, 2), "one doubling: 3.0% + 0.75% fits"
    assert dynamic.after_recovery(report(40, 1000), accumulated_plt=0.034)  # needs 4.0% -> 1.0% -> 0.5% -> 0.25%
    assert (dynamic.k_snapshot, dynamic.k_persist) == (8, 8), "doubles until it fits or K = N"
    assert not dynamic.after_recovery(report(100, 1000), accumulated_plt=0.5)
    assert (dynamic.k_snapshot, dynamic.k_persist) == (8, 8)


def test_dynamic_k_state_survives_restarts() -> None:
    dynamic = DynamicK(k_snapshot=1, k_persist=1, num_experts=4, threshold=0.1)
    dynamic.after_recovery(report(8, 100), accumulated_plt=0.08)
    restored = DynamicK(k_snapshot=1, k_persist=1, num_experts=4, threshold=0.1)
    restored.load_state_dict(dynamic.state_dict())
    assert (restored.k_snapshot, restored.k_persist) == (dynamic.k_snapshot, dynamic.k_persist) == (4, 4)


@pytest.mark.parametrize(
    ("k_snapshot", "k_persist", "message"),
    [
        (0, 1, r"k_snapshot must be in \[1, 8\] \(experts per MoE layer\), got 0"),
        (9, 1, r"k_snapshot must be in \[1, 8\] \(experts per MoE layer\), got 9"),
        (4, 0, r"k_persist must be in \[1, k_snapshot=4\], got 0"),
        (4, 5, r"k_persist must be in \[1, k_snapshot=4\], got 5"),
    ],
)
def test_k_validation_names_option_and_range(k_snapshot: int, k_persist: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_k(k_snapshot, k_persist, 8)
    with pytest.raises(ValueError, match=message):
        DynamicK(k_snapshot=k_snapshot, k_persist=k_persist, num_experts=8)


def test_dynamic_k_threshold_validation() -> None:
    with pytest.raises(ValueError, match=r"plt_threshold must be in \(0, 1\), got 1.5"):
        DynamicK(k_snapshot=1, k_persist=1, num_experts=8, threshold=1.5)
