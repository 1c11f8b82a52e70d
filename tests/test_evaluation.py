"""``validate``/``test``/``predict`` beside ``MoCCheckpoint``: what each ``ckpt_path`` means there.

``None`` with the model: its current weights; ``"best"`` (also what Lightning takes for ``None`` without a
model): refused, MoC monitors no metric; ``"last"`` and the storage URL: MoC's newest committed checkpoint,
loaded without writing anything. ``fit(ckpt_path="last")`` resumes through MoC.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning_run import MODEL, cpu_trainer, datamodule, moc_config

from moc_lightning.data import LMDataModule
from moc_lightning.engine.layout import build_layout
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models.causal_lm import Batch
from moc_lightning.models.lightning import GPTMoEModule


class Evaluated(GPTMoEModule):
    """The reference module with a test step that logs ``test_loss``."""

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        lm_loss, _ = self.losses(batch)
        self.log("test_loss", lm_loss)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert weights, "the module is configured"
    return weights


def _fit(tmp_path: Path, devices: int = 1) -> tuple[MoCCheckpoint, Evaluated, LMDataModule, L.Trainer]:
    """4 steps of the reference model with MoC alone, snapshotting every 2 steps (and persisting the last whole)."""
    moc = MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=2))
    trainer = cpu_trainer(tmp_path / "run", 4, [moc], devices=devices, limit_test_batches=2)
    model, data = Evaluated(MODEL, seed=0), datamodule()
    trainer.fit(model, datamodule=data)
    return moc, model, data, trainer


def _stored(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_after_fit_the_model_is_evaluated_as_it_is_and_best_is_refused_naming_what_is_allowed(
    tmp_path: Path,
) -> None:
    """Failed on c9969fb: ``validate()``/``test()``/``predict()`` without a model, and ``ckpt_path="best"``,
    raised AttributeError: 'MoCCheckpoint' object has no attribute 'best_model_path'."""
    moc, model, data, trainer = _fit(tmp_path)
    fitted = _weights(model)
    [result] = trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)
    assert "test_loss" in result
    assert all(torch.equal(t, fitted[k]) for k, t in _weights(model).items()), "test(model) loads nothing"

    for evaluate in (trainer.validate, trainer.test, trainer.predict):
        for kwargs in ({}, {"model": model, "ckpt_path": "best"}):
            with pytest.raises(ValueError, match=r"ckpt_path='best'") as refused:
                evaluate(**kwargs)
            message = str(refused.value)
            assert "MoCCheckpoint" in message and "'last'" in message and moc.config.storage.url in message
    assert not hasattr(moc, "best_model_path"), "Lightning's spawn launchers probe it with hasattr"


@pytest.mark.parametrize("ckpt_path", ["last", "storage_url"])
def test_last_and_the_storage_url_evaluate_the_newest_checkpoint_and_write_nothing(
    tmp_path: Path, ckpt_path: str
) -> None:
    """Failed on c9969fb: ``"last"`` loaded nothing (Lightning finds no ``ModelCheckpoint`` file); the storage
    URL loaded through a training recovery, which committed a new lineage segment in the manifest."""
    moc, fitted_model, data, _ = _fit(tmp_path)
    fitted = _weights(fitted_model)
    stored = _stored(tmp_path / "ckpt")

    evaluator = MoCCheckpoint(moc_config(tmp_path))  # as in a new process
    trainer = cpu_trainer(tmp_path / "eval", 1, [evaluator], limit_test_batches=2)
    fresh = Evaluated(MODEL, seed=1)
    fresh.configure_model()
    assert any(not torch.equal(t, fitted[k]) for k, t in _weights(fresh).items())
    path = moc.config.storage.url if ckpt_path == "storage_url" else ckpt_path
    [result] = trainer.test(fresh, dataloaders=data.val_dataloader(), ckpt_path=path, verbose=False)

    assert "test_loss" in result
    assert all(torch.equal(t, fitted[k]) for k, t in _weights(fresh).items()), "the weights fit ended with"
    assert _stored(tmp_path / "ckpt") == stored, "evaluation writes nothing to storage"
    assert not (tmp_path / "eval" / "moc_recovery").exists(), "evaluation is no recovery"


def test_evaluating_a_storage_url_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    """Failed on c9969fb: no error; the test began a new lineage in the empty storage and ran the module as it was."""
    moc = MoCCheckpoint(moc_config(tmp_path))
    trainer = cpu_trainer(tmp_path / "eval", 1, [moc], limit_test_batches=2)
    data = datamodule()
    data.setup()
    with pytest.raises(ValueError, match="no checkpoint is committed"):
        trainer.test(Evaluated(MODEL, seed=0), dataloaders=data.val_dataloader(), ckpt_path=moc.config.storage.url)
    assert not _stored(tmp_path / "ckpt"), "nothing is written there"


def test_fit_with_last_resumes_through_moc(tmp_path: Path) -> None:
    """Failed on c9969fb: ``fit(ckpt_path="last")`` found no ``ModelCheckpoint`` file and started over."""
    _fit(tmp_path)
    moc = MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=2))
    trainer = cpu_trainer(tmp_path / "run", 6, [moc])
    trainer.fit(Evaluated(MODEL, seed=0), datamodule=datamodule(), ckpt_path="last")
    assert moc.recovery is not None and moc.recovery.resume_step == 4
    assert trainer.global_step == 6


def _unit_tensors(module: Evaluated) -> dict[str, torch.Tensor]:
    """The module's weights and buffers under unit keys, which name experts by their global id."""
    layout = build_layout(module, None, expert_parallel=module.expert_topology.ep)
    return {k: t.clone() for k, t in layout.model_tensors(layout.units).items()}


def _evaluate(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    tmp_path = Path(root)
    data = datamodule()
    data.setup()
    trainer = cpu_trainer(tmp_path / "eval", 1, [MoCCheckpoint(moc_config(tmp_path))], devices=world_size,
                          limit_test_batches=2)
    fresh = Evaluated(MODEL, seed=1)
    trainer.test(fresh, dataloaders=data.val_dataloader(), ckpt_path="last", verbose=False)
    assert fresh.expert_topology.ep == world_size
    return _unit_tensors(fresh)


@pytest.mark.slow
def test_two_expert_parallel_ranks_evaluate_a_one_rank_checkpoint(tmp_path: Path) -> None:
    """Each of 2 ranks (EP degree 2) loads its own experts and every dense unit of a checkpoint 1 rank wrote;
    storage is left as it was."""
    _, model, _, _ = _fit(tmp_path)
    fitted = _unit_tensors(model)
    stored = _stored(tmp_path / "ckpt")
    ranks = run_ranks(_evaluate, 2, tmp_path, str(tmp_path), init_process_group=False)
    assert ranks[0].keys() != ranks[1].keys(), "each rank holds other experts"
    for loaded in ranks:
        assert loaded and all(torch.equal(t, fitted[k]) for k, t in loaded.items())
    assert _stored(tmp_path / "ckpt") == stored
