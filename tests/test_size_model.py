from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_layout import model_from_names, reference_names, stepped

from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.size_model import bytes_written, expected_bytes, size_model
from moc_lightning.engine.units import dense, expert

EXPERT_NUMEL = 8 * 4 + 8 + 4 * 8 + 4
"""fc.weight, fc.bias, proj.weight, proj.bias of one reference expert."""


def test_terms_read_from_tensors_and_eq5_is_exact_without_ep() -> None:
    model = model_from_names(reference_names(experts=(0, 1, 2, 3)))
    optimizer = stepped(model, torch.optim.Adam)
    layout = build_layout(model, optimizer)
    sm = size_model(layout)
    numel = sum(p.numel() for p in model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values()]
    assert (sm.p_e, sm.p_ne) == (4 * EXPERT_NUMEL, numel - 4 * EXPERT_NUMEL)
    assert sm.b_w == 4.0
    assert sm.b_o == pytest.approx(sum(t.numel() * t.element_size() for t in state) / numel)
    assert sm.c_full() == pytest.approx(expected_bytes(layout, layout.units))
    assert sm.c_pec(4) == pytest.approx(sm.c_full())
    assert sm.c_pec(1) == pytest.approx((sm.p_ne + sm.p_e / 4) * (sm.b_w + sm.b_o))
    assert sm.c_pec(1) < sm.c_pec(2) < sm.c_full()


def test_expert_params_count_all_n_experts_under_ep() -> None:
    model = model_from_names(reference_names(experts=(4, 5)))
    sm = size_model(build_layout(model, None, num_experts=8))
    assert (sm.p_e, sm.p_e_per_layer, sm.num_experts, sm.b_o) == (8 * EXPERT_NUMEL, (8 * EXPERT_NUMEL,), (8,), 0.0)


def test_unequal_experts_are_rejected() -> None:
    shapes = {"m.0.moe.experts.0.w": (2, 2), "m.0.moe.experts.1.w": (3, 2)}
    with pytest.raises(ValueError, match="differ in parameter count"):
        size_model(build_layout(model_from_names(shapes), None))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bytes_written_by_dcp_match_expected_bytes(tmp_path: Path) -> None:
    model = model_from_names(reference_names(experts=(0, 1, 2, 3)))
    layout = build_layout(model, stepped(model, torch.optim.Adam))
    units = [expert(0, 1), dense("model.wte")]
    dcp.save(layout.tensors(units), checkpoint_id=str(tmp_path))
    expected = expected_bytes(layout, units)
    assert expected == sum(t.numel() * t.element_size() for t in layout.tensors(units).values())
    metadata = (tmp_path / ".metadata").stat().st_size
    framing = 2048 * len(layout.tensors(units))  # DCP's file writer frames each tensor as a small torch.save
    assert expected <= bytes_written(tmp_path) - metadata < expected + framing
    before = bytes_written(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra").write_bytes(b"x" * 10)
    assert bytes_written(tmp_path) == before + 10
