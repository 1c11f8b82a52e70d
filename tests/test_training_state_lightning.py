"""The whole training state comes back through Lightning (issue 11, items 4 and 5): what the module, other
callbacks and the datamodule save; per-rank RNG; and the data position, so that a resumed run sees exactly
the samples of an uninterrupted one."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning_run import MODEL, cpu_trainer, moc_config
from torch.utils.data import DataLoader

from moc_lightning.config import CheckpointConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.trainer_state import loops_state
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models.lightning import GPTMoEModule


class HookedModule(GPTMoEModule):
    """Adds to every checkpoint, and reads it back, as a user's module does."""

    loaded: Any = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["module_extra"] = {"saved_at": self.trainer.global_step}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint.get("module_extra")


class HookedCallback(L.Callback):
    loaded: Any = None

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["callback_extra"] = trainer.global_step

    def on_load_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint.get("callback_extra")


class StatefulData(LMDataModule):
    loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"datamodule_at": self.trainer.global_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


class PlainLoaderData(LMDataModule):
    """A user's datamodule whose train loader has no ``state_dict``."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.cfg.batch_size, shuffle=True, drop_last=True)


def _data(cls: type[LMDataModule] = LMDataModule, batch_size: int = 8) -> LMDataModule:
    return cls(DataConfig(batch_size=batch_size), block_size=MODEL.block_size, vocab_size=MODEL.vocab_size)


class LoopsAlike(L.Callback):
    """Compares, at every batch end, the loops' state a snapshot captures with Lightning's own."""

    def __init__(self) -> None:
        self.alike: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.alike.append(loops_state(trainer) == trainer._checkpoint_connector._get_loops_state_dict())


def test_module_callback_and_datamodule_additions_come_back(tmp_path: Path) -> None:
    config = moc_config(
        tmp_path, every_n_train_steps=5, persist_every_n_snapshots=100, persist_on_fit_end=False,
        remove_snapshots_on_fit_end=False,  # a planned restart: the state of step 10 lives only in memory
    )
    moc, loops = MoCCheckpoint(config), LoopsAlike()
    cpu_trainer(tmp_path / "run", 10, [moc, HookedCallback(), loops]).fit(HookedModule(MODEL),
                                                                         datamodule=_data(StatefulData))
    assert loops.alike == [True] * 10, "the loops' state as Lightning's _get_loops_state_dict builds it"

    moc, callback, module, data = MoCCheckpoint(config), HookedCallback(), HookedModule(MODEL), _data(StatefulData)
    cpu_trainer(tmp_path / "run", 12, [moc, callback]).fit(module, datamodule=data, ckpt_path=moc.resume_target())
    assert moc.recovery.resume_step == 10
    assert module.loaded == {"saved_at": 10}
    assert callback.loaded == 10
    assert data.loaded == {"datamodule_at": 10}


def test_a_plain_train_loader_gets_one_warning_saying_what_a_resume_does(tmp_path: Path) -> None:
    config = moc_config(tmp_path, every_n_train_steps=1, persist_on_fit_end=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cpu_trainer(tmp_path / "run", 3, [MoCCheckpoint(config)])
        trainer.fit(GPTMoEModule(MODEL), datamodule=_data(PlainLoaderData))
    ours = [str(w.message) for w in caught if "moc_lightning" in str(w.message)]
    assert len(ours) == 1, ours
    assert "not stateful" in ours[0] and "starts its epoch over" in ours[0]


class SampleRecorder(L.Callback):
    """Per step: a digest of every sample of the batch, and of this rank's RNG state, as the step starts."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[list[str], str]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        ids = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch[0]]
        rng = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
        self.steps[trainer.global_step + 1] = (ids, rng)


class RankSeed(L.Callback):
    """Per-rank RNG streams that differ, seeded once the model is built (its initialisation seeds its own)."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


def _fit_recorded(rank: int, root: Path, name: str, max_steps: int) -> SampleRecorder:
    L.seed_everything(0, verbose=False)
    config = CheckpointConfig(every_n_train_steps=3, persist_every_n_snapshots=100, shm_root=str(root / "shm"))
    config.storage.url = (root / name).as_uri()
    moc, recorder = MoCCheckpoint(config), SampleRecorder()
    trainer = cpu_trainer(root / name / "run", max_steps, [RankSeed(), moc, recorder], devices=2)
    trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=_data(batch_size=4), ckpt_path=moc.resume_target())
    return recorder


def _interrupted_and_straight(rank: int, world_size: int, root: str) -> dict[str, Any]:
    straight = _fit_recorded(rank, Path(root), "straight", 9)
    first = _fit_recorded(rank, Path(root), "resumed", 6)
    resumed = _fit_recorded(rank, Path(root), "resumed", 9)
    return {"straight": straight.steps, "first": first.steps, "resumed": resumed.steps}


@pytest.mark.slow
def test_resumed_run_sees_the_samples_and_rng_of_an_uninterrupted_one(tmp_path: Path) -> None:
    ranks = run_ranks(_interrupted_and_straight, 2, tmp_path, str(tmp_path), init_process_group=False)
    for rank, run in enumerate(ranks):
        assert sorted(run["resumed"]) == [7, 8, 9]
        for step in range(1, 7):
            assert run["first"][step] == run["straight"][step], f"rank {rank} step {step}: runs must start alike"
        for step in (7, 8, 9):
            assert run["resumed"][step][0] == run["straight"][step][0], f"rank {rank} step {step}: other samples"
            assert run["resumed"][step][1] == run["straight"][step][1], f"rank {rank} step {step}: other RNG"
    assert ranks[0]["straight"][7][1] != ranks[1]["straight"][7][1], "the ranks' RNG streams differ"
    assert set(ranks[0]["straight"][7][0]).isdisjoint(ranks[1]["straight"][7][0]), "ranks read different samples"
