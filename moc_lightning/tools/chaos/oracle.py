"""The oracle: digests of the whole training state after every optimizer step, and the samples of every batch.

One JSON line per event per rank in ``<out>/rank<r>.jsonl``, appended and fsynced, so the records of every
incarnation of a job survive its crashes (a SIGKILL loses at most the line being written, which the reader
skips). Events:

- ``start`` (``on_train_start``): the state training begins from, with the global step; after a resume it is
  the restored state and carries MoC's recovery report (``<default_root_dir>/moc_recovery/rank<r>.json``,
  read as a user would), at step 0 it is the initial state;
- ``step`` (``on_train_batch_end``): the state after optimizer step ``step`` and the sample ids of the batch
  that produced it;
- ``restored`` (:class:`AfterRestore`, replay mode): the state the first new step of a fit begins from, once MoC's
  replay has run: at the first ``on_train_batch_start``, or at ``on_fit_end`` when the fit ran no batch (a resume at
  ``max_steps``), where the final persist is about to write it.

Digests are keyed by what a user would name the tensor: ``param/<fqn>``, ``buffer/<fqn>`` (persistent
buffers), ``optim/<param fqn>/<state name>``, ``lr/<param group>``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

INCARNATION_ENV = "MOC_INCARNATION"


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a tensor's dtype, shape and bytes: equal digests mean bitwise equal tensors; of a DTensor, this rank's
    piece of it (what this rank holds, gathering nothing)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:20]


def state_digests(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, str]:
    """Digest of every parameter, persistent buffer, optimizer state tensor and learning rate."""
    params = dict(module.named_parameters())
    digests = {f"param/{name}": tensor_digest(p) for name, p in params.items()}
    for name, value in module.state_dict().items():
        if name not in params and isinstance(value, torch.Tensor):
            digests[f"buffer/{name}"] = tensor_digest(value)
    if optimizer is not None:
        for name, p in params.items():
            for state_name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    digests[f"optim/{name}/{state_name}"] = tensor_digest(value)
        for i, group in enumerate(optimizer.param_groups):
            digests[f"lr/{i}"] = repr(float(group["lr"]))
    return digests


def sample_ids(batch: Any) -> list[str]:
    """One id per sequence: a digest of its input tokens (the reference data's windows do not overlap)."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:12] for row in inputs]


def recovery_report(trainer: L.Trainer) -> dict[str, Any] | None:
    """MoC's report of this rank's resume (``<default_root_dir>/moc_recovery/rank<r>.json``), read as a user would;
    ``None`` where this fit did not resume (the harness removes the folder before each incarnation)."""
    path = Path(trainer.default_root_dir) / "moc_recovery" / f"rank{trainer.global_rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


class Oracle(L.Callback):
    """Records the training state and data of every step, independently of MoC, for :mod:`.checks`."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.incarnation = int(os.environ.get(INCARNATION_ENV, "0"))
        self._file: Any = None
        self._started = False

    def write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        """Append ``record`` to this rank's file, flushed and fsynced: a kill right after it loses none of it."""
        if self._file is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out / f"rank{trainer.global_rank}.jsonl", "a")  # noqa: SIM115 (lives with the run)
        record = {"inc": self.incarnation, "rank": trainer.global_rank, **record}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def digests(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, str]:
        """:func:`state_digests` of the module and the trainer's optimizer, as they are now."""
        return state_digests(module, trainer.optimizers[0] if trainer.optimizers else None)

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._started = False

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._start(trainer, module)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A fit resumed at ``max_steps`` runs no batch and calls no ``on_train_start``: its ``start`` is recorded
        here (before MoC's final persist, a checkpoint callback's hook running after the others'), so that the
        restore is checked and the run seen complete. Over ``s3://`` a kill inside a slow persist lands there often:
        training reached ``max_steps`` while the persist was still writing."""
        if not self._started:
            self._start(trainer, module)

    def _start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._started = True
        step = trainer.global_step
        report = recovery_report(trainer) if step > 0 else None
        self.write(trainer, {"kind": "start", "step": step, "digests": self.digests(trainer, module),
                             "report": report})

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.write(trainer, {"kind": "step", "step": trainer.global_step, "samples": sample_ids(batch),
                             "digests": self.digests(trainer, module)})

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class AfterRestore(L.Callback):
    """Records, into ``oracle``'s file, the state a fit's first new step begins from (``restored`` events).

    Apart from :class:`Oracle`'s ``start`` event because a fit that runs no batch (resumed at ``max_steps``) calls no
    ``on_train_start``: it is recorded at ``on_fit_end``, before MoC's final persist writes that state (a checkpoint
    callback's hooks run after the others'). Otherwise at the first batch start, after every callback's
    ``on_train_start``: a replay finished only there (before the fix of issue 28, MoC replayed in its own
    ``on_train_start``) would still be seen complete, so the check holds the state the first step begins from."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self._recorded = False

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._recorded = False

    def _record(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._recorded:
            return
        self._recorded = True
        digests = self.oracle.digests(trainer, module)
        self.oracle.write(trainer, {"kind": "restored", "step": trainer.global_step, "digests": digests,
                                    "report": recovery_report(trainer)})

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._record(trainer, module)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._record(trainer, module)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one rank's file, in order; a torn last line (a kill mid-write) is skipped."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
