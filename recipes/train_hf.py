"""Train a Hugging Face ``transformers`` MoE, built from a small config, with MoC checkpointing.

    python recipes/train_hf.py model=hf_mixtral_tiny trainer.devices=2 trainer.max_steps=60 hydra.run.dir=DIR

``model`` is one of ``hf_mixtral_tiny``, ``hf_qwen3_moe_tiny``, ``hf_deepseek_v3_tiny``; every other group
(``data``, ``trainer``, ``checkpoint``) is ``recipes/train.py``'s. Needs ``pip install 'moc_lightning[hf]'``.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from moc_lightning.jobs.training import to_train_config
from moc_lightning.jobs.training_hf import TrainHFConfig, register_configs, run_hf

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_hf")
def main(cfg: DictConfig) -> None:
    run_hf(to_train_config(cfg, TrainHFConfig), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
