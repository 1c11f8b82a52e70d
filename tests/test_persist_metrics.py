"""Every persist that lands is logged once (``moc/persist_bytes``, ``moc/persist_ms``, ``moc/persist_step``),
however late it finishes, the final full persist included. CI caught the first version logging a persist
only when it happened to be done at the next snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning_run import MODEL, cpu_trainer, datamodule, moc_config

from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models.lightning import GPTMoEModule


class MetricsLog(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def test_each_persist_that_lands_is_logged_once_with_its_step_and_bytes(tmp_path: Path) -> None:
    log = MetricsLog()
    # A snapshot at step 4 is persisted (its persist ends after the last snapshot of the run); step 6 is
    # persisted whole at the end of fit.
    moc = MoCCheckpoint(moc_config(tmp_path, every_n_train_steps=4, persist_every_n_snapshots=1))
    trainer = cpu_trainer(tmp_path / "run", 6, [moc], logger=log, log_every_n_steps=1)
    trainer.fit(GPTMoEModule(MODEL, seed=0), datamodule=datamodule(MODEL))

    stats = moc.engine.stats
    landed = [*stats.persist_reports, stats.final_persist]
    logged = [m for _, m in log.rows if "moc/persist_bytes" in m]
    assert [m["moc/persist_step"] for m in logged] == [4.0, 6.0]
    assert [m["moc/persist_bytes"] for m in logged] == [float(r.bytes_written) for r in landed]
    assert all(m["moc/persist_ms"] > 0 for m in logged)
