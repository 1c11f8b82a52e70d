"""Train the reference GPT-MoE with MoC checkpointing.

    python recipes/train.py model=tiny trainer.devices=2 trainer.max_steps=60 hydra.run.dir=DIR

Also runs under ``torchrun`` (Lightning picks up the launcher's environment) and on SLURM through
``-m hydra/launcher=slurm``.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from moc_lightning.jobs.training import register_configs, run, to_train_config

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(to_train_config(cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
