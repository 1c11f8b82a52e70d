from collections.abc import Mapping

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moc_lightning.engine.layout import Layout, build_layout
from moc_lightning.engine.units import DenseUnit, ExpertUnit, dense, expert


def model_from_names(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A module tree whose named parameters are exactly ``shapes`` (in order), like any real model's."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape, dtype=dtype)))
    return root


def stepped(
    model: nn.Module, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: float
) -> torch.optim.Optimizer:
    """One optimizer step so that per-parameter state exists."""
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


def reference_names(experts: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    shapes = {"model.wte.weight": (10, 4), "model.wpe.weight": (8, 4)}
    for block in range(2):
        p = f"model.blocks.{block}"
        shapes |= {
            f"{p}.ln1.weight": (4,),
            f"{p}.ln1.bias": (4,),
            f"{p}.attn.qkv.weight": (12, 4),
            f"{p}.attn.proj.weight": (4, 4),
        }
        shapes |= {f"{p}.ln2.weight": (4,), f"{p}.ln2.bias": (4,)}
        if block == 0:
            shapes |= {f"{p}.mlp.fc.weight": (8, 4), f"{p}.mlp.proj.weight": (4, 8)}
        else:
            shapes[f"{p}.moe.router.weight"] = (4, 4)
            for e in experts:
                shapes |= {f"{p}.moe.experts.{e}.fc.weight": (8, 4), f"{p}.moe.experts.{e}.fc.bias": (8,)}
                shapes |= {f"{p}.moe.experts.{e}.proj.weight": (4, 8), f"{p}.moe.experts.{e}.proj.bias": (4,)}
    return shapes | {"model.ln_f.weight": (4,), "model.ln_f.bias": (4,)}


def per_module_names(
    block: str, moe: str, expert: str, router: str, leaves: tuple[str, ...]
) -> dict[str, tuple[int, ...]]:
    """Two transformer blocks, each with attention, a norm, a router and two experts."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (10, 4)}
    for l in range(2):
        b = block.format(l=l)
        shapes |= {
            f"{b}.self_attn.q_proj.weight": (4, 4),
            f"{b}.input_layernorm.weight": (4,),
            f"{b}.{moe}.{router}": (2, 4),
        }
        for e in range(2):
            shapes |= {f"{b}.{moe}.{expert.format(e=e)}.{leaf}": (6, 4) for leaf in leaves}
    return shapes | {"model.norm.weight": (4,), "lm_head.weight": (10, 4)}


PRESET_LAYOUTS = {  # style: (block, MoE module under it, expert path under that, router, parameters of an expert)
    "mixtral": ("model.layers.{l}", "block_sparse_moe", "experts.{e}", "gate.weight", ("w1.weight", "w2.weight")),
    "qwen": ("model.layers.{l}", "mlp", "experts.{e}", "gate.weight", ("gate_proj.weight", "down_proj.weight")),
    "deepspeed": (
        "layers.{l}",
        "mlp.deepspeed_moe",
        "experts.deepspeed_experts.{e}",
        "gate.wg.weight",
        ("dense_h_to_4h.weight",),
    ),
    "megatron": (
        "decoder.layers.{l}",
        "mlp",
        "experts.local_experts.{e}",
        "router.weight",
        ("linear_fc1.weight", "linear_fc2.weight"),
    ),
}


def assert_partition(layout: Layout, model: nn.Module) -> None:
    """Every named parameter is owned by exactly one unit (whole, or one slice per expert when stacked, along
    dim 0 or along the expert dim of its view when flattened)."""
    owners: dict[str, list[int | None]] = {}
    experts: dict[str, int] = {}
    for unit in layout.units:
        for slot in layout.slots[unit]:
            owners.setdefault(slot.param, []).append(slot.index)
            experts[slot.param] = slot.view[0] if slot.view else dict(model.named_parameters())[slot.param].shape[0]
    assert set(owners) == {name for name, _ in model.named_parameters()}
    for name, indices in owners.items():
        assert indices == [None] or sorted(indices) == list(range(experts[name])), name


def test_reference_model_units_and_global_ids_under_ep() -> None:
    model = model_from_names(reference_names(experts=(2, 3)))
    layout = build_layout(model, stepped(model), num_experts=4)
    assert_partition(layout, model)
    assert layout.expert_units == (expert(0, 2), expert(0, 3))
    assert layout.dense_units == tuple(
        sorted(
            dense(n)
            for n in [
                "model.wte",
                "model.wpe",
                "model.ln_f",
                "model.blocks.0.ln1",
                "model.blocks.0.attn",
                "model.blocks.0.ln2",
                "model.blocks.0.mlp",
                "model.blocks.1.ln1",
                "model.blocks.1.attn",
                "model.blocks.1.ln2",
                "model.blocks.1.moe.router",
            ]
        )
    )
    (layer,) = layout.moe_layers
    assert (layer.index, layer.prefix, layer.num_experts, layer.local_experts) == (0, "model.blocks.1.moe", 4, (2, 3))
    keys = set(layout.tensors([expert(0, 3)]))
    assert {
        "expert/L0/E3/param/fc.weight",
        "expert/L0/E3/optim/fc.weight/exp_avg",
        "expert/L0/E3/optim/fc.weight/exp_avg_sq",
        "expert/L0/E3/optim/fc.weight/step",
    } <= keys
    assert len(keys) == 4 * 4  # fc/proj weight/bias, each with the weight and three AdamW state tensors


@pytest.mark.parametrize("style", sorted(PRESET_LAYOUTS))
@pytest.mark.parametrize("preset", ["auto", "per_module"])
def test_per_module_presets(style: str, preset: str) -> None:
    block, moe, expert_path, router, leaves = PRESET_LAYOUTS[style]
    model = model_from_names(per_module_names(block, moe, expert_path, router, leaves))
    layout = build_layout(model, stepped(model), preset=preset)
    assert_partition(layout, model)
    assert [l.prefix for l in layout.moe_layers] == [f"{block.format(l=l)}.{moe}" for l in range(2)]
    assert layout.expert_units == (expert(0, 0), expert(0, 1), expert(1, 0), expert(1, 1))
    assert {s.local_name for s in layout.slots[expert(1, 1)]} == set(leaves)
    assert dense(f"{block.format(l=1)}.{moe}.{router.split('.')[0]}") in layout.dense_units
    assert {dense("model.embed_tokens"), dense("model.norm"), dense("lm_head")} <= set(layout.dense_units)
    b0 = block.format(l=0)
    assert layout.param_names(dense(f"{b0}.self_attn")) == (f"{b0}.self_attn.q_proj.weight",)
    assert layout.param_names(dense(f"{b0}.input_layernorm")) == (f"{b0}.input_layernorm.weight",)


def test_qwen_shared_expert_is_dense() -> None:
    model = model_from_names(
        {
            "m.layers.0.mlp.experts.0.up.weight": (2, 2),
            "m.layers.0.mlp.shared_expert.up.weight": (2, 2),
            "m.layers.0.mlp.shared_expert_gate.weight": (1, 2),
        }
    )
    layout = build_layout(model, None)
    assert layout.dense_units == (dense("m.layers.0.mlp.shared_expert"), dense("m.layers.0.mlp.shared_expert_gate"))


def test_local_expert_indices_with_offset_int_and_callable() -> None:
    model = model_from_names(per_module_names(*PRESET_LAYOUTS["megatron"]))
    by_int = build_layout(model, None, expert_offset=2, num_experts=4)
    assert by_int.expert_units == (expert(0, 2), expert(0, 3), expert(1, 2), expert(1, 3))
    assert [l.local_experts for l in by_int.moe_layers] == [(2, 3), (2, 3)]
    by_layer = build_layout(
        model, None, expert_offset=lambda prefix: 2 if prefix.endswith("1.mlp") else 0, num_experts=4
    )
    assert by_layer.expert_units == (expert(0, 0), expert(0, 1), expert(1, 2), expert(1, 3))
    with pytest.raises(ValueError, match=r"global expert ids \[2, 3\] but num_experts=3"):
        build_layout(model, None, expert_offset=2, num_experts=3)


def stacked_model(num_local: int = 3, router_outputs: int = 8) -> nn.Module:
    return model_from_names(
        {
            "model.embed.weight": (10, 4),
            "model.layers.0.attn.qkv.weight": (12, 4),
            "model.layers.0.mlp.gate.weight": (router_outputs, 4),
            "model.layers.0.mlp.experts.w1": (num_local, 4, 6),
            "model.layers.0.mlp.experts.w2": (num_local, 6, 4),
        }
    )


def test_stacked_experts_are_views_of_dim0_slices_with_sliced_adam_state() -> None:
    model = stacked_model()
    optimizer = stepped(model, torch.optim.Adam)
    layout = build_layout(model, optimizer, preset="stacked", expert_offset=5, num_experts=8)
    assert_partition(layout, model)
    assert layout.expert_units == (expert(0, 5), expert(0, 6), expert(0, 7))
    slot = next(s for s in layout.slots[expert(0, 6)] if s.local_name == "w1")
    assert (slot.param, slot.index, slot.is_view) == ("model.layers.0.mlp.experts.w1", 1, True)

    w1 = dict(model.named_parameters())["model.layers.0.mlp.experts.w1"]
    tensors = layout.tensors([expert(0, 6)])
    torch.testing.assert_close(tensors["expert/L0/E6/param/w1"], w1[1])
    torch.testing.assert_close(tensors["expert/L0/E6/optim/w1/exp_avg"], optimizer.state[w1]["exp_avg"][1])
    assert tensors["expert/L0/E6/optim/w1/step"] is optimizer.state[w1]["step"]  # scalar state is shared
    tensors["expert/L0/E6/param/w1"].fill_(7.0)
    assert bool((w1[1] == 7.0).all()) and not bool((w1[0] == 7.0).any())

    sizes = layout.unit_bytes(expert(0, 6))
    assert sizes.weights == (4 * 6 + 6 * 4) * 4
    assert sizes.optimizer == 2 * (4 * 6 + 6 * 4) * 4 + 2 * optimizer.state[w1]["step"].element_size()


def test_auto_preset_finds_stacked_and_dense_names() -> None:
    layout = build_layout(stacked_model(2, router_outputs=2), None)
    assert layout.expert_units == (expert(0, 0), expert(0, 1))
    assert layout.dense_units == (dense("model.embed"), dense("model.layers.0.attn"), dense("model.layers.0.mlp.gate"))


def test_custom_regex_and_double_match_and_no_experts_errors() -> None:
    model = model_from_names(
        {"net.0.ffn.e3.weight": (2, 2), "net.0.ffn.e4.weight": (2, 2), "net.0.attn.weight": (2, 2)}
    )
    layout = build_layout(model, None, preset=r"(?P<layer>.+\.ffn)\.e(?P<expert>\d+)\.", num_experts=5)
    assert layout.expert_units == (expert(0, 3), expert(0, 4))
    assert (layout.moe_layers[0].prefix, layout.moe_layers[0].num_experts) == ("net.0.ffn", 5)
    with pytest.raises(ValueError, match=r"'net\.0\.ffn\.e3\.weight' matches more than one expert pattern"):
        build_layout(
            model, None, preset=[r"(?P<layer>.+\.ffn)\.e(?P<expert>\d+)\.", r"(?P<layer>net\.0\.ffn)\.e(?P<expert>3)\."]
        )
    with pytest.raises(ValueError, match=r"no expert parameters found .*none looks like an expert or a router"):
        build_layout(model_from_names({"net.0.attn.weight": (2, 2)}), None)
    with pytest.raises(ValueError, match="named group 'layer'"):
        build_layout(model, None, preset=r"net\.0\.ffn\.e(?P<expert>\d+)\.")
    with pytest.raises(
        ValueError, match=r"neither one of \['auto', 'per_module', 'stacked'\] nor a valid regular expression"
    ):
        build_layout(model, None, preset="per_modul(")


def test_expert_ids_not_in_range_without_num_experts_are_rejected() -> None:
    model = model_from_names({"net.0.ffn.e3.weight": (2, 2), "net.0.ffn.e4.weight": (2, 2)})
    with pytest.raises(ValueError, match=r"global expert ids \[3, 4\] but num_experts=2"):
        build_layout(model, None, preset=r"(?P<layer>.+\.ffn)\.e(?P<expert>\d+)\.")


def test_bytes_are_read_from_real_tensors_and_sgd_momentum_follows_its_parameter() -> None:
    model = model_from_names(reference_names(experts=(0, 1)), dtype=torch.float64)
    layout = build_layout(model, stepped(model, torch.optim.SGD, momentum=0.9))
    sizes = layout.unit_bytes(expert(0, 1))
    numel = 8 * 4 + 8 + 4 * 8 + 4
    assert (sizes.weights, sizes.optimizer, sizes.weight_numel) == (numel * 8, numel * 8, numel)
    assert "expert/L0/E1/optim/fc.weight/momentum_buffer" in layout.tensors([expert(0, 1)])
    assert build_layout(model, None).unit_bytes(expert(0, 1)).optimizer == 0


def test_copy_in_restores_one_unit_in_place_and_rejects_unknown_keys() -> None:
    model = model_from_names(reference_names(experts=(0, 1)))
    optimizer = stepped(model)
    layout = build_layout(model, optimizer)
    saved = {k: v.clone() for k, v in layout.tensors([expert(0, 1), dense("model.wte")]).items()}
    untouched = {k: v.clone() for k, v in layout.tensors([expert(0, 0)]).items()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    layout.copy_in(saved)
    for key, value in layout.tensors([expert(0, 1), dense("model.wte")]).items():
        torch.testing.assert_close(value, saved[key])
    assert not torch.equal(
        layout.tensors([expert(0, 0)])["expert/L0/E0/param/fc.weight"], untouched["expert/L0/E0/param/fc.weight"]
    )
    with pytest.raises(KeyError, match="expert/L0/E1/optim/fc.weight/nope"):
        layout.copy_in({"expert/L0/E1/optim/fc.weight/nope": torch.zeros(1)})
    with pytest.raises(KeyError, match="does not hold"):
        layout.copy_in({"expert/L0/E9/param/fc.weight": torch.zeros(1)})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip_loads_in_place_including_stacked_views(tmp_path: object) -> None:
    model = stacked_model(router_outputs=3)
    optimizer = stepped(model, torch.optim.Adam)
    layout = build_layout(model, optimizer)
    units = [expert(0, 1), dense("model.embed")]
    saved = {k: v.clone() for k, v in layout.tensors(units).items()}
    dcp.save(layout.tensors(units), checkpoint_id=str(tmp_path))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    other = layout.tensors([expert(0, 0)])["expert/L0/E0/param/w1"].clone()
    dcp.load(layout.tensors(units), checkpoint_id=str(tmp_path))
    for key, value in layout.tensors(units).items():
        torch.testing.assert_close(value, saved[key], msg=key)
    torch.testing.assert_close(layout.tensors([expert(0, 0)])["expert/L0/E0/param/w1"], other)


STATE_NAMES = {"m.0.attn.w": (3, 2), "m.0.moe.experts.w1": (2, 4, 3), "m.0.moe.experts.b": (2,), "m.0.mlp.w": (2,)}
"""The model of the optimizer-state creation tests: a dense weight, a stacked weight and a stacked 1-D parameter,
and ``m.0.mlp.w``, which the source holds no state for."""


def _stored_source_layout() -> Layout:
    """The layout the stored state comes from: a stepped optimizer with no state for ``m.0.mlp.w`` (e.g. frozen)."""
    model = model_from_names(STATE_NAMES)
    optimizer = stepped(model)
    optimizer.state.pop(dict(model.named_parameters())["m.0.mlp.w"])
    return build_layout(model, optimizer)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _state_tensors(layout: Layout) -> dict[str, torch.Tensor]:
    return {key: tensor for key, tensor in layout.tensors().items() if "/optim/" in key}


def _assert_created_state(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor]) -> None:
    """What creating state from the source's stored tensors must give, however they are given: no state where the
    source had none, a stacked parameter's state whole with its step a shared scalar on the host, and the model's
    ``weights`` untouched."""
    params = dict(model.named_parameters())
    assert params["m.0.mlp.w"] not in optimizer.state
    w1 = optimizer.state[params["m.0.moe.experts.w1"]]
    assert w1["exp_avg"].shape == (2, 4, 3) and w1["step"].shape == () and w1["step"].device.type == "cpu"
    for name, p in params.items():
        assert torch.equal(p.detach(), weights[name]), name


def test_reset_optimizer_state_creates_exactly_the_stored_state_without_stepping() -> None:
    """From stored keys, shapes and dtypes alone: stacked state whole, a shared scalar step on the host, a
    parameter the source has no state for without state, weights and hyperparameters untouched."""
    specs = {k: (tuple(t.shape), t.dtype) for k, t in _stored_source_layout().tensors().items()}

    model = model_from_names(STATE_NAMES)
    optimizer = stepped(model)  # holds state of other values, and for every parameter
    weights = _weights(model)
    optimizer.step = None  # type: ignore[method-assign]  # never called
    layout = build_layout(model, optimizer)
    layout.reset_optimizer_state(layout.units, specs)
    _assert_created_state(model, optimizer, weights)
    b = optimizer.state[dict(model.named_parameters())["m.0.moe.experts.b"]]
    assert b["exp_avg"].shape == (2,), "a stacked 1-D parameter"
    assert b["step"].shape == (), "its step is shared, not sliced"
    assert {k: (tuple(t.shape), t.dtype) for k, t in layout.tensors().items()} == specs
    assert all(float(t.abs().sum()) == 0 for t in _state_tensors(layout).values())


@pytest.mark.usefixtures("poisoned_empty")
def test_restore_optimizer_state_creates_the_restored_tensors_bitwise() -> None:
    """A fresh optimizer's state created from restored tensors is exactly them (allocated uninitialised, every byte
    then copied): stacked state whole from its experts' slices, the shared scalar step on the host, a parameter the
    restore holds no state for without state, weights untouched."""
    saved = {k: t.clone() for k, t in _state_tensors(_stored_source_layout()).items()}

    model = model_from_names(STATE_NAMES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a restarted process: no state yet
    weights = _weights(model)
    layout = build_layout(model, optimizer)
    layout.restore_optimizer_state(layout.units, saved)
    _assert_created_state(model, optimizer, weights)
    got = _state_tensors(layout)
    assert sorted(got) == sorted(saved)
    for key, value in saved.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.usefixtures("poisoned_empty")
def test_a_partly_restored_stacked_state_is_zero_where_nothing_was_restored() -> None:
    """Restoring one expert of a stacked parameter creates the parameter's state whole: the other experts' slices
    are zeros (as :meth:`Layout.reset_optimizer_state` makes them), never uninitialised memory."""
    source_model = stacked_model(router_outputs=3)
    saved = _state_tensors(build_layout(source_model, stepped(source_model, torch.optim.Adam)))
    restored = {k: t for k, t in saved.items() if k.startswith(expert(0, 1).key + "/")}

    model = stacked_model(router_outputs=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    layout = build_layout(model, optimizer)
    layout.restore_optimizer_state([expert(0, 1)], restored)

    w1 = optimizer.state[dict(model.named_parameters())["model.layers.0.mlp.experts.w1"]]
    assert torch.equal(w1["exp_avg"][1], restored["expert/L0/E1/optim/w1/exp_avg"])
    assert torch.equal(w1["step"], restored["expert/L0/E1/optim/w1/step"])
    for e in (0, 2):
        assert bool((w1["exp_avg"][e] == 0).all()) and bool((w1["exp_avg_sq"][e] == 0).all()), e
    assert dict(model.named_parameters())["model.embed.weight"] not in optimizer.state, "not among the units"
    with pytest.raises(ValueError, match=r"\['expert/L0/E2/optim/w1/exp_avg'.* belongs to no parameter of the units"):
        layout.restore_optimizer_state([expert(0, 1)], {k: t for k, t in saved.items() if "/E2/" in k})


def test_unit_kinds() -> None:
    layout = build_layout(model_from_names(reference_names(experts=(0,))), None)
    assert all(isinstance(u, ExpertUnit) for u in layout.expert_units)
    assert all(isinstance(u, DenseUnit) for u in layout.dense_units)
    assert layout.units == layout.dense_units + layout.expert_units


def test_reference_gpt_moe_on_ep_rank_1() -> None:
    gpt_moe = pytest.importorskip("moc_lightning.models.gpt_moe")
    parallel = pytest.importorskip("moc_lightning.runtime.expert_parallel")
    cfg = gpt_moe.GPTMoEConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=8, num_experts=4)
    holder = nn.Module()
    holder.model = gpt_moe.GPTMoE(cfg, parallel.ExpertParallelTopology(world_size=2, rank=1, ep=2))
    layout = build_layout(holder, stepped(holder), num_experts=4)
    assert_partition(layout, holder)
    assert [(l.prefix, l.local_experts) for l in layout.moe_layers] == [
        ("model.blocks.1.moe", (2, 3)),
        ("model.blocks.3.moe", (2, 3)),
    ]
    assert layout.expert_units == (expert(0, 2), expert(0, 3), expert(1, 2), expert(1, 3))
    assert dense("model.blocks.3.moe.router") in layout.dense_units


def test_inconsistent_experts_and_shape_mismatches_are_rejected() -> None:
    uneven_stack = model_from_names({"m.0.mlp.experts.w1": (3, 2), "m.0.mlp.experts.w2": (2, 2)})
    with pytest.raises(ValueError, match=r"tensors of MoE layer 'm\.0\.mlp' do not agree on the number of experts"):
        build_layout(uneven_stack, None)
    layout = build_layout(model_from_names(reference_names(experts=(0, 1))), None)
    with pytest.raises(ValueError, match=r"'expert/L0/E1/param/fc\.bias', \[1\], \[8\]"):
        layout.copy_in({"expert/L0/E1/param/fc.bias": torch.zeros(1)})
    folded = model_from_names({"m.0.moe.experts.0.w": (2,), "m.0.moe.experts.00.w": (2,)})
    with pytest.raises(
        ValueError,
        match=r"'m\.0\.moe\.experts\.0\.w' and 'm\.0\.moe\.experts\.00\.w' both map to 'expert/L0/E0/param/w'",
    ):
        build_layout(folded, None)


def test_a_bias_vector_is_not_taken_for_experts_and_jetmoe_experts_are_found() -> None:
    """JetMoe: its attention's ``experts.bias`` is a [hidden] vector; the experts are ``{input,output}_linear``
    of the mixture of attention heads and of the MLP, each layer with its own router."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (10, 64)}
    for module, inner in (("self_attention.experts", 16), ("mlp", 32)):
        p = f"model.layers.0.{module}"
        shapes |= {
            f"{p}.bias": (64,),
            f"{p}.input_linear.weight": (4, inner, 64),
            f"{p}.output_linear.weight": (4, 64, inner // 2 if module == "mlp" else inner),
            f"{p}.router.layer.weight": (4, 64),
        }
    shapes["model.layers.0.self_attention.kv_proj.weight"] = (32, 64)
    model = model_from_names(shapes)
    layout = build_layout(model, stepped(model))
    assert_partition(layout, model)
    assert [(l.prefix, l.num_experts, l.router) for l in layout.moe_layers] == [
        ("model.layers.0.self_attention.experts", 4, "model.layers.0.self_attention.experts.router"),
        ("model.layers.0.mlp", 4, "model.layers.0.mlp.router"),
    ]
    assert sorted(s.local_name for s in layout.slots[expert(1, 3)]) == ["input_linear.weight", "output_linear.weight"]
    owner = {s.param: u for u in layout.units for s in layout.slots[u]}
    assert isinstance(owner["model.layers.0.self_attention.experts.bias"], DenseUnit)
    assert isinstance(owner["model.layers.0.mlp.bias"], DenseUnit)


def test_granitemoe_4x_stacked_input_output_linear_are_experts() -> None:
    model = model_from_names(
        {
            "model.layers.0.self_attn.q_proj.weight": (8, 8),
            "model.layers.0.block_sparse_moe.input_linear.weight": (4, 12, 8),
            "model.layers.0.block_sparse_moe.output_linear.weight": (4, 8, 6),
            "model.layers.0.block_sparse_moe.router.layer.weight": (4, 8),
        }
    )
    layout = build_layout(model, None)
    assert layout.expert_units == tuple(expert(0, e) for e in range(4))
    assert layout.moe_layers[0].router == "model.layers.0.block_sparse_moe.router"
    assert dense("model.layers.0.block_sparse_moe.router") in layout.dense_units


def dbrx_model() -> nn.Module:
    """DBRX's experts: ``w1``/``v1``/``w2`` flattened to ``[E*I, H]`` (E=4, I=6, H=8), a router of 4 outputs."""
    shapes = {f"transformer.blocks.0.ffn.experts.mlp.{w}": (4 * 6, 8) for w in ("w1", "v1", "w2")}
    return model_from_names({"transformer.wte.weight": (10, 8), "transformer.blocks.0.ffn.router.layer.weight": (4, 8)}
                            | shapes)


def test_flattened_dbrx_experts_are_sliced_through_an_expert_view_with_their_adam_state() -> None:
    model = dbrx_model()
    optimizer = stepped(model, torch.optim.Adam)
    layout = build_layout(model, optimizer)
    assert_partition(layout, model)
    assert [(l.prefix, l.num_experts) for l in layout.moe_layers] == [("transformer.blocks.0.ffn", 4)]
    w1 = dict(model.named_parameters())["transformer.blocks.0.ffn.experts.mlp.w1"]
    tensors = layout.tensors([expert(0, 2)])
    assert torch.equal(tensors["expert/L0/E2/param/w1"], w1.detach()[12:18])
    assert torch.equal(tensors["expert/L0/E2/optim/w1/exp_avg"], optimizer.state[w1]["exp_avg"][12:18])
    tensors["expert/L0/E2/param/w1"].fill_(7.0)
    assert bool((w1[12:18] == 7.0).all()) and not bool((w1[:12] == 7.0).any()) and not bool((w1[18:] == 7.0).any())
    assert layout.unit_bytes(expert(0, 2)).weights == 3 * 6 * 8 * 4

    specs = {k: (tuple(t.shape), t.dtype) for k, t in layout.tensors().items()}
    fresh = dbrx_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh_layout = build_layout(fresh, fresh_optimizer)
    fresh_layout.reset_optimizer_state(fresh_layout.units, specs)
    fresh_w1 = dict(fresh.named_parameters())["transformer.blocks.0.ffn.experts.mlp.w1"]
    assert fresh_optimizer.state[fresh_w1]["exp_avg"].shape == (24, 8), "created whole, not as one expert's slice"
    assert {k: (tuple(t.shape), t.dtype) for k, t in fresh_layout.tensors().items()} == specs


def test_a_stacked_claim_must_agree_with_its_router() -> None:
    model = model_from_names({"m.0.mlp.gate.weight": (5, 4), "m.0.mlp.experts.w1": (3, 4, 2)})
    with pytest.raises(ValueError, match=r"layer 'm\.0\.mlp' do not agree .* router 'm\.0\.mlp\.gate' has 5 outputs"):
        build_layout(model, None)
    flattened_wrong = model_from_names({"m.0.mlp.gate.weight": (4, 4), "m.0.mlp.experts.w1": (6, 4)})
    with pytest.raises(ValueError, match=r"do not agree on the number of experts"):
        build_layout(flattened_wrong, None)


def test_no_experts_error_lists_moe_looking_names_and_a_regex_that_works() -> None:
    shapes = {"net.0.attn.weight": (2, 2), "net.0.embed.weight": (2, 2), "net.0.ffn.selector.weight": (2, 2)}
    shapes |= {f"net.0.ffn.moe_experts.{e}.w": (2, 2) for e in range(2)}
    model = model_from_names(shapes)
    with pytest.raises(ValueError) as raised:
        build_layout(model, None)
    message = str(raised.value)
    assert "net.0.ffn.moe_experts.0.w" in message and "net.0.attn.weight" not in message
    suggested = r"(?P<layer>.+?)\.moe_experts\.(?P<expert>\d+)\."
    assert repr(suggested) in message
    assert build_layout(model, None, preset=suggested).expert_units == (expert(0, 0), expert(0, 1))


def test_a_tied_head_is_an_alias_of_the_embedding_it_shares() -> None:
    """``named_parameters()`` lists a tied tensor once, ``state_dict()`` under both names: the layout keeps the
    other name, so a consolidated checkpoint can hold both (the model's ``load_state_dict`` wants both)."""
    model = model_from_names({"embed.weight": (10, 4), "moe.experts.0.fc.weight": (4, 4), "head.weight": (10, 4)})
    model.head.weight = model.embed.weight
    layout = build_layout(model, None)
    assert layout.aliases == {"head.weight": "embed.weight"}
    assert "head.weight" not in {slot.param for slots in layout.slots.values() for slot in slots}
    assert build_layout(model_from_names(reference_names((0, 1))), None).aliases == {}
