"""The benchmark's options (:class:`BenchConfig`, the schema of ``conf/bench.yaml``) and its constants."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from moc_lightning.data import DataConfig
from moc_lightning.jobs.training import TrainConfig, TrainerConfig
from moc_lightning.models.causal_lm import OptimConfig, check_data_parallel
from moc_lightning.models.gpt_moe import GPTMoEConfig
from moc_lightning.storage.location import parse_endpoint

METHODS = (
    "lightning_sync", "lightning_async", "dcp_async", "nvrx_local", "moc_full", "moc_paper", "moc_k1", "moc_replay",
)


PAPER_K = (4, 1)


"""The paper's (k_snapshot, k_persist) for N=16 experts; scaled to other N by :func:`scaled_k`."""


GB = 1e9


STALL_LIGHT_FACTOR = 1.5
STALL_SLACK_MS = 0.5
"""Issue 30 item 3: a MoC snapshot's mean stall is at most this factor times its copy at the speed of light, plus
this slack, in ms."""


STALL_PHASES = ("trainer_state", "agreement", "preparation", "copy", "wait", "hook")
"""Where a MoC snapshot's stall goes, on the training thread (:class:`~moc_lightning.memory.stats.StallPhases`, and
``hook``: the rest of the callback's two hooks, its batch end and the join before the next optimizer step)."""


STORAGES = ("local", "s3")
"""Where the benchmark persists: ``local`` (every method, against write+fsync) or ``s3`` (besides, the object-store
row: MoC through ``s3://`` against the same server's own PUT and GET,
:mod:`~moc_lightning.tools.bench.object_store`)."""


BENCH_DATA_PARALLEL = ("ddp", "zero2", "fsdp2")


"""``data_parallel`` modes the benchmark runs, of :data:`~moc_lightning.models.causal_lm.DATA_PARALLEL` (``hsdp`` is not
benched yet)."""


SETUP = "every method trains the same model from one seed on the same batches"


K_SCALING = "moc_paper: k = max(1, round(k_paper * N / 16)) with the paper's k_snapshot=4, k_persist=1 at N=16"


RESTORE_BOUND = 2.0


"""Issue 14 item 7: a replay recovery's restore (replay excluded) takes at most this many times the time of moving
the restored bytes at the speed of light: a copy from shared memory, a read from storage."""


RECOVER_MEASURED = (
    "in process: seconds from building a fresh module and Trainer to the start of the first training step "
    "after restoring the method's newest checkpoint (files on disk; MoC also its snapshot slots)"
)


@dataclass
class BenchConfig:
    """Root of ``conf/bench.yaml``: one model, one data order, every method."""

    model: GPTMoEConfig = field(default_factory=GPTMoEConfig)
    """The GPT-MoE whose state is checkpointed (``conf/model/``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Batches (``conf/data/``); every method sees the same ones."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW: its two moments are most of the checkpointed bytes."""
    steps: int = 20
    """Optimizer steps of each method's run."""
    every_n_train_steps: int = 5
    """Checkpoint interval of every method (MoC persists every snapshot)."""
    warmup_steps: int = 2
    """Leading iterations left out of the mean iteration time (allocator and thread-pool warm-up)."""
    replay_window: int = 8
    """W of ``moc_replay`` (``checkpoint.replay.window``): it captures every iteration, completing a window every W.
    8 rather than the callback's 4: a larger W copies less per iteration (small_16e: 59.6 MB against 84.5 MB at 4,
    a stall of 2.5% of an iteration against 4.2% on the 2-core reference machine) and replays up to 7 iterations on
    recovery (1.3-2.0 s there)."""
    replay_persist_every_n_windows: int = 4
    """``moc_replay``'s ``checkpoint.replay.persist_every_n_windows``: every window goes to shared memory, every this
    many to storage (the first window of a run included). 4 rather than the callback's 1: on the 2-core reference
    machine a stored window (477 MB at W=8) takes 0.2-0.5 s from training beside it even when written around the
    page cache, which at every window is 20-40% of iteration time; the line after the table gives the write
    bandwidth the storage level needs at this interval."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    """Methods to run, from :data:`METHODS`."""
    seed: int = 0
    """Seed of initialisation and data order, the same for every run."""
    accelerator: str = "cpu"
    """Lightning accelerator of each process's device."""
    devices: int = 1
    """Processes, one device each; above 1 the benchmark runs under ``torchrun --nproc-per-node=<devices>``."""
    data_parallel: str = "ddp"
    """``ddp``, ``zero2`` or ``fsdp2`` (``trainer.data_parallel``): how the processes hold the state. Under ``zero2``
    on several processes Lightning's ``ModelCheckpoint`` (rank 0's optimizer state only) is skipped, saying why."""
    precision: str = "32-true"
    """Lightning precision of every run (``trainer.precision``), one the ``data_parallel`` mode trains in: under
    ``fsdp2`` ``bf16-mixed`` computes in bf16 from fp32 sharded weights, and ``moc_replay`` logs its frozen units'
    weights in that bf16."""
    out: str = ""
    """JSON result file; empty: ``<run output dir>/bench.json``."""
    work_dir: str = ""
    """Where checkpoints are written (and the write+fsync bound measured); empty: ``<run output dir>/work``."""
    shm_root: str = ""
    """Directory in which a fresh, unique root for MoC's snapshot slots is made (and removed at the end);
    empty: ``/dev/shm`` where it exists (a tmpfs, as on real nodes), else the system temp directory."""
    storage: str = "local"
    """``local``: the methods' rows only. ``s3``: besides them (``methods=[]``: instead), the object-store row: MoC's
    persist and restore of the whole state through ``checkpoint.storage.backend=tensorstore url=s3://...``, each beside
    the same server's own multipart PUT and GET of the same bytes, in interleaved trials (one process only)."""
    endpoint: str = ""
    """``storage=s3``: the S3-compatible endpoint, ``http(s)://host[:port]``. Empty: ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL``; where neither is set, the benchmark starts moto's server on 127.0.0.1 (the ``dev`` extra)
    for the run. Keys come from the AWS environment, never from here."""
    bucket: str = ""
    """``storage=s3``: an existing bucket to write under (a fresh prefix, removed at the end); empty: a new bucket,
    made for the run and removed with its objects at the end."""
    s3_trials: int = 3
    """``storage=s3``: interleaved trials of MoC's persist, the PUT, MoC's restore and the GET; the best of each is
    kept, so that the same noise spares none of them."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"methods {unknown} are unknown; choose among: {', '.join(METHODS)}")
        check_data_parallel(self.data_parallel, BENCH_DATA_PARALLEL, by="recipes/bench.py")
        train_config(self, self.steps)  # the Trainer's own checks (precision against data_parallel), before any run
        for name in ("steps", "every_n_train_steps", "devices", "replay_window", "replay_persist_every_n_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < self.every_n_train_steps:
            raise ValueError("steps must be >= every_n_train_steps, or no method checkpoints at all")
        if "moc_replay" in self.methods and self.steps < self.replay_window:
            raise ValueError(f"steps must be >= replay_window={self.replay_window}, or moc_replay completes no window")
        if not 0 <= self.warmup_steps < self.steps - 1:
            raise ValueError(f"warmup_steps must be in [0, steps - 1), got {self.warmup_steps}")
        self._check_storage()

    def _check_storage(self) -> None:
        """``storage`` and its options, before any run: the object-store row needs boto3 and one process."""
        if self.storage not in STORAGES:
            raise ValueError(f"storage={self.storage!r} is not allowed; choose one of: {', '.join(STORAGES)}")
        if self.storage != "s3":
            if self.endpoint or self.bucket:
                raise ValueError(f"endpoint and bucket are for storage=s3, not storage={self.storage!r}")
            return
        if self.endpoint:
            parse_endpoint(self.endpoint, "endpoint")
        if self.s3_trials < 1:
            raise ValueError(f"s3_trials must be >= 1, got {self.s3_trials}")
        if self.devices != 1:
            raise ValueError(f"storage=s3 measures one process; got devices={self.devices}")
        if importlib.util.find_spec("boto3") is None:
            raise ValueError("storage=s3 times the endpoint's own PUT and GET with boto3: pip install boto3 (the dev "
                             "extra has it, and moto's server for a run with no endpoint)")


def register_configs() -> None:
    """Register the schema so ``conf/bench.yaml`` (``defaults: [bench_schema, ...]``) is type-checked."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


def scaled_k(value: int, num_experts: int) -> int:
    """The paper's K for N=16 experts scaled to ``num_experts``: ``max(1, round(value * N / 16))``."""
    return max(1, round(value * num_experts / 16))


class MethodUnavailable(RuntimeError):
    """A method cannot run on this machine; its row says why instead of carrying numbers."""


def train_config(cfg: BenchConfig, max_steps: int) -> TrainConfig:
    """``devices`` processes, one device each, no validation: only training and checkpointing take time."""
    trainer = TrainerConfig(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        data_parallel=cfg.data_parallel,
        precision=cfg.precision,
        max_steps=max_steps,
        val_check_interval=max_steps,
        limit_val_batches=0,
        log_every_n_steps=max_steps,
        enable_progress_bar=False,  # the benchmark prints its table; a bar would only redraw between its lines
    )
    return TrainConfig(model=cfg.model, data=cfg.data, optim=cfg.optim, trainer=trainer, seed=cfg.seed)
