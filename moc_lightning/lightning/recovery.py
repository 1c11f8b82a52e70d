"""The checkpoint dicts a fit's MoC restore hands Lightning, which restores loops, optimizers and schedulers from them.

A two-level recovery or a replay-mode resume has put the recovered tensors into the module and optimizer already;
the dict carries them as they are now with the rest of the training state this rank captured
(:func:`checkpoint_from`). Where there is nothing to resume, the dict is the module as it is with everything else
fresh (:func:`fresh_checkpoint`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from moc_lightning.lightning.engines import ensure_lineage
from moc_lightning.memory.two_level import TwoLevelCheckpointer


def restore_optimizer(trainer: L.Trainer, module: L.LightningModule) -> torch.optim.Optimizer:
    """The optimizer a recovery restores into: one shaped like the module's, for Lightning to load the restored
    state into its own, or the trainer's where the strategy restores optimizers itself, after their set-up
    (``ModelParallelStrategy``)."""
    if trainer.strategy.lightning_restore_optimizer or not trainer.optimizers:
        return _fresh_optimizer(module)
    return trainer.optimizers[0]


def checkpoint_from(
    checkpoint: dict[str, Any],
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    state_key: str,
    engine: TwoLevelCheckpointer,
) -> dict[str, Any]:
    """The checkpoint dict Lightning restores from: a captured trainer state with the module's and the
    optimizer's tensors as they are now (MoC has put the recovered ones there) and the engine's state (under the
    callback's ``state_key``)."""
    checkpoint["state_dict"] = module.state_dict()
    optimizer_state = optimizer.state_dict()
    saved = checkpoint.get("optimizer_states") or [{}]
    groups = optimizer_state["param_groups"]
    optimizer_state["param_groups"] = _hyperparameters_over(groups, saved[0].get("param_groups"))
    checkpoint["optimizer_states"] = [optimizer_state]
    checkpoint.setdefault("callbacks", {})[state_key] = engine.pec.state_dict()
    return checkpoint


def _hyperparameters_over(
    live: list[dict[str, Any]], saved: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The captured groups' hyperparameters (learning rate, betas, weight decay, as the schedule left them) over the
    live optimizer's groups, each keeping its own parameter indices: after a change of world size or EP degree a rank
    holds other parameters than the one that captured the state (2 ranks of EP 2 hold 2 of 4 experts each, one process
    all 4), and Lightning refuses a group whose size differs from the optimizer's."""
    if saved is None:
        return live
    if len(saved) != len(live):
        raise ValueError(
            f"the captured trainer state has {len(saved)} optimizer parameter group(s), this optimizer {len(live)}: "
            "configure_optimizers must build the groups it built when the checkpoint was taken"
        )
    return [{**captured, "params": own["params"]} for captured, own in zip(saved, live)]


def fresh_checkpoint(engine: TwoLevelCheckpointer, module: L.LightningModule, why: str) -> dict[str, Any]:
    """What Lightning restores when there is nothing to resume (``why``): the module as it is, fresh everything else,
    in the lineage the run is in or a new one."""
    lineage = ensure_lineage(engine, why)
    if engine.rank == 0:
        print(f"[moc_lightning] nothing to resume ({why}); training starts from step 0 in lineage {lineage.run_id}")
    return {
        "pytorch-lightning_version": L.__version__,
        "epoch": 0,
        "global_step": 0,
        "state_dict": module.state_dict(),
        "optimizer_states": [],
        "lr_schedulers": [],
    }


def _fresh_optimizer(module: L.LightningModule) -> torch.optim.Optimizer:
    """An optimizer shaped like the module's, to receive the restored state for Lightning to load (the first of what
    ``configure_optimizers`` returns, in any of the shapes Lightning accepts; taken as it is, as Lightning does)."""
    configured: Any = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        if isinstance(configured, (list, tuple)):
            configured = configured[0]
    return configured
