"""``checkpoint.mode=replay`` with MoE models nobody here wrote: Hugging Face Mixtral, Qwen3-MoE and DeepSeek-V3 from
tiny configs, as a user trains them (``HFCausalLMModule``, the module's defaults, nothing about experts declared), and
a torchtitan-style MoE in the minimal module a user writes around it. ``transformers`` 5 keeps each layer's experts
STACKED, ``experts.gate_up_proj`` / ``experts.down_proj`` of shape ``[E, ...]``, as torchtitan's ``w1/w2/w3`` are, so
a window's units are slices of shared tensors, some of them frozen while others train. DeepSeek-V3 adds a persistent
router buffer (``e_score_correction_bias``); torchtitan's ``expert_bias`` buffer changes in every training forward.

After a crash at a seeded random step past the first window, the resume replays the newest window and the run ends
bitwise on the uninterrupted run's state. The oracle is this file's own: the module's ``state_dict()`` (every
parameter and persistent buffer, by torch's names) and every optimizer tensor of ``optimizer.state_dict()``, not
MoC's layout. Non-persistent buffers are left out, as every PyTorch checkpoint leaves them out: the toy torchtitan
model's ``tokens_per_expert`` counts tokens since the process started (torchtitan zeroes it every step)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import Crash, cpu_trainer, moc_config

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.data import DataConfig, LMDataModule, StatefulDataLoader
from moc_lightning.lightning.callback import MoCCheckpoint

pytest.importorskip(
    "transformers", reason="the Hugging Face families need transformers (pip install 'moc_lightning[hf]')"
)
from test_hf_families import BATCH, FAMILIES, SEQ, VOCAB, Wrapped  # noqa: E402

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
    """Every parameter, persistent buffer and optimizer tensor after step ``at``, by torch's own names;
    optionally crashes after step ``crash_after`` once MoC's background writes have landed."""

    def __init__(self, at: int | None = None, crash_after: int | None = None) -> None:
        self.at, self.crash_after = at, crash_after
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at:
            tensors = {f"module/{k}": v for k, v in module.state_dict().items()}
            for index, state in trainer.optimizers[0].state_dict()["state"].items():
                tensors |= {f"optim/{index}/{k}": v for k, v in state.items() if torch.is_tensor(v)}
            self.state = {k: v.detach().clone() for k, v in tensors.items()}
        if trainer.global_step == self.crash_after:
            moc = next(c for c in trainer.callbacks if isinstance(c, MoCCheckpoint))
            moc.engine.finish()  # a killed process's writes in flight would not matter; here they must not race
            moc.windows.flush()
            raise Crash(f"killed after step {trainer.global_step}")


class Titan(Wrapped):
    """``test_hf_families``'s minimal module around the torchtitan-style model, with a loader that resumes where it
    stopped (replay needs the batches again; a plain ``DataLoader`` starts its epoch over)."""

    def __init__(self) -> None:
        super().__init__(FAMILIES["torchtitan"])

    def train_dataloader(self) -> StatefulDataLoader:
        tokens = torch.randint(2, VOCAB, (BATCH * 16, SEQ), generator=torch.Generator().manual_seed(1))
        return StatefulDataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH)


def _fit(root: Path, family: str, state: State) -> MoCCheckpoint:
    """One fit resuming where MoC says, with the Trainer's defaults: a Hugging Face family (seed 0, the shipped
    corpus, batches of 4) or ``torchtitan``."""
    config: CheckpointConfig = moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))
    moc = MoCCheckpoint(config)
    trainer = cpu_trainer(root / "run", MAX_STEPS, [moc, state])
    if family == "torchtitan":
        trainer.fit(Titan(), ckpt_path=moc.resume_target())
        return moc
    cfg = MODELS[family]
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # a router bias that is not its initial zeros, so restoring it wrongly would show
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    data = LMDataModule(DataConfig(batch_size=4), block_size=cfg.block_size, vocab_size=cfg.vocab_size)
    trainer.fit(HFCausalLMModule(model), datamodule=data, ckpt_path=moc.resume_target())
    return moc


@pytest.mark.parametrize("family", [*sorted(MODELS), "torchtitan"])
def test_replay_resume_of_a_foreign_moe_ends_bitwise_on_the_uninterrupted_state(tmp_path: Path, family: str) -> None:
    straight = State(at=MAX_STEPS)
    _fit(tmp_path / "straight", family, straight)
    with pytest.raises(Crash):
        _fit(tmp_path / "faulty", family, State(crash_after=_crash_step()))
    resumed = State(at=MAX_STEPS)
    moc = _fit(tmp_path / "faulty", family, resumed)

    report = moc.replay_report
    assert report is not None and report.plt == 0.0
    assert report.replay_iterations == WINDOW - 1
    stacked = [k for k, v in straight.state.items() if k.startswith("module/") and ".experts." in k and v.dim() == 3]
    assert stacked, f"{family}: no stacked [E, ...] expert tensors; this test is about them"
    assert resumed.state.keys() == straight.state.keys()
    differ = sorted(k for k, v in straight.state.items() if not torch.equal(resumed.state[k], v))
    print(f"{family}: replayed {report.replay_iterations} iterations from step {report.window_start}; "
          f"{len(differ)} of {len(straight.state)} tensors differ")
    assert differ == []
