"""How Lightning's checkpoint loads reach MoC: ``ckpt_path=<MoC storage URL>`` becomes a two-level recovery.

Lightning loads a ``ckpt_path`` through the strategy's ``CheckpointIO`` (:class:`MoCCheckpointIO` takes the MoC
URL and leaves every other path to the IO it wraps), or, for a strategy that reads checkpoints itself, through the
strategy's ``load_checkpoint`` (:func:`route_strategy_loads`). Once Lightning has restored the loops, optimizers and
schedulers, :func:`complete_restores_in_restore` lets MoC finish the restore before anything observes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import Strategy

from moc_lightning.config import CheckpointConfig
from moc_lightning.lightning.wrapping import wrap_once


class Restorer(Protocol):
    """What a load routed here asks of ``MoCCheckpoint`` (which imports this module)."""

    config: CheckpointConfig

    def restore(self) -> dict[str, Any]:
        """The checkpoint dict of a two-level recovery."""
        ...

    def complete_restore(self, trainer: L.Trainer) -> None:
        """Finish a restore Lightning has loaded."""
        ...


class MoCCheckpointIO(CheckpointIO):
    """Routes ``ckpt_path=<MoC storage URL>`` to two-level recovery; everything else to the usual IO."""

    def __init__(self, delegate: CheckpointIO, callback: Restorer) -> None:
        self.delegate = delegate
        self.callback = callback

    def is_moc(self, path: Any) -> bool:
        """Whether ``path`` (fit's ``ckpt_path``) names the MoC storage URL, i.e. asks to resume through MoC."""
        url = self.callback.config.storage.url
        return path is not None and str(path) in (url, url.removeprefix("file://"))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if self.is_moc(path):
            return self.callback.restore()
        return self.delegate.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.delegate.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.delegate.remove_checkpoint(path)

    def teardown(self) -> None:
        self.delegate.teardown()


def moc_io(strategy: Strategy, callback: Restorer) -> MoCCheckpointIO:
    """The strategy's ``CheckpointIO``, made a :class:`MoCCheckpointIO` around the one it had unless it is one."""
    io = strategy.checkpoint_io
    if not isinstance(io, MoCCheckpointIO):
        io = strategy.checkpoint_io = MoCCheckpointIO(io, callback)
    return io


def route_strategy_loads(strategy: Strategy) -> None:
    """Route a MoC ``ckpt_path`` of a strategy that reads checkpoints itself, not through its ``CheckpointIO``
    (``ModelParallelStrategy`` loads a DCP directory into the model and optimizers), to ``MoCCheckpoint.restore``.
    Such a strategy loads no model or optimizer state from the returned dict: recovery restored the tensors in place,
    and the param groups' hyperparameters (the learning rate a schedule reached) are set here, as
    ``optimizer.load_state_dict`` would set them."""

    def wrap(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            io = strategy.checkpoint_io
            if isinstance(io, MoCCheckpointIO) and io.is_moc(checkpoint_path):
                checkpoint = io.callback.restore()
                if not strategy.lightning_restore_optimizer:
                    restore_param_groups(strategy.optimizers, checkpoint.get("optimizer_states", []))
                return checkpoint
            return original(checkpoint_path, weights_only=weights_only)

        return load_checkpoint

    wrap_once(strategy, "load_checkpoint", wrap)


def complete_restores_in_restore(trainer: L.Trainer, kind: type[Restorer]) -> None:
    """Make the end of Lightning's restore (``restore_training_state``: loops, optimizers, schedulers, after the
    strategy's set-up) call ``complete_restore`` of the Trainer's checkpoint callbacks of ``kind``. Lightning offers no
    hook there: ``on_train_start`` comes after the sanity check and not at all where the loop has nothing left to run,
    and ``on_fit_start`` comes before a strategy that restores after its set-up (``ModelParallelStrategy``) has
    restored. Installed once per Trainer; a Lightning without that method is refused, rather than resumed half-way."""

    def wrap(original: Callable[[], None]) -> Callable[[], None]:
        def restore_training_state() -> None:
            original()
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, kind):
                    callback.complete_restore(trainer)

        return restore_training_state

    # Lightning's private connector: its restore_training_state is the end of a restore, which no hook marks.
    if not wrap_once(trainer._checkpoint_connector, "restore_training_state", wrap):
        raise RuntimeError(
            f"lightning {L.__version__} has no _CheckpointConnector.restore_training_state, where MoC completes a "
            "restore before training; install a lightning version the project supports (pyproject.toml)"
        )


def restore_param_groups(optimizers: Sequence[torch.optim.Optimizer], saved: Sequence[dict[str, Any]]) -> None:
    """Each param group's hyperparameters (``lr``, ``betas``, ``weight_decay``, a scheduler's ``initial_lr``) as
    ``saved`` (a checkpoint's ``optimizer_states``) has them; its parameters and their state stay as they are."""
    for optimizer, state in zip(optimizers, saved):
        for group, saved_group in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
