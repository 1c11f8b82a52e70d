"""What ``validate``/``test``/``predict`` load through MoC, and what ``ckpt_path="best"`` means there.

``fit(ckpt_path=<storage URL>)`` is a recovery: it takes each unit from the newest surviving snapshot or
checkpoint, accounts the PLT of the fault, and commits a new segment of the lineage before training goes on.
Evaluating is no fault and continues no lineage: :func:`load_newest` takes the weights and buffers of the
newest committed checkpoint's dense units and each expert's newest stored version (the choice
:meth:`PECCheckpointer.load_latest` makes, and what ``moc-consolidate`` writes), reads no snapshot slot,
and commits nothing (a damaged checkpoint is still dropped from the manifest, as every load does).

MoC monitors no metric, so it has no "best" checkpoint: :func:`no_best` is the error for Lightning's
``ckpt_path="best"``.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from moc_lightning.config import CheckpointConfig
from moc_lightning.engine.lineage import Lineage, fingerprint
from moc_lightning.lightning.engines import model_layout, model_topology, new_pec
from moc_lightning.lightning.start import agreed_manifest
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.pec.checkpointer import PECCheckpointer


class NoBestCheckpoint(ValueError, AttributeError):
    """``ckpt_path="best"`` with ``MoCCheckpoint`` as the Trainer's checkpoint callback.

    Also an ``AttributeError``, so that ``hasattr(moc, "best_model_path")`` is ``False`` (Lightning's spawn
    launchers probe it) while Lightning's ``ckpt_path="best"`` gets this message.
    """


def no_best(fn: str | None, url: str) -> NoBestCheckpoint:
    """The error for ``fn(ckpt_path="best")`` (``fn``: ``validate``, ``test``, ``predict``; ``None``: unknown)."""
    call = f"trainer.{fn or 'validate/test/predict'}"
    return NoBestCheckpoint(
        f"ckpt_path='best' has no meaning with MoCCheckpoint, which monitors no metric (Lightning also takes it "
        f"for {call}() without a model and without ckpt_path). Allowed: {call}(model) for the model's current "
        f"weights; ckpt_path='last' or the MoC storage URL ({url or 'checkpoint.storage.url'}) for MoC's newest "
        "committed checkpoint; or the path of a Lightning checkpoint file (a ModelCheckpoint's best_model_path)"
    )


def load_newest(pec: PECCheckpointer, fn: str) -> int:
    """Load the newest committed weights of ``pec``'s storage into its model (collective); returns their step.

    ``pec`` must be the caller's own, built for this load (its layout needs no optimizer): the load sets its
    selection, ledger and K to the checkpoint's, which a training engine must not take from an evaluation.
    """
    url = pec.storage.url
    manifest = agreed_manifest(pec)
    if manifest.latest is None:
        raise ValueError(
            f"{fn}(ckpt_path={url!r}) loads MoC's newest committed checkpoint, but no checkpoint is committed "
            f"under {url} (a run commits its first with its first persist); pass the model without ckpt_path "
            "to evaluate its current weights, or the storage URL of a run that has persisted"
        )
    if manifest.lineage is not None:
        Lineage(manifest.lineage.run_id, fingerprint(pec.layout)).check_same_run(manifest.lineage, url)
    report = pec.load_latest()
    if report is None:
        raise ValueError(f"{fn}(ckpt_path={url!r}): no checkpoint under {url} is readable (the log says why)")
    return report.resume_step


def newest_weights(
    module: L.LightningModule, config: CheckpointConfig, preset: str, engine: TwoLevelCheckpointer | None, fn: str
) -> dict[str, Any]:
    """What ``fn`` (``validate``/``test``/``predict``) with the storage URL restores: the newest committed weights,
    loaded by an engine of their own (:func:`load_newest`; ``engine``, the training one if there is one, lends only
    its process group), so the training engine and the lineage stay as they are."""
    topology = model_topology(module)
    layout = model_layout(module, None, topology, config, preset)
    step = load_newest(new_pec(config, module, layout, topology, engine), fn)
    return {"pytorch-lightning_version": L.__version__, "global_step": step, "state_dict": module.state_dict()}
