"""The training state besides tensors, captured with every snapshot and handed back to Lightning on resume.

MoC saves parameters, buffers and optimizer state itself, unit by unit. Everything else Lightning keeps in a
checkpoint dict is captured here, on the training thread, as ``Trainer.save_checkpoint``'s
``dump_checkpoint`` would build it, minus the tensors: loops (with the stateful train loader's position in
the epoch), callbacks' ``state_dict``, optimizer hyperparameters, LR schedulers, the precision plugin
(a grad scaler), the datamodule's ``state_dict``, this rank's RNG streams, and whatever the
LightningModule and the callbacks add in ``on_save_checkpoint``. It is per rank: each rank stores its own.

The ``on_save_checkpoint`` hooks see the dict without tensors: its ``state_dict`` is empty and its
``optimizer_states`` hold hyperparameters only, because building those would stall every snapshot.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer import call

RNG_KEY = "moc_rng"
"""Where this rank's RNG streams go in the checkpoint dict (Lightning's own does not restore them)."""
_NO_TENSORS = ("state_dict",)
"""Keys the hooks are shown empty and that are not kept: MoC stores the tensors itself."""


def capture(trainer: L.Trainer, own_key: str) -> dict[str, Any]:
    """This rank's checkpoint dict without tensors, as of now (the end of a training step)."""
    # as Lightning's _call_callbacks_state_dict, but without building the caller's own (the engine's state travels
    # separately, as of the resume step): building it only to drop it cost every snapshot the ledger's conversion
    every: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    callbacks = {
        callback.state_key: state
        for callback in every
        if callback.state_key != own_key and (state := callback.state_dict())
    }
    checkpoint: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": L.__version__,
        "state_dict": {},
        "loops": trainer._checkpoint_connector._get_loops_state_dict(),
        "callbacks": callbacks,
        "optimizer_states": [{"param_groups": _param_groups(optimizer)} for optimizer in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    precision = trainer.precision_plugin
    if precision_state := precision.state_dict():
        checkpoint[precision.__class__.__qualname__] = precision_state
    precision.on_save_checkpoint(checkpoint)
    datamodule = getattr(trainer, "datamodule", None)  # Lightning's data connector sets it; Trainer does not declare it
    if datamodule is not None:
        if datamodule_state := call._call_lightning_datamodule_hook(trainer, "state_dict"):
            checkpoint[datamodule.__class__.__qualname__] = datamodule_state
    call._call_callbacks_on_save_checkpoint(trainer, checkpoint)
    call._call_lightning_module_hook(trainer, "on_save_checkpoint", checkpoint)
    for key in _NO_TENSORS:
        checkpoint.pop(key, None)
    checkpoint[RNG_KEY] = _collect_rng_states(include_cuda=torch.cuda.is_available())
    return checkpoint


def _param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer.state_dict()["param_groups"]`` without building the per-parameter state."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyperparameters, "params": list(range(start, start + count))})
        start += count
    return groups


def derived_rng_states(step: int, rank: int) -> dict[str, Any]:
    """RNG streams for a rank whose own were lost: seeded from the step and the rank, so they are
    reproducible and differ between ranks (a copy of another rank's would repeat its dropout masks)."""
    seed = (step * 1_000_003 + rank) % 2**32
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    derived = _collect_rng_states(include_cuda=torch.cuda.is_available())
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    return derived


def warn_if_not_resumable(trainer: L.Trainer) -> None:
    """One warning when a train loader has no ``state_dict``: a MoC resume is always mid-epoch."""
    loader = trainer.fit_loop._combined_loader
    loaders = loader.flattened if loader is not None else []
    plain = [type(dl).__name__ for dl in loaders if not isinstance(dl, _Stateful)]
    if plain:
        warnings.warn(
            f"[moc_lightning] the train dataloader ({', '.join(plain)}) is not stateful: after a resume, which is "
            "always mid-epoch, it starts its epoch over, so the steps after the resume step see the epoch's "
            "first samples again and the rest of that epoch is never seen. Give it state_dict/"
            "load_state_dict (e.g. moc_lightning.data.StatefulDataLoader) to continue where it stopped.",
            stacklevel=2,
        )
