"""A replay-mode restore is complete before anything can observe it, at the edges of Lightning's loop (issue 28 item 1,
DESIGN hard part 13): where the resumed fit runs no batch (its newest window ends at ``max_steps``, ``max_epochs`` is
reached, a stop was requested), where a callback reads the weights in ``on_train_start`` before MoC's, where
``validate`` follows the resume. Each is checked against the fault-free run of the same seed: its states at the
window ends, and its consolidated final checkpoint.

A kill inside the final persist is stood in for by an exception raised where the persist would start: the window
ending at ``max_steps`` was flushed to shared memory and storage before it, and nothing after it ran (no slot was
removed, no final checkpoint committed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning_run import MODEL, Crash, Recorder, cpu_trainer, datamodule, fit, moc_config

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.export.consolidate import consolidate
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models.lightning import GPTMoEModule

pytestmark = pytest.mark.xdist_group("replay_edges")  # one worker trains the fault-free run once

MAX_STEPS = 12
WINDOW = 3
MIDWAY = 6
"""A window end before ``max_steps``: a resume there replays the window 3..6 and trains on."""


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))


class Observer(L.Callback):
    """The full state (this rank's pieces) where a user's callback first sees it in a fit (``on_train_start``, when
    the loop runs), at ``on_fit_end`` (before MoC's: checkpoint callbacks run last), and at ``on_validation_start``."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _tensors(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        layout = build_layout(module, optimizer, num_experts=MODEL.num_experts)
        return {k: v.detach().clone() for k, v in layout.pieces(layout.units).items()}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen["train_start"] = self._tensors(trainer, module)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.seen["fit_end"] = self._tensors(trainer, module)

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seen["validation"] = self._tensors(trainer, module)


class StopBeforeTheFirstBatch(L.Callback):
    """A stop requested before the resumed fit's first batch (a signal, an early-stopping callback's restored state)."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.should_stop = True


def _consolidated(root: Path, out: Path) -> dict[str, Any]:
    consolidate((root / "ckpt").as_uri(), out, progress=False)
    return torch.load(out, weights_only=True)


def _tensors_of(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested dict, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors_of(value, f"{prefix}/{key}").items()}
    return {}


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run no fault touches: its states at the window ends, and its consolidated final checkpoint."""
    root = tmp_path_factory.mktemp("fault_free")
    recorder = Recorder(at=(MIDWAY, MAX_STEPS))
    fit(root, _config(root), MAX_STEPS, [recorder])
    return {"states": recorder.states, "final": _tensors_of(_consolidated(root, root / "dense.ckpt"))}


def _killed_in_the_final_persist(root: Path, monkeypatch: pytest.MonkeyPatch, **trainer_options: Any) -> None:
    """A fit to its end whose final persist is killed as it starts: its last window is sealed and stored (on_fit_end
    flushes the windows first), no final checkpoint is committed."""
    def killed(self: TwoLevelCheckpointer, *args: Any, **kwargs: Any) -> None:
        raise Crash("killed inside the final persist")

    with monkeypatch.context() as patch:
        patch.setattr(TwoLevelCheckpointer, "persist_final", killed)
        with pytest.raises(Crash):
            moc = MoCCheckpoint(_config(root))
            trainer = cpu_trainer(root / "run", trainer_options.pop("max_steps", MAX_STEPS), [moc], **trainer_options)
            trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule(), ckpt_path=moc.resume_target())


def _resume(root: Path, callbacks: list[L.Callback], **trainer_options: Any) -> tuple[L.Trainer, MoCCheckpoint]:
    moc = MoCCheckpoint(_config(root))
    trainer = cpu_trainer(root / "run", trainer_options.pop("max_steps", MAX_STEPS), [moc, *callbacks], **trainer_options)
    trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule(), ckpt_path=moc.resume_target())
    return trainer, moc


@pytest.mark.parametrize(
    "bound", [{}, {"max_steps": -1, "max_epochs": 1, "limit_train_batches": MAX_STEPS}], ids=["max_steps", "max_epochs"]
)
def test_a_resume_whose_window_ends_where_the_fit_ends_replays_it_and_its_final_checkpoint_is_the_fault_free_one(
    tmp_path: Path, fault_free: dict[str, Any], monkeypatch: pytest.MonkeyPatch, bound: dict[str, int]
) -> None:
    """The newest window ends where the fit ends: at ``max_steps`` (the resumed fit runs no batch and no
    ``on_train_start``), or at the end of the one epoch ``max_epochs`` allows. ``max_steps`` failed on 72cf597: the replay
    waited for ``on_train_start``, and the final persist committed the initial weights (no optimizer state) as step 12;
    ``moc-consolidate`` gave them back. ``max_epochs`` held on 72cf597 already: the window's trainer state is captured at
    its last batch's end, before Lightning counts the epoch processed, so the resumed loop still ran ``on_train_start``
    (and the replay then), though no batch."""
    _killed_in_the_final_persist(tmp_path, monkeypatch, **dict(bound))
    observer = Observer()
    _, moc = _resume(tmp_path, [observer], **dict(bound))
    assert moc.replay_report is not None and moc.replay_report.resume_step == MAX_STEPS
    if not bound:
        assert "train_start" not in observer.seen, "the loop ran no batch"
    assert _differing(observer.seen["fit_end"], fault_free["states"][MAX_STEPS]) == []
    final = _tensors_of(_consolidated(tmp_path, tmp_path / "dense.ckpt"))
    assert _differing(final, fault_free["final"]) == []


def test_validate_right_after_a_resume_at_max_steps_sees_the_restored_weights(
    tmp_path: Path, fault_free: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``validate`` after a replay-mode ``fit`` that resumed at ``max_steps``. Failed on 72cf597: it evaluated the
    initial weights."""
    _killed_in_the_final_persist(tmp_path, monkeypatch)
    observer = Observer()
    trainer, _ = _resume(tmp_path, [observer])
    validator = L.Trainer(
        accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[observer],
        default_root_dir=str(tmp_path / "validate"),
    )
    validator.validate(trainer.lightning_module, datamodule=datamodule())
    want = {k: v for k, v in fault_free["states"][MAX_STEPS].items() if "/optim/" not in k}
    assert _differing(observer.seen["validation"], want) == []


def test_a_callback_reading_the_weights_in_on_train_start_sees_the_replayed_state(
    tmp_path: Path, fault_free: dict[str, Any]
) -> None:
    """A resume mid-run (window 3..6 replayed): a user's callback runs its ``on_train_start`` before MoC's. Failed on
    72cf597: it saw the initial weights and no optimizer state (the replay ran after it), not step 6's state."""
    crashed = Recorder(crash_after=MIDWAY + 1)
    with pytest.raises(Crash):
        fit(tmp_path, _config(tmp_path), MAX_STEPS, [crashed])
    observer = Observer()
    _, moc = _resume(tmp_path, [observer])
    assert moc.replay_report is not None and moc.replay_report.resume_step == MIDWAY
    assert _differing(observer.seen["train_start"], fault_free["states"][MIDWAY]) == []
    assert _differing(observer.seen["fit_end"], fault_free["states"][MAX_STEPS]) == []


def test_a_stop_before_the_first_batch_persists_the_replayed_state(tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """A resume at step 6 whose fit stops before its first batch: the final persist holds the state of step 6. Failed
    on 72cf597: it committed the initial weights (the replay had not run) as step 6."""
    crashed = Recorder(crash_after=MIDWAY + 1)
    with pytest.raises(Crash):
        fit(tmp_path, _config(tmp_path), MAX_STEPS, [crashed])
    observer = Observer()
    trainer, moc = _resume(tmp_path, [StopBeforeTheFirstBatch(), observer])
    assert moc.engine.stats.final_persist is not None and moc.engine.stats.final_persist.step == MIDWAY
    assert _differing(observer.seen["fit_end"], fault_free["states"][MIDWAY]) == []
    consolidated = _consolidated(tmp_path, tmp_path / "dense.ckpt")
    assert consolidated["global_step"] == MIDWAY
    live = {k: v for k, v in trainer.lightning_module.state_dict().items()}  # the fault-free weights of step 6, above
    assert _differing(consolidated["state_dict"], live) == []
