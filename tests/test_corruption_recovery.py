"""A damaged checkpoint is never loaded: recovery falls back to the version stored before it and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from storage_faults import DAMAGES
from trainee import TINY, Trainee, every_step_config

from moc_lightning.models import ExpertParallelTopology


def _two_checkpoints(url: str) -> tuple[dict[int, dict[str, torch.Tensor]], Path]:
    """Full checkpoints (K=N) at steps 2 and 4; the tensors captured at each."""
    trainee = Trainee(ExpertParallelTopology())
    engine = trainee.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    captured = {}
    for step in range(1, 5):
        trainee.step(step)
        engine.record_tokens(trainee.model.moe_layers())
        if step in (2, 4):
            engine.checkpoint(step)
            captured[step] = trainee.snapshot()
    return captured, Path(url.removeprefix("file://"))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_tensor_file_falls_back_to_previous_version(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    data_file = next((root / "step_000000004").glob("*.distcp"))
    DAMAGES[damage](data_file)

    fresh = Trainee(ExpertParallelTopology(), seed=1)
    engine = fresh.engine(every_step_config(TINY.num_experts, TINY.num_experts), url)
    report = engine.load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored), "every tensor is step 2's"
    assert "step_000000004 is unreadable" in capsys.readouterr().out
    assert [r.step for r in engine.read_manifest().records] == [2], "the damaged checkpoint is no longer listed"


def test_garbage_manifest_falls_back_to_the_previous_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    captured, root = _two_checkpoints(url)
    (root / "manifest.json").write_bytes(b"\x00garbage{")
    fresh = Trainee(ExpertParallelTopology(), seed=1)
    report = fresh.engine(every_step_config(TINY.num_experts, TINY.num_experts), url).load_latest()
    assert report.resume_step == 2
    restored = fresh.snapshot()
    assert all(torch.equal(restored[k], captured[2][k]) for k in restored)
    assert "manifest.json is unreadable" in capsys.readouterr().out
