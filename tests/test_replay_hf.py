"""``checkpoint.mode=replay`` with MoE models nobody here wrote: Hugging Face Mixtral, Qwen3-MoE and DeepSeek-V3 from
tiny configs, as a user trains them (``HFCausalLMModule``, the module's defaults, nothing about experts declared).
``transformers`` 5 keeps each layer's experts STACKED, ``experts.gate_up_proj`` / ``experts.down_proj`` of shape
``[E, ...]`` (torchtitan's layout), so a window's units are slices of shared tensors; DeepSeek-V3 adds a persistent
router buffer (``e_score_correction_bias``) and every family the rotary buffers.

After a crash at a seeded random step past the first window, the resume replays the newest window and the run ends
bitwise on the uninterrupted run's state. The oracle is this file's own: every parameter and buffer by the module's
names and every optimizer tensor by ``optimizer.state_dict()``, not MoC's layout."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import Crash, cpu_trainer, moc_config

from moc_lightning.callback import MoCCheckpoint
from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.data import DataConfig, LMDataModule

pytest.importorskip("transformers", reason="the Hugging Face families need transformers (pip install 'moc_lightning[hf]')")
from moc_lightning.models.hf import HFCausalLMModule, HFModelConfig, build_model  # noqa: E402

MAX_STEPS = 9
WINDOW = 3
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "max_position_embeddings": 16, "num_experts_per_tok": 2}
MODELS = {
    "mixtral": HFModelConfig(model_type="mixtral", block_size=16, config={
        **SMALL, "num_key_value_heads": 1, "num_local_experts": 4,
        "output_router_logits": True, "router_aux_loss_coef": 0.01}),
    "qwen3_moe": HFModelConfig(model_type="qwen3_moe", block_size=16, config={
        **SMALL, "num_key_value_heads": 1, "moe_intermediate_size": 16, "num_experts": 4, "decoder_sparse_step": 1,
        "output_router_logits": True, "router_aux_loss_coef": 0.01}),
    "deepseek_v3": HFModelConfig(model_type="deepseek_v3", block_size=16, config={
        **SMALL, "num_key_value_heads": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
        "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 8,
        "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}),
}


def _crash_step() -> int:
    """A seeded random step after the first window is complete (``MOC_REPLAY_SEED`` picks another)."""
    seed = int(os.environ.get("MOC_REPLAY_SEED", "14"))
    step = random.Random(seed).randrange(WINDOW + 1, MAX_STEPS)
    print(f"seed {seed}: crash after step {step}")
    return step


class State(L.Callback):
    """Every parameter, buffer (persistent or not) and optimizer tensor after step ``at``, by torch's own names;
    optionally crashes after step ``crash_after`` once MoC's background writes have landed."""

    def __init__(self, at: int | None = None, crash_after: int | None = None) -> None:
        self.at, self.crash_after = at, crash_after
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at:
            tensors = {f"param/{k}": v for k, v in module.named_parameters()}
            tensors |= {f"buffer/{k}": v for k, v in module.named_buffers()}
            for index, state in trainer.optimizers[0].state_dict()["state"].items():
                tensors |= {f"optim/{index}/{k}": v for k, v in state.items() if torch.is_tensor(v)}
            self.state = {k: v.detach().clone() for k, v in tensors.items()}
        if trainer.global_step == self.crash_after:
            moc = next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint))
            moc.engine.finish()  # a killed process's writes in flight would not matter; here they must not race
            moc.windows.flush()
            raise Crash(f"killed after step {trainer.global_step}")


def _fit(root: Path, cfg: HFModelConfig, state: State) -> MoCCheckpoint:
    """One fit (seed 0, the shipped corpus, batches of 4) resuming where MoC says; the Trainer's defaults."""
    config: CheckpointConfig = moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))
    moc = MoCCheckpoint(config)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # a router bias that is not its initial zeros, so restoring it wrongly would show
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    data = LMDataModule(DataConfig(batch_size=4), block_size=cfg.block_size, vocab_size=cfg.vocab_size)
    trainer = cpu_trainer(root / "run", MAX_STEPS, [moc, state])
    trainer.fit(HFCausalLMModule(model), datamodule=data, ckpt_path=moc.resume_target())
    return moc


@pytest.mark.parametrize("family", sorted(MODELS))
def test_hf_moe_replay_resume_ends_bitwise_on_the_uninterrupted_state(tmp_path: Path, family: str) -> None:
    cfg = MODELS[family]
    straight = State(at=MAX_STEPS)
    _fit(tmp_path / "straight", cfg, straight)
    with pytest.raises(Crash):
        _fit(tmp_path / "faulty", cfg, State(crash_after=_crash_step()))
    resumed = State(at=MAX_STEPS)
    moc = _fit(tmp_path / "faulty", cfg, resumed)

    report = moc.replay_report
    assert report is not None and report.plt == 0.0
    assert report.replay_iterations == WINDOW - 1
    stacked = [k for k, v in straight.state.items() if k.startswith("param/") and ".experts." in k and v.dim() == 3]
    assert stacked, f"{family}: no stacked [E, ...] expert tensors; this test is about them"
    assert resumed.state.keys() == straight.state.keys()
    differ = sorted(k for k, v in straight.state.items() if not torch.equal(resumed.state[k], v))
    print(f"{family}: replayed {report.replay_iterations} iterations from step {report.window_start}; "
          f"{len(differ)} of {len(straight.state)} tensors differ")
    assert differ == []
