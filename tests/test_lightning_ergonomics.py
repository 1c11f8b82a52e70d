"""MoCCheckpoint among Lightning's own checkpoint settings, and the recipe's progress bar (issue 13, item 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_run import MODEL, cpu_trainer, datamodule, fit, moc_config

from moc_lightning.jobs.training import TrainConfig, TrainerConfig, build_trainer
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.models.lightning import GPTMoEModule


def _moc(tmp_path: Path) -> MoCCheckpoint:
    return MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=5))


@pytest.mark.parametrize("enable_checkpointing", [True, False])
def test_moc_is_the_only_checkpointing_whatever_enable_checkpointing_says(
    tmp_path: Path, enable_checkpointing: bool
) -> None:
    """Failed on 64f2238 (``False``): MisconfigurationException "Trainer was configured with
    `enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list"."""
    moc = _moc(tmp_path)
    trainer = cpu_trainer(tmp_path / "run", 6, [moc], enable_checkpointing=enable_checkpointing)
    trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule())
    assert trainer.checkpoint_callbacks == [moc], "Lightning added no ModelCheckpoint beside MoC"
    assert [r.step for r in moc.engine.pec.read_manifest().records] == [5, 6]
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def test_a_model_checkpoint_with_checkpointing_disabled_is_still_lightnings_error(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException, match="enable_checkpointing=False"):
        cpu_trainer(tmp_path, 1, [_moc(tmp_path), ModelCheckpoint(dirpath=tmp_path / "lightning")],
                    enable_checkpointing=False)


def test_beside_a_model_checkpoint_both_save_and_each_restores_its_own(tmp_path: Path) -> None:
    lightning_dir = tmp_path / "lightning"

    def model_checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=lightning_dir, every_n_train_steps=5, save_top_k=-1)

    config = moc_config(tmp_path, every_n_train_steps=5)
    fit(tmp_path, config, 10, [model_checkpoint()])
    assert sorted(p.name for p in lightning_dir.iterdir()) == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt"]

    resumed = fit(tmp_path, moc_config(tmp_path, every_n_train_steps=5), 12, [model_checkpoint()])
    assert resumed.recovery is not None and resumed.recovery.resume_step == 10, "MoC resumes from its storage"

    from_lightning = MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=5))
    trainer = cpu_trainer(tmp_path / "run", 7, [from_lightning, model_checkpoint()])
    step_5 = str(lightning_dir / "epoch=0-step=5.ckpt")
    trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule(), ckpt_path=step_5)
    assert from_lightning.recovery is None, "a Lightning checkpoint is restored by Lightning, not by MoC"
    assert trainer.global_step == 7
    assert [r.step for r in from_lightning.engine.pec.read_manifest().records] == [7], "a new MoC lineage"


class ExpertParallelModule(GPTMoEModule):
    """Claims its experts are split over 2 ranks (EP degree 2), as a 2-process expert-parallel run would."""

    @property
    def expert_topology(self) -> ExpertParallelTopology:
        return ExpertParallelTopology(world_size=2, rank=0, ep=2)


def test_a_model_checkpoint_under_expert_parallelism_is_refused(tmp_path: Path) -> None:
    """Failed on 64f2238: no error; the ModelCheckpoint would have saved rank 0's experts only."""
    trainer = cpu_trainer(tmp_path / "run", 2, [_moc(tmp_path), ModelCheckpoint(dirpath=tmp_path / "lightning")])
    with pytest.raises(ValueError, match="ModelCheckpoint in the Trainer's callbacks cannot checkpoint this model"):
        trainer.fit(ExpertParallelModule(MODEL, seed=0), datamodule=datamodule())


class ZeroOverTwoRanksModule(GPTMoEModule):
    """ZeRO-2 over 2 ranks that all hold every expert, as a 2-process ``data_parallel=zero2`` run would be."""

    @property
    def expert_topology(self) -> ExpertParallelTopology:
        return ExpertParallelTopology(world_size=2, rank=0, ep=1)


def test_a_model_checkpoint_under_zero2_is_refused(tmp_path: Path) -> None:
    """Failed on 16aded2: no error; the ModelCheckpoint would have saved rank 0's optimizer partition only."""
    trainer = cpu_trainer(tmp_path / "run", 2, [_moc(tmp_path), ModelCheckpoint(dirpath=tmp_path / "lightning")])
    with pytest.raises(ValueError, match="would lack the optimizer state the other ranks own"):
        trainer.fit(ZeroOverTwoRanksModule(MODEL, seed=0, data_parallel="zero2"), datamodule=datamodule())


def test_a_model_checkpoint_in_the_moc_storage_root_is_refused(tmp_path: Path) -> None:
    """Failed on 64f2238: no error; Lightning's files went into the MoC storage root, to be moved aside."""
    moc = _moc(tmp_path)
    storage_root = tmp_path / "ckpt"
    trainer = cpu_trainer(tmp_path / "run", 2, [moc, ModelCheckpoint(dirpath=storage_root)])
    with pytest.raises(ValueError, match="the MoC storage root"):
        trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule())


@pytest.mark.parametrize(("option", "shown"), [({}, True), ({"enable_progress_bar": False}, False)])
def test_recipe_trainer_shows_the_progress_bar(tmp_path: Path, option: dict[str, Any], shown: bool) -> None:
    """Failed on 64f2238 (default): the recipe's Trainer had no progress bar (``make train`` was silent)."""
    config = TrainConfig(trainer=TrainerConfig(devices=1, **option))
    trainer = build_trainer(config, tmp_path, [_moc(tmp_path)])
    assert (trainer.progress_bar_callback is not None) == shown


def test_recipe_progress_bar_shows_no_negative_epoch_total(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Failed on c9969fb: "Epoch 0/-2". The recipe bounds a run by ``max_steps``, so Lightning sets
    ``max_epochs=-1``, and Lightning 2.6's rich bar (its default where ``rich`` is installed) shows
    ``max_epochs - 1`` as the last epoch (Lightning-AI/pytorch-lightning#21925, fixed in 2.7)."""
    config = TrainConfig(trainer=TrainerConfig(devices=1, max_steps=3, val_check_interval=2, limit_val_batches=1))
    build_trainer(config, tmp_path).fit(BoringModel())
    shown = "".join(capfd.readouterr())
    assert "Epoch 0" in shown and "/-2" not in shown
