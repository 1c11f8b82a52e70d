import pytest

from moc_lightning.engine.units import DenseUnit, ExpertUnit, dense, expert, parse_unit


def test_keys_are_stable_strings() -> None:
    assert expert(1, 3).key == "expert/L1/E3"
    assert dense("model.blocks.0.attn").key == "dense/model.blocks.0.attn"


@pytest.mark.parametrize("unit", [expert(0, 0), expert(11, 127), dense("model.wte"), dense("lm_head")])
def test_parse_back_from_unit_key_and_from_tensor_keys(unit: ExpertUnit | DenseUnit) -> None:
    assert parse_unit(unit.key) == unit
    assert parse_unit(f"{unit.key}/optim/fc.weight/exp_avg") == unit


@pytest.mark.parametrize(
    "key", ["expert/L1", "expert/L1/E3x", "expert/Lx/E3", "dense/", "weights/a", "expert/L1/E3.fc"]
)
def test_parse_rejects_non_unit_keys(key: str) -> None:
    with pytest.raises(ValueError, match="not a unit key"):
        parse_unit(key)


def test_hashable_and_equal_by_value() -> None:
    assert {expert(1, 2), expert(1, 2), dense("a"), dense("a")} == {ExpertUnit(1, 2), DenseUnit("a")}
    assert expert(1, 2) != expert(2, 1)
    assert dense("a") != expert(0, 0)


def test_order_dense_first_then_experts_by_layer_and_id_with_natural_names() -> None:
    units = [expert(1, 0), dense("blocks.10.attn"), expert(0, 10), expert(0, 2), dense("blocks.2.attn"), dense("wte")]
    assert sorted(units) == [
        dense("blocks.2.attn"),
        dense("blocks.10.attn"),
        dense("wte"),
        expert(0, 2),
        expert(0, 10),
        expert(1, 0),
    ]


def test_invalid_units_are_rejected() -> None:
    with pytest.raises(ValueError, match="layer >= 0"):
        expert(-1, 0)
    with pytest.raises(ValueError, match="without '/'"):
        dense("a/b")
    with pytest.raises(ValueError, match="non-empty"):
        dense("")
