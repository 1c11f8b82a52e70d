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
:func:`check_other_checkpoints` refuses the cases where that cannot be right: expert parallelism (each rank
holds other experts; Lightning writes rank 0's state only), ZeRO-2 over several ranks (each rank holds the
optimizer state of the parameters it owns; Lightning writes rank 0's partition only) and a ``ModelCheckpoint``
writing into MoC's storage root (a new lineage would move its files aside).

``ckpt_path="last"`` names the newest of Lightning's own files (``ModelCheckpoint``, ``OnExceptionCheckpoint``);
with MoC the Trainer's only checkpoint callback :func:`resolve_last` makes it MoC's newest checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from moc_lightning.lightning.wrapping import wrap_once
from moc_lightning.sharding.zero import ZeroAdamW


def allow_with_checkpointing_disabled(is_moc: Callable[[Callback], bool]) -> None:
    """Let ``Trainer(enable_checkpointing=False)`` accept the checkpoint callbacks ``is_moc`` names (once per
    process; no effect on a Trainer without them).

    Lightning checks ``enable_checkpointing`` in ``Trainer.__init__``, before any callback hook runs, in a
    private method of its callback connector: this wraps that method. Lightning 2.6 names it
    ``_configure_checkpoint_callbacks``; a Lightning without it keeps its own check (the tests pin the version).
    """

    def wrap(configure: Callable[..., None]) -> Callable[..., None]:
        def configure_checkpoint_callbacks(self: _CallbackConnector, enable_checkpointing: bool) -> None:
            if not enable_checkpointing and all(is_moc(c) for c in self.trainer.checkpoint_callbacks):
                return  # checkpointing off: Lightning adds no ModelCheckpoint; MoC is not one and stays
            configure(self, enable_checkpointing)

        return configure_checkpoint_callbacks

    wrap_once(_CallbackConnector, "_configure_checkpoint_callbacks", wrap)


def resolve_last(last_of: Callable[[L.Trainer], str | None]) -> None:
    """Let ``ckpt_path="last"`` (of ``fit``, ``validate``, ``test``, ``predict``) mean ``last_of(trainer)``
    where that is not ``None`` (once per process; ``None`` leaves ``"last"`` to Lightning).

    Lightning turns ``"last"`` into a path before any callback hook runs, in a private method of its checkpoint
    connector, from ``ModelCheckpoint`` and ``OnExceptionCheckpoint`` files only: with MoC alone it would warn
    and load nothing. This wraps that method. Lightning 2.6 names it ``_parse_ckpt_path``; a Lightning
    without it keeps its own meaning of ``"last"`` (the tests pin the version).
    """

    def wrap(parse: Callable[..., Any]) -> Callable[..., Any]:
        def parse_ckpt_path(
            self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if ckpt_path == "last" and (target := last_of(self.trainer)) is not None:
                return target
            return parse(self, state_fn, ckpt_path, *args, **kwargs)

        return parse_ckpt_path

    wrap_once(_CheckpointConnector, "_parse_ckpt_path", wrap)


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
    if any(_partitioned_over_ranks(optimizer) for optimizer in trainer.optimizers):
        raise ValueError(
            f"{names} in the Trainer's callbacks cannot checkpoint this run: under ZeRO-2 (trainer.data_parallel="
            "zero2) each rank keeps the optimizer state of the parameters it owns only, and Lightning saves rank "
            "0's state only, so its file would lack the optimizer state the other ranks own. Remove it, or train "
            "with trainer.data_parallel=ddp"
        )
    for callback in others:
        dirpath = getattr(callback, "dirpath", None)
        if storage_root is not None and dirpath is not None and Path(dirpath).resolve() == storage_root.resolve():
            raise ValueError(
                f"{type(callback).__name__} writes into {dirpath}, the MoC storage root: a new MoC lineage moves "
                f"everything found there aside. Give {type(callback).__name__}(dirpath=...) or "
                "checkpoint.storage.url another directory"
            )


def _partitioned_over_ranks(optimizer: torch.optim.Optimizer) -> bool:
    """A ZeRO optimizer whose state is spread over several ranks; the same answer on every rank (dense parameters
    are held by all of them)."""
    return isinstance(optimizer, ZeroAdamW) and any(len(h) > 1 for h in optimizer.partition.holders.values())
