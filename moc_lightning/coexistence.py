"""Where ``MoCCheckpoint`` stands among Lightning's own checkpointing: ``enable_checkpointing`` and ``ModelCheckpoint``.

``MoCCheckpoint`` is a Lightning ``Checkpoint`` callback, for two reasons: Lightning then adds no default
``ModelCheckpoint`` beside it (one that, under expert parallelism, would save rank 0's experts only), and it
runs after the other callbacks in every hook, so the training state it captures at a step's end holds what
they did in that step. Lightning's ``Trainer(enable_checkpointing=False)`` refuses every ``Checkpoint``
callback ("found `ModelCheckpoint` in callbacks list"), although for MoC the setting means only "no default
``ModelCheckpoint``", which holds already: :func:`allow_with_checkpointing_disabled` lets MoC through that
check (any other checkpoint callback is still refused by Lightning's own check, as before).

Beside a ``ModelCheckpoint`` in the same Trainer both save, and each restores its own: ``fit(ckpt_path=<MoC
storage URL>)`` resumes through MoC, any other path through Lightning (MoC then begins a new lineage).
:func:`check_other_checkpoints` refuses the two cases where that cannot be right: expert parallelism (each
rank holds other experts; Lightning writes rank 0's state only) and a ``ModelCheckpoint`` writing into MoC's
storage root (a new lineage would move its files aside).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

_WRAPPED = "_moc_allows_checkpointing_disabled"


def allow_with_checkpointing_disabled(is_moc: Callable[[Callback], bool]) -> None:
    """Let ``Trainer(enable_checkpointing=False)`` accept the checkpoint callbacks ``is_moc`` names (once per
    process; no effect on a Trainer without them).

    Lightning checks ``enable_checkpointing`` in ``Trainer.__init__``, before any callback hook runs, in a
    private method of its callback connector: this wraps that method. Lightning 2.6 names it
    ``_configure_checkpoint_callbacks``; a Lightning without it keeps its own check (the tests pin the version).
    """
    configure = getattr(_CallbackConnector, "_configure_checkpoint_callbacks", None)
    if configure is None or getattr(configure, _WRAPPED, False):
        return

    def configure_checkpoint_callbacks(self: _CallbackConnector, enable_checkpointing: bool) -> None:
        if not enable_checkpointing and all(is_moc(c) for c in self.trainer.checkpoint_callbacks):
            return  # checkpointing off: Lightning adds no ModelCheckpoint; MoC is not one and stays
        configure(self, enable_checkpointing)

    setattr(configure_checkpoint_callbacks, _WRAPPED, True)
    _CallbackConnector._configure_checkpoint_callbacks = configure_checkpoint_callbacks  # type: ignore[method-assign]


def check_other_checkpoints(trainer: L.Trainer, moc: Checkpoint, ep: int, storage_root: Path | None) -> None:
    """Refuse the Trainer's other checkpoint callbacks where they cannot save this run correctly.

    ``ep``: the expert-parallel degree; ``storage_root``: MoC's storage as a local directory (``None`` for an
    object store). Call it once every callback's ``setup`` has run (``ModelCheckpoint`` resolves its
    directory there).
    """
    others = [c for c in trainer.checkpoint_callbacks if not isinstance(c, type(moc))]
    if not others:
        return
    names = ", ".join(sorted({type(c).__name__ for c in others}))
    if ep > 1:
        raise ValueError(
            f"{names} in the Trainer's callbacks cannot checkpoint this model: under expert parallelism (EP "
            f"degree {ep}) every rank holds other experts, and Lightning saves rank 0's state only. Remove it: "
            "MoCCheckpoint saves every expert, and keeps Lightning from adding a default ModelCheckpoint "
            "(with enable_checkpointing=True or False)"
        )
    for callback in others:
        dirpath = getattr(callback, "dirpath", None)
        if storage_root is not None and dirpath is not None and Path(dirpath).resolve() == storage_root.resolve():
            raise ValueError(
                f"{type(callback).__name__} writes into {dirpath}, the MoC storage root: a new MoC lineage moves "
                f"everything found there aside. Give {type(callback).__name__}(dirpath=...) or "
                "checkpoint.storage.url another directory"
            )
