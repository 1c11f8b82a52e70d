"""The options of MoC checkpointing (``checkpoint.*`` in Hydra), validated where they are built.

One dataclass per component, a docstring under every field, and validation in ``__post_init__``: a bad
value fails before training starts, with a message that names the option and what it allows. Checks that
need the model (``k_snapshot <= N``) run when the layout is known.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

from moc_lightning.engine.parts import SCOPES as PEC_SCOPES
from moc_lightning.sharding.ownership import STRATEGIES as SHARDING_STRATEGIES
from moc_lightning.storage.location import S3RetryConfig, parse_endpoint

SELECTION_POLICIES = ("sequential", "load_aware")
STORAGE_BACKENDS = ("filesystem", "tensorstore")
RESUME_MODES = ("auto", "never")
MODES = ("pec", "replay")
AUTO = "auto"
"""``checkpoint.replay.window=auto``: W chosen from measurements (:mod:`moc_lightning.replay.window_choice`)."""


def _require_choice(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{option}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def _require_at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}")


def _require_patterns(option: str, value: Sequence[str]) -> None:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{option} must be a list of regular expressions, got {value!r}")
    for pattern in value:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise ValueError(f"{option} holds {pattern!r}, which is not a regular expression: {err}") from None


@dataclass
class StorageConfig:
    """Where persisted checkpoints go."""

    backend: str = "filesystem"
    """``filesystem`` (DCP's file writer; local or shared file system) or ``tensorstore`` (zarr v3 arrays)."""
    url: str = ""
    """Checkpoint location, e.g. ``file:///scratch/run1/ckpt`` or (``tensorstore``) ``s3://bucket/run1``; empty means
    ``<run output dir>/checkpoints``."""
    endpoint: str = ""
    """An S3-compatible store's endpoint, ``http(s)://host[:port]`` (MinIO, Ceph, R2, a local test server), for an
    ``s3://`` URL on the ``tensorstore`` backend. Empty: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` as boto3
    reads them, else AWS itself. An option because TensorStore ignores those variables and a job's environment is
    not always the user's to set; keys never go here (the AWS environment or a profile holds them)."""
    retries: S3RetryConfig = field(default_factory=S3RetryConfig)
    """How an ``s3://`` request the store answered 5xx/429/``SlowDown`` or whose connection failed is retried:
    bounded, with backoff, each retry counted in the fit summary (``moc/storage_retries``)."""

    def __post_init__(self) -> None:
        _require_choice("checkpoint.storage.backend", self.backend, STORAGE_BACKENDS)
        if self.endpoint:
            parse_endpoint(self.endpoint, "checkpoint.storage.endpoint")
            if self.backend != "tensorstore" or urlparse(self.url).scheme != "s3":
                raise ValueError(
                    f"checkpoint.storage.endpoint={self.endpoint!r} is for an S3-compatible store: it needs "
                    f"checkpoint.storage.backend=tensorstore and checkpoint.storage.url=s3://BUCKET/path, not "
                    f"backend={self.backend!r} and url={self.url!r}; leave it empty otherwise"
                )


@dataclass
class DynamicKConfig:
    """Dynamic-K (paper section 5.3): double K after a recovery whose accumulated PLT passes the threshold."""

    enabled: bool = False
    """Whether K adapts to accumulated faults."""
    plt_threshold: float = 0.0375
    """Accumulated Proportion of Lost Tokens (a fraction, 0.0375 = 3.75%) above which K doubles."""

    def __post_init__(self) -> None:
        if not 0 < self.plt_threshold <= 1:
            raise ValueError(f"checkpoint.dynamic_k.plt_threshold must be in (0, 1], got {self.plt_threshold}")


@dataclass
class ReplayConfig:
    """Replay mode's window (``checkpoint.mode=replay``, :mod:`moc_lightning.replay.core`)."""

    window: int | str = 4
    """W, the iterations of a window: each unit's full state is captured once in it, and a recovery replays up to
    W-1 iterations. Larger W copies less per iteration and replays more; 1 captures every unit every iteration.
    ``auto``: chosen once the first iterations have run, from their measured time and the measured copy bandwidth
    (:mod:`moc_lightning.replay.window_choice`). Not the default: timing makes it vary from run to run, and tests and
    comparisons want a fixed W."""
    persist_every_n_windows: int = 1
    """Write every this many windows to storage (the first window of a run and every n-th after it, by window
    index, the same on every rank); every window goes to shared memory. A lost node resumes from the newest stored
    window, a crashed process from the newest one in memory; either way no token is lost, but a lost node
    recomputes the iterations since the stored window. A stored window is larger than a full checkpoint (every
    unit's full state plus the logged weights), so on a host with few cores its storage write is most of replay
    mode's cost (``recipes/bench.py``)."""

    def __post_init__(self) -> None:
        _require_at_least("checkpoint.replay.persist_every_n_windows", self.persist_every_n_windows, 1)
        if isinstance(self.window, str) and self.window != AUTO:
            raise ValueError(f"checkpoint.replay.window={self.window!r} is not allowed; choose an integer >= 1 or {AUTO}")
        if isinstance(self.window, int):
            _require_at_least("checkpoint.replay.window", self.window, 1)


@dataclass
class CheckpointConfig:
    """Partial Experts Checkpointing at two levels: in-memory snapshots and persists to storage."""

    enabled: bool = True
    """Whether the training recipe adds the MoC checkpoint callback."""
    mode: str = "pec"
    """``pec``: Partial Experts Checkpointing (a recovery loses the tokens of the experts it sends back to older
    versions, PLT). ``replay``: every iteration captures the full state of a rotating share of the units and the
    weights of the rest, and a recovery replays the newest complete window through the module's own
    ``training_step``, so every unit returns to its fault-free state (no lost tokens). This slice of replay runs
    every ``trainer.data_parallel`` mode: ``ddp``, ``fsdp2`` and ``hsdp`` at precision ``32-true`` or ``bf16-mixed``,
    ``zero2`` at ``32-true``, ``bf16-mixed`` or ``bf16-true`` (one process or several, with or without expert
    parallelism; see :mod:`moc_lightning.replay.driver`)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Replay mode's settings (read only with ``mode=replay``)."""
    k_snapshot: int = 2
    """Experts per MoE layer copied into each in-memory snapshot (1 <= k_snapshot <= N)."""
    k_persist: int = 1
    """Experts per MoE layer persisted to storage, chosen among the snapshot's (1 <= k_persist <= k_snapshot)."""
    pec_scope: str = "both"
    """Which part of an expert follows PEC (paper Figure 13a): ``both`` ("WO": weights and optimizer state of K
    experts per MoE layer per checkpoint), ``optimizer`` ("O": every expert's weights every time, the optimizer
    state of K) or ``weights`` ("W": every expert's optimizer state every time, the weights of K). Dense units
    are always saved whole. A recovery takes each part from its newest surviving copy; an expert loses the
    tokens it processed since its stalest part was saved (PLT, eq. 7)."""
    expert_buffers: list[str] = field(default_factory=list)
    """Regular expressions (``re.search`` on the fully qualified name) of per-expert buffers held by a MoE layer or its
    router that are expert state: their entries go to the experts and follow PEC. By default such a buffer (one entry
    per expert, dim 0: torchtitan's ``expert_bias``, DeepSeek-V3's ``e_score_correction_bias``, token counters) is
    routing state, restored with the router at the resume step; a buffer inside an expert's own module, or a stacked
    ``experts`` module, always stays with its expert. A pattern that names no buffer, or a buffer outside the MoE
    layers or without one entry per expert, is refused when the layout is built."""
    every_n_train_steps: int = 10
    """Snapshot interval in optimizer steps."""
    persist_every_n_snapshots: int = 2
    """Persist every this many snapshots."""
    complete_first_persist: bool = True
    """The first persist of a lineage, and the snapshot it is taken from, save every unit (eq. 5 bytes); later
    ones are PEC's. Without it, experts PEC has not reached yet have no stored version, and a recovery from
    storage returns them to their initial weights with no optimizer state. A persist is complete while some
    unit has no stored version in the lineage, so a failed first persist is retried complete and a resume
    whose first persist landed does not redo it. ``false``: every persist is PEC's (the paper's schedule)."""
    selection: str = "sequential"
    """Which experts a checkpoint takes: ``sequential`` (interleaved rotation) or ``load_aware``."""
    sharding: str = "adaptive"
    """Who writes which bytes: ``equal``, ``adaptive``, or the baselines ``rank0`` and ``dcp_default``."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Persist target."""
    shm_root: str = "/dev/shm/moc_lightning"
    """Node-local shared-memory directory that holds the snapshot slots."""
    ranks_per_node: int | None = None
    """Simulate nodes on one machine: ranks ``r // ranks_per_node`` share a node and its shared-memory root.
    ``null``: the real host is the node."""
    retention: int = 3
    """Persisted checkpoints to keep (never removing the only stored version of a unit)."""
    dynamic_k: DynamicKConfig = field(default_factory=DynamicKConfig)
    """Dynamic-K settings."""
    resume: str = "auto"
    """``auto``: recover from the newest surviving checkpoint at start-up; ``never``: start fresh."""
    persist_on_fit_end: bool = True
    """When ``fit`` ends, persist every unit (dense and all experts) at the last step, as ``ModelCheckpoint``'s
    ``save_last`` would: a finished run leaves one complete checkpoint, not experts spread over earlier steps."""
    remove_snapshots_on_fit_end: bool = True
    """When ``fit`` ends, remove this run's snapshot slots from shared memory. Set it to ``false`` to keep them
    for a planned restart that should resume from memory (with ``persist_on_fit_end=false``, the slots may hold
    the only copy of the last steps' experts)."""

    def __post_init__(self) -> None:
        _require_at_least("checkpoint.k_snapshot", self.k_snapshot, 1)
        _require_at_least("checkpoint.k_persist", self.k_persist, 1)
        if self.k_persist > self.k_snapshot:
            raise ValueError(
                f"checkpoint.k_persist={self.k_persist} must be <= checkpoint.k_snapshot={self.k_snapshot}: "
                "persisted experts are chosen among the snapshot's"
            )
        _require_at_least("checkpoint.every_n_train_steps", self.every_n_train_steps, 1)
        _require_at_least("checkpoint.persist_every_n_snapshots", self.persist_every_n_snapshots, 1)
        _require_at_least("checkpoint.retention", self.retention, 1)
        if self.ranks_per_node is not None:
            _require_at_least("checkpoint.ranks_per_node", self.ranks_per_node, 1)
        _require_choice("checkpoint.pec_scope", self.pec_scope, PEC_SCOPES)
        _require_choice("checkpoint.selection", self.selection, SELECTION_POLICIES)
        _require_choice("checkpoint.sharding", self.sharding, SHARDING_STRATEGIES)
        _require_choice("checkpoint.resume", self.resume, RESUME_MODES)
        _require_choice("checkpoint.mode", self.mode, MODES)
        _require_patterns("checkpoint.expert_buffers", self.expert_buffers)

    def validate_for(self, num_experts: int) -> None:
        """Checks that need the model: K can be at most the number of experts per MoE layer."""
        for option, k in (("checkpoint.k_snapshot", self.k_snapshot), ("checkpoint.k_persist", self.k_persist)):
            if k > num_experts:
                raise ValueError(f"{option}={k} must be <= the number of experts per MoE layer ({num_experts})")
