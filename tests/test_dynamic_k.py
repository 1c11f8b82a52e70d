"""Dynamic-K on the reference tiny model: with frequent faults, a fixed K=1 run's accumulated PLT passes
the 3.75% threshold while a Dynamic-K run stays at or under it (the paper's Figure 14b trend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainee import Trainee, every_step_config

from moc_lightning.config import DynamicKConfig
from moc_lightning.engine.ledger import DEFAULT_PLT_THRESHOLD
from moc_lightning.models import ExpertParallelTopology

WARMUP, BETWEEN_FAULTS, FAULTS = 80, 8, 7


def accumulated_plt_per_fault(url: str, dynamic: bool) -> tuple[list[float], list[int]]:
    """Checkpoint every step with K=1; after each fault restore from storage and train on."""
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(1, 1, dynamic_k=DynamicKConfig(enabled=dynamic)), url)
    plts, ks, step = [], [], 0
    for fault in range(FAULTS):
        for _ in range(WARMUP if fault == 0 else BETWEEN_FAULTS):
            step += 1
            trainee.step(step)
            engine.record_tokens(trainee.model.moe_layers())
            engine.checkpoint(step)
        engine.load_latest()  # the fault: every expert back to its newest stored version
        plts.append(engine.ledger.accumulated_plt)
        ks.append(engine.dynamic_k.k_persist)
    return plts, ks


@pytest.mark.slow
def test_dynamic_k_keeps_plt_under_threshold_where_fixed_k_passes_it(tmp_path: Path) -> None:
    fixed, fixed_k = accumulated_plt_per_fault((tmp_path / "fixed").as_uri(), dynamic=False)
    dynamic, dynamic_k = accumulated_plt_per_fault((tmp_path / "dynamic").as_uri(), dynamic=True)
    print("fixed K=1  :", [f"{p:.2%}" for p in fixed], fixed_k)
    print("Dynamic-K  :", [f"{p:.2%}" for p in dynamic], dynamic_k)
    assert max(fixed) > DEFAULT_PLT_THRESHOLD, "the fault pattern must be harsh enough for K=1 to pass the threshold"
    assert max(dynamic) <= DEFAULT_PLT_THRESHOLD
    assert dynamic_k[-1] > 1 and fixed_k == [1] * FAULTS
