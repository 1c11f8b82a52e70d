"""Benchmark every checkpointing method side by side (see docs/bench.md).

    python recipes/bench.py preset=quick out=/tmp/bench.json
    torchrun --standalone --nproc-per-node=2 recipes/bench.py preset=quick devices=2 data_parallel=zero2
    torchrun --standalone --nproc-per-node=2 recipes/bench.py preset=quick devices=2 data_parallel=fsdp2 precision=bf16-mixed

Prints a markdown table and writes the JSON result to ``out`` (default: ``<run output dir>/bench.json``).
"""

import json
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moc_lightning.tools.bench import BenchConfig, markdown_table, register_configs, run_bench

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(cfg: DictConfig) -> None:
    config: BenchConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    result = {"preset": hydra_cfg.runtime.choices.get("preset"), **run_bench(config, output_dir)}
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every process measured; rank 0 reports
        return
    out = Path(config.out) if config.out else output_dir / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(result))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
