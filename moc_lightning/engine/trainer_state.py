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

import copy
import dataclasses
import random
import warnings
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
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
        "loops": loops_state(trainer),
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


def loops_state(trainer: L.Trainer) -> dict[str, Any]:
    """Lightning's ``_CheckpointConnector._get_loops_state_dict()``, every loop's ``state_dict``, built as Lightning
    builds it but with each progress counter read field by field: ``dataclasses.asdict``'s generic deep copy of the
    counters took three quarters of a capture (0.3 of 0.4 ms on the reference machine, on the training thread at every
    snapshot). ``tests/test_training_state_lightning.py`` holds it equal to Lightning's own."""
    return {name: _loop_state(getattr(trainer, name)) for name in _LOOPS}


_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


def _loop_state(loop: _Loop, destination: dict[str, Any] | None = None, prefix: str = "") -> dict[str, Any]:
    """``_Loop.state_dict``: the loop's own ``on_save_checkpoint``, its progress counters and its child loops'."""
    destination = {} if destination is None else destination
    destination[prefix + "state_dict"] = loop.on_save_checkpoint()
    for name, value in loop.__dict__.items():
        if isinstance(value, _BaseProgress):
            destination[prefix + name] = _progress_state(value)
        elif isinstance(value, _Loop):
            _loop_state(value, destination, prefix + name + ".")
    return destination


def _progress_state(progress: _BaseProgress) -> dict[str, Any]:
    """``dataclasses.asdict`` of a progress counter: its fields, nested counters as dicts, other values copied."""
    kind = type(progress)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(field.name for field in dataclasses.fields(progress))
    state: dict[str, Any] = {}
    for name in names:
        value = getattr(progress, name)
        if isinstance(value, _BaseProgress):
            state[name] = _progress_state(value)
        else:
            state[name] = value if isinstance(value, (int, float, bool, str, type(None))) else copy.deepcopy(value)
    return state


_FIELDS: dict[type, tuple[str, ...]] = {}
"""The field names of each progress counter class, as ``dataclasses.fields`` gives them (looked up once)."""


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
