"""``moc-consolidate --format hf`` (issue 13, item 4): Hugging Face MoEs trained with ``MoCCheckpoint`` come back
through ``from_pretrained`` with the live model's logits, bit for bit, and every format holds their buffers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning_run import cpu_trainer, moc_config
from safetensors.torch import load_file

from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.export.consolidate import OPTIMIZER_KEY, consolidate, main
from moc_lightning.export.hf_format import CONFIG, INDEX
from moc_lightning.lightning.callback import MoCCheckpoint

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install 'moc_lightning[hf]'")
from test_hf_families import FAMILIES, VOCAB, Wrapped  # noqa: E402
from test_hf_families import N as N_EXPERTS  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from moc_lightning.models.hf import HFCausalLMModule, HFModelConfig, build_model  # noqa: E402

DEEPSEEK_V3 = HFModelConfig(
    model_type="deepseek_v3",
    block_size=16,
    config={
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "kv_lora_rank": 8, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    },
)
MIXTRAL = HFModelConfig(
    model_type="mixtral",
    block_size=16,
    config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
)
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
"""DeepSeek-V3's load-balancing bias of its MoE layer's router: a persistent buffer, not a parameter."""


class PersistsLand(L.Callback):
    """Waits before every step for MoC's background persist, so none is skipped for being in flight."""

    def __init__(self, moc: MoCCheckpoint) -> None:
        self.moc = moc

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.moc.engine.finish()


@dataclass
class Trained:
    """A finished in-process run: its module (the live model) and its MoC storage root."""

    module: HFCausalLMModule
    url: str
    tmp: Path


def _train(tmp_path: Path, cfg: HFModelConfig, steps: int, **options: Any) -> Trained:
    """Fit ``cfg`` (seed 0) on the shipped corpus, one process, a snapshot every 2 steps, each persisted."""
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # a bias that is not its initial zeros: loading without it would change the logits
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    module = HFCausalLMModule(model)
    config = moc_config(tmp_path, every_n_train_steps=2, persist_every_n_snapshots=1, k_snapshot=2, k_persist=2, **options)
    data = LMDataModule(DataConfig(batch_size=4), block_size=cfg.block_size, vocab_size=cfg.vocab_size)
    moc = MoCCheckpoint(config)
    cpu_trainer(tmp_path / "run", steps, [moc, PersistsLand(moc)]).fit(module, datamodule=data)
    return Trained(module, config.storage.url, tmp_path)


def _from_pretrained(path: Path) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path)``, each tensor then copied into memory of its own.

    ``from_pretrained`` keeps the tensors in the safetensors file's mapping, where they lie wherever the header's
    length puts them (24 bytes past a 64-byte boundary here), and on an AVX-512 host torch's kernels round
    unaligned inputs differently (logits 3e-8 apart, from bitwise-equal weights). A fresh allocation is aligned like
    the live model's, so the logits compare bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model


@torch.no_grad()
def _logits(model: PreTrainedModel) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    return model.eval()(input_ids=tokens, use_cache=False).logits


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """DeepSeek-V3 trained 4 steps; its last step is persisted whole when fit ends."""
    return _train(tmp_path_factory.mktemp("deepseek"), DEEPSEEK_V3, steps=4)


def test_hf_directory_loads_with_from_pretrained_and_gives_the_live_logits(deepseek: Trained, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    main([deepseek.url, "--out", str(out), "--format", "hf", "--max-shard-size", "40KB"])
    live = deepseek.module.model
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"]) == set(live.state_dict()), "the model's own names: no 'model.' prefix"
    assert BIAS in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1, "sharded at 40 KB"
    assert json.loads((out / CONFIG).read_text())["architectures"] == ["DeepseekV3ForCausalLM"]

    loaded = _from_pretrained(out)
    assert type(loaded) is type(live)
    assert torch.equal(loaded.get_buffer(BIAS), live.get_buffer(BIAS))
    assert torch.equal(_logits(loaded), _logits(live))


def test_every_format_holds_the_persistent_buffers(deepseek: Trained, tmp_path: Path) -> None:
    expected = deepseek.module.state_dict()  # parameters and persistent buffers, under the module's names
    assert f"model.{BIAS}" in expected

    consolidate(deepseek.url, tmp_path / "dense.ckpt", "lightning", progress=False)
    lightning = torch.load(tmp_path / "dense.ckpt", weights_only=True)["state_dict"]
    consolidate(deepseek.url, tmp_path / "dense.safetensors", "safetensors", progress=False)
    safetensors = load_file(tmp_path / "dense.safetensors")
    consolidate(deepseek.url, tmp_path / "dense", "dcp", progress=False)
    in_dcp = {name: torch.empty_like(t) for name, t in expected.items()}
    dcp.load(in_dcp, checkpoint_id=tmp_path / "dense", no_dist=True)
    for fmt, weights in (("lightning", lightning), ("safetensors", safetensors), ("dcp", in_dcp)):
        assert weights.keys() == expected.keys(), fmt
        for name, tensor in expected.items():
            assert torch.equal(weights[name], tensor), f"{fmt}: {name}"


def test_bad_hf_options_fail_with_the_option_named(deepseek: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--format", "hf", "--max-shard-size", "big"], "--max-shard-size 'big' is not a size"),
        (["--format", "hf", "--prefix", "net"], "--prefix 'net.': tensors"),
        (["--format", "lightning", "--prefix", "model"], "--prefix applies to --format hf only, not --format lightning"),
    ]
    for options, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([deepseek.url, "--out", str(tmp_path / "x"), *options])
        assert exit_info.value.code == 1
        assert message in capsys.readouterr().err


def test_experts_from_older_persists_give_the_recovered_model(tmp_path: Path) -> None:
    """Mixtral with K=2 of 8 and no final full persist: the consolidated experts come from four persists, and
    ``from_pretrained`` gives the logits of the model a MoC recovery restores from the same storage."""
    trained = _train(tmp_path, MIXTRAL, steps=8, persist_on_fit_end=False)
    provenance = consolidate(trained.url, tmp_path / "hf", "hf", progress=False)
    assert len({step for unit, step in provenance["source_steps"].items() if unit.startswith("expert/")}) > 1

    torch.manual_seed(1)
    recovered = HFCausalLMModule(build_model(MIXTRAL))
    moc = MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=2, k_snapshot=2, k_persist=2, persist_on_fit_end=False))
    data = LMDataModule(DataConfig(batch_size=4), block_size=MIXTRAL.block_size, vocab_size=MIXTRAL.vocab_size)
    cpu_trainer(tmp_path / "run", 8, [moc]).fit(recovered, datamodule=data, ckpt_path=moc.resume_target())
    assert moc.recovery is not None and moc.recovery.resume_step == 8

    loaded = _from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(loaded), _logits(recovered.model))
    assert not torch.equal(_logits(loaded), _logits(trained.module.model)), "older experts: not the live model"


CONSOLIDATED = ("dbrx", "deepseek_v3", "jetmoe", "mixtral", "qwen3_moe", "torchtitan")
"""Families of ``test_hf_families`` whose consolidation is checked: every expert layout there is (fused ``[E, ...]``,
DBRX's flattened ``[E*I, H]``, JetMoe's two MoE layers per block, torchtitan's per-expert ``expert_bias``)."""


@pytest.mark.parametrize("name", CONSOLIDATED)
def test_each_family_consolidates_to_its_own_shapes_and_values(name: str, tmp_path: Path) -> None:
    """Two steps of the family under MoC (step 2 is the first persist: every unit); each format then holds every
    weight, buffer and optimizer tensor with the model's own shape and its live value, and a Hugging Face model
    comes back through ``from_pretrained`` with the live logits."""
    module = Wrapped(FAMILIES[name])
    config = moc_config(tmp_path, every_n_train_steps=2, persist_every_n_snapshots=1, k_snapshot=2, k_persist=2)
    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(tmp_path / "run", 2, [moc, PersistsLand(moc)])
    trainer.fit(module)
    live = module.state_dict()
    optimizer = trainer.optimizers[0]
    live_optimizer = {param: optimizer.state[p] for param, p in module.named_parameters() if p in optimizer.state}

    consolidate(config.storage.url, tmp_path / "dense.ckpt", "lightning", progress=False)
    dense = torch.load(tmp_path / "dense.ckpt", weights_only=True)
    consolidate(config.storage.url, tmp_path / "dense.safetensors", "safetensors", progress=False)
    safetensors = load_file(tmp_path / "dense.safetensors")
    for fmt, weights in (("lightning", dense["state_dict"]), ("safetensors", safetensors)):
        assert weights.keys() == live.keys(), fmt
        for param, tensor in live.items():
            assert weights[param].shape == tensor.shape, f"{fmt}: {param}"
            assert torch.equal(weights[param], tensor), f"{fmt}: {param}"
    stored_optimizer = dense[OPTIMIZER_KEY]
    assert stored_optimizer.keys() == live_optimizer.keys()
    for param, states in live_optimizer.items():
        assert stored_optimizer[param].keys() == states.keys(), param
        for state, tensor in states.items():
            assert stored_optimizer[param][state].shape == tensor.shape, f"{param} {state}"
            assert torch.equal(stored_optimizer[param][state], tensor), f"{param} {state}"

    if name == "torchtitan":  # no PreTrainedModel: the run records no config, nothing for from_pretrained
        assert dense["state_dict"]["model.layers.0.moe.expert_bias"].shape == (N_EXPERTS,)
        return
    main([config.storage.url, "--out", str(tmp_path / "hf"), "--format", "hf"])
    loaded = _from_pretrained(tmp_path / "hf")
    assert type(loaded) is type(module.model)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=tokens).logits, module.model.eval()(input_ids=tokens).logits)
