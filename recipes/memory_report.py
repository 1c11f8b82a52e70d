"""Host memory of MoC's saves, per rank: does a snapshot or a persist grow RSS beyond the shared-memory slots?

    python recipes/memory_report.py model=small_16e hydra.run.dir=DIR
    torchrun --nproc-per-node=2 recipes/memory_report.py trainer.data_parallel=fsdp2 hydra.run.dir=DIR

Trains the reference GPT-MoE on 2 CPU processes under ``trainer.data_parallel=zero2`` (or ``fsdp2``) for a few
steps with snapshots and persists, samples ``/proc/self/status`` from a background thread, and prints per rank:
the state it holds (weights + kept optimizer state; under ``fsdp2`` its local pieces), the peak ``RssAnon``/``RssShmem`` of training with no save in flight,
the peaks during the snapshot copy, the snapshot and the persist, and each one's ``RssAnon`` growth as a % of
the state (:mod:`moc_lightning.tools.memory_probe`). The JSON goes to ``DIR/memory_report.json``.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from moc_lightning.jobs.training import to_train_config
from moc_lightning.tools.memory_probe import MemoryReportConfig, register_configs, run_report

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="memory_report")
def main(cfg: DictConfig) -> None:
    run_report(to_train_config(cfg, MemoryReportConfig), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
