"""``checkpoint.mode=replay`` under every ``trainer.data_parallel`` mode (``ddp``, ``zero2``, ``fsdp2``, ``hsdp``) on 2
and 4 ranks (gloo, CPU), with and without expert parallelism: after a crash at a random step (and, in some cases, a
rank's lost shared memory or storage write), a new Trainer on every rank agrees on the newest window that all ranks
have, replays it together through the strategy's ``training_step`` (DDP-wrapped, or FSDP2-sharded), and every rank
lands bitwise on the uninterrupted run's state (every parameter, buffer and optimizer tensor it holds: under
``zero2`` a unit's optimizer state is on its owner only, under ``fsdp2``/``hsdp`` a rank holds its shards), then
trains on bitwise identically to ``max_steps``. The resume runs in the crashed fit's processes (a spawn costs tens of
seconds on the test machine); nothing of the crashed Trainer, module or optimizer carries over."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_run import MODEL, Crash, Recorder, cpu_trainer, datamodule, moc_config
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from moc_lightning.config import CheckpointConfig, ReplayConfig
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import SHARDED_DATA_PARALLEL
from moc_lightning.replay.driver import WindowLog
from moc_lightning.replay.window_file import WINDOW_SLOTS
from moc_lightning.replay.window_store import STORAGE_COPIES, WINDOW_SUFFIX, head_object, memory_head, window_object
from moc_lightning.storage import make_storage

MAX_STEPS = 10
WINDOW = 3
CLIP = 0.05
"""Small enough that the module's global-norm clipping (a collective under EP) acts."""
NOISY = replace(MODEL, gate_noise=0.1)
"""Noisy gating: each iteration draws from its rank's RNG streams, which the replay must repeat."""


def _crash_step(low: int) -> int:
    """A seeded random step in ``[low, MAX_STEPS)`` (``MOC_REPLAY_SEED`` picks another), printed."""
    seed = int(os.environ.get("MOC_REPLAY_SEED", "14"))
    step = random.Random(f"{seed}/{low}").randrange(low, MAX_STEPS)
    print(f"seed {seed}: crash after step {step}")
    return step


class RankSeed(L.Callback):
    """Per-rank RNG streams that differ (the model's initialisation seeds its own)."""

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


class FirstStep(Recorder):
    """The state as the first step of a fit begins: after MoC's replay (Lightning calls a checkpoint callback's
    ``on_train_start`` after the other callbacks')."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.start_step is None:
            self.start_step = trainer.global_step
            self.start = self._tensors(trainer, module)
            self.stored = _stored_ends(Path(trainer.default_root_dir).parent, trainer.global_rank)


FAULTS = {
    "crash": "every rank's windows are in memory and storage",
    "rank1_lost_its_newest_window": "rank 1 was killed before placing its newest window (not in memory nor storage)",
    "rank1_node_lost_rank0_write_lost": (
        "rank 1's node was replaced (its shared memory is gone), rank 0's newest storage write never landed"
    ),
}
"""What happened besides the crash, by name."""


def _stored_ends(root: Path, rank: int) -> list[int]:
    """End steps of the windows in ``rank``'s storage objects, oldest first."""
    storage = make_storage("filesystem", (root / "ckpt").as_uri())
    found = (storage.get(window_object(rank, index)) for index in range(STORAGE_COPIES))
    return sorted(WindowLog.from_bytes(data)[0].end_step for data in found if data is not None)


def _newest_end(crash: int) -> int:
    """The end of the newest window a fit crashed after step ``crash`` completed: the crash comes before MoC's hook
    of that step (Lightning runs checkpoint callbacks last), so a window ending there is not captured."""
    return (crash - 1) // WINDOW * WINDOW


def _lose(root: Path, rank: int, crash: int, memory: bool, storage: bool) -> None:
    """Remove ``rank``'s newest window, with its head, from memory and/or storage."""
    index = _newest_end(crash) // WINDOW - 1
    if memory:
        (copy,) = (root / "shm").rglob(f"rank{rank}.replay_window{index % WINDOW_SLOTS}{WINDOW_SUFFIX}")
        copy.unlink()
        memory_head(copy).unlink()
    if storage:
        for name in (window_object(rank, index), head_object(rank, index)):
            (root / "ckpt" / name).unlink()


def _config(root: Path) -> CheckpointConfig:
    return moc_config(root, mode="replay", replay=ReplayConfig(window=WINDOW))


def _fit(
    root: Path, devices: int, ep: int, data_parallel: str, callbacks: list[L.Callback], **kw: Any
) -> MoCCheckpoint:
    """A fit under ``data_parallel``: ``fsdp2``/``hsdp`` through ``ModelParallelStrategy`` (as the recipe builds it),
    ``hsdp`` sharded within halves of the ranks and replicated across them."""
    moc = MoCCheckpoint(_config(root))
    callbacks = [moc, RankSeed(), *callbacks]
    if data_parallel in SHARDED_DATA_PARALLEL:
        kw["strategy"] = ModelParallelStrategy(
            data_parallel_size=devices, tensor_parallel_size=1, process_group_backend="gloo"
        )
    trainer = cpu_trainer(root / "run", MAX_STEPS, callbacks, devices=devices, gradient_clip_val=CLIP, **kw)
    shard_size = devices // 2 if data_parallel == "hsdp" else None
    module = GPTMoEModule(NOISY, ep=ep, seed=0, data_parallel=data_parallel, hsdp_shard_size=shard_size)
    trainer.fit(module, datamodule=datamodule(NOISY), ckpt_path=moc.resume_target())
    return moc


def _logged_dtypes(root: Path, rank: int) -> set[str]:
    """The dtypes of the frozen units' weights logged in ``rank``'s first stored window (the file's regions)."""
    data = make_storage("filesystem", (root / "ckpt").as_uri()).get(window_object(rank, 0))
    logged = WindowLog.from_bytes(data)[0].record.logged
    return {str(tensor.dtype) for tensors in logged for key, tensor in tensors.items() if "/param/" in key}


def _compute_dtype(precision: str, data_parallel: str) -> torch.dtype:
    """The dtype the forward reads the weights in, which a window logs frozen units' weights in: bf16 where the weights
    are bf16 (``bf16-true``) or FSDP2's ``MixedPrecisionPolicy`` all-gathers them in bf16 (``bf16-mixed`` under
    ``fsdp2``/``hsdp``); fp32 otherwise (under DDP and ZeRO-2 ``bf16-mixed``'s autocast keeps some ops in fp32)."""
    sharded_bf16 = precision == "bf16-mixed" and data_parallel in SHARDED_DATA_PARALLEL
    return torch.bfloat16 if precision == "bf16-true" or sharded_bf16 else torch.float32


def _runs(
    rank: int, world_size: int, root: str, ep: int, crash: int, fault: str, precision: str, data_parallel: str
) -> dict[str, Any]:
    """The uninterrupted run (its state at every window's end and at ``max_steps``); a run that crashes after step
    ``crash`` on every rank, then ``fault`` (:data:`FAULTS`); its resume in a new Trainer (the state as its first
    step begins, the windows in storage then, and the state at ``max_steps``)."""
    straight = Recorder(at=(*range(WINDOW, MAX_STEPS, WINDOW), MAX_STEPS), model=NOISY)
    uninterrupted = _fit(Path(root) / "straight", world_size, ep, data_parallel, [straight], precision=precision)
    try:
        crashing = Recorder(crash_after=crash, model=NOISY)
        _fit(Path(root) / "faulty", world_size, ep, data_parallel, [crashing], precision=precision)
    except Crash:
        pass
    faulty = Path(root) / "faulty"
    if fault == "rank1_lost_its_newest_window" and rank == 1:
        _lose(faulty, rank, crash, memory=True, storage=True)
    if fault == "rank1_node_lost_rank0_write_lost":
        _lose(faulty, rank, crash, memory=rank == 1, storage=rank == 0)
    torch.distributed.barrier()
    resumed = FirstStep(at=(MAX_STEPS,), model=NOISY)
    logger = CSVLogger(Path(root) / "faulty" / "logs", name="", version="")
    moc = _fit(Path(root) / "faulty", world_size, ep, data_parallel, [resumed], logger=logger, precision=precision)
    return {
        "straight": straight.states,
        "report": asdict(moc.replay_report) if moc.replay_report is not None else None,
        "start_step": resumed.start_step,
        "start": resumed.start,
        "stored": resumed.stored,
        "final": resumed.states[MAX_STEPS],
        "memory": list(uninterrupted.window_memory.per_iteration),
        "logged": _logged_dtypes(Path(root) / "straight", rank),
        "copied": uninterrupted.capture.copied_bytes[:WINDOW],
    }


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "ep", "fault", "precision", "data_parallel"),
    [
        (2, 1, "crash", "32-true", "ddp"),
        (2, 2, "crash", "bf16-mixed", "ddp"),
        (4, 2, "rank1_lost_its_newest_window", "32-true", "ddp"),
        (2, 1, "rank1_node_lost_rank0_write_lost", "32-true", "ddp"),
        (2, 1, "crash", "32-true", "zero2"),
        (2, 2, "crash", "bf16-true", "zero2"),
        (2, 1, "rank1_node_lost_rank0_write_lost", "bf16-mixed", "zero2"),
        (4, 2, "crash", "bf16-true", "zero2"),
        (2, 1, "crash", "32-true", "fsdp2"),
        (2, 2, "crash", "32-true", "fsdp2"),
        (2, 1, "rank1_node_lost_rank0_write_lost", "bf16-mixed", "fsdp2"),
        (4, 1, "crash", "32-true", "hsdp"),
    ],  # replayed bitwise too, left out for time: 4 ranks at ep=1 in bf16-true under zero2 (110 s on a loaded machine),
    # 4 ranks at ep=2 in fp32 under zero2 (the mode and ranks of the case above, its bf16 the harder test), and 4 ranks
    # at ep=1 in bf16-mixed under hsdp (162 s on a loaded machine)
    ids=[
        "2_ranks_ddp", "2_ranks_ep2_bf16_mixed", "4_ranks_ep2_rank1_lost_its_newest_window",
        "2_ranks_rank1_node_lost_rank0_write_lost", "2_ranks_zero2",
        "2_ranks_zero2_ep2_bf16_true", "2_ranks_zero2_bf16_mixed_rank1_node_lost_rank0_write_lost",
        "4_ranks_zero2_ep2_bf16_true", "2_ranks_fsdp2", "2_ranks_fsdp2_ep2",
        "2_ranks_fsdp2_bf16_mixed_rank1_node_lost_rank0_write_lost", "4_ranks_hsdp",
    ],
)
def test_ranks_replay_the_same_window_and_end_bitwise_on_the_uninterrupted_state(
    tmp_path: Path, world_size: int, ep: int, fault: str, precision: str, data_parallel: str
) -> None:
    """``rank1_lost_its_newest_window``: the ranks agree on the window before the newest. With rank 1's node lost
    and rank 0's newest storage write lost, every rank still has the newest window (rank 0 in memory, rank 1 in
    storage): they resume there, and rank 0 stores it before training. Frozen units' weights are logged in the dtype
    the forward reads them in (:func:`_compute_dtype`; failed on fea7f32 under ``fsdp2`` at ``bf16-mixed``: fp32), and
    the memory report counts them so."""
    lose_newest = fault == "rank1_lost_its_newest_window"
    crash = _crash_step(WINDOW + 1 if fault == "crash" else 2 * WINDOW)  # two windows before a lost one
    print(f"{fault}: {FAULTS[fault]}")
    ranks = run_ranks(
        _runs, world_size, tmp_path, str(tmp_path), ep, crash, fault, precision, data_parallel,
        init_process_group=False,
    )

    resume_step = _newest_end(crash) - (WINDOW if lose_newest else 0)
    for rank, run in enumerate(ranks):
        report = run["report"]
        print(f"rank {rank}: {report}; in storage at the first new step: windows ending at {run['stored']}")
        assert report is not None and report["resume_step"] == resume_step == run["start_step"]
        assert report["replay_iterations"] == WINDOW - 1 and report["plt"] == 0.0
        assert resume_step in run["stored"], f"rank {rank} has the resumed window in storage before training"
        from_memory = fault == "crash" or (fault == "rank1_node_lost_rank0_write_lost" and rank == 0)
        assert report["source"] == ("memory" if from_memory else "storage")
        assert _differing(run["start"], run["straight"][resume_step]) == [], f"rank {rank} after the replay"
        assert _differing(run["final"], run["straight"][MAX_STEPS]) == [], f"rank {rank} at max_steps"
        assert run["logged"] == {str(_compute_dtype(precision, data_parallel))}, f"rank {rank}'s logged weights"
        if data_parallel in SHARDED_DATA_PARALLEL:  # the memory report counts the pieces the captures copy
            assert run["memory"] == pytest.approx(run["copied"], rel=1e-3), f"rank {rank}'s memory report"
    logged = (tmp_path / "faulty" / "logs" / "metrics.csv").read_text()
    assert "moc/replay_iterations" in logged and "moc/replay_seconds" in logged


class BucketLayouts(L.Callback):
    """The gradient buckets DDP reduced in each iteration of a fit (their parameters' names, bucket by bucket): those
    of the backward between the module's ``on_before_backward`` and ``on_after_backward``, which Lightning's loop and
    a replayed iteration call. A comm hook (the default all-reduce's Python twin) notes the buckets; it is
    registered in ``on_fit_start``, once the strategy has wrapped the model and before Lightning's restore, where MoC
    replays."""

    def __init__(self) -> None:
        self.layouts: list[tuple[tuple[str, ...], ...]] = []
        self._pending: list[tuple[str, ...]] = []

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        ddp = trainer.strategy.model
        names = {id(p): name for name, p in ddp.module.named_parameters()}

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations (future import)
            self._pending.append(tuple(names[id(p)] for p in bucket.parameters()))
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        module.on_before_backward = self._open  # type: ignore[method-assign]
        module.on_after_backward = self._close  # type: ignore[method-assign]

    def _open(self, loss: torch.Tensor) -> None:
        self._pending = []

    def _close(self) -> None:
        self.layouts.append(tuple(sorted(self._pending, key=lambda names: names[0])))


def _layouts(rank: int, world_size: int, root: str, crash: int) -> dict[str, Any]:
    """The bucket layouts of a fit's steps until it crashes as global step ``crash`` ends, and of its resume."""
    faulty = BucketLayouts()
    try:
        _fit(Path(root), world_size, 1, "ddp", [faulty, Recorder(crash_after=crash, model=NOISY)])
    except Crash:
        pass
    torch.distributed.barrier()
    resumed = BucketLayouts()
    moc = _fit(Path(root), world_size, 1, "ddp", [resumed])
    return {"faulty": faulty.layouts, "resumed": resumed.layouts, "report": asdict(moc.replay_report)}


@pytest.mark.slow
def test_a_replayed_iteration_reduces_its_gradients_in_the_buckets_of_the_uninterrupted_one(tmp_path: Path) -> None:
    """DDP buckets a fit's first backward by parameter order and rebuilds them after it, in the order the gradients
    became ready; more than two ranks sum each element in an order given by its place in its bucket (gloo's ring,
    NCCL's too), so an iteration reduced in other buckets differs in the last bits. A replay runs in a new process,
    whose DDP has not rebuilt yet: its first replayed iteration must still reduce as the uninterrupted run did, in the
    rebuilt buckets every step after the first used (under bf16 at 4 ranks and ep=2 the dense gradients, and through
    the clipping norm every gradient, came out a bit off). Two ranks suffice to see the buckets, though their sums
    agree in any order; the steps before the crash stand for the uninterrupted run."""
    crash = _crash_step(WINDOW + 1)
    ranks = run_ranks(_layouts, 2, tmp_path, str(tmp_path), crash, init_process_group=False)
    for rank, run in enumerate(ranks):
        faulty, resumed, report = run["faulty"], run["resumed"], run["report"]
        rebuilt = faulty[1]
        assert len(faulty) == crash and faulty[0] != rebuilt, "DDP rebuilds its buckets after the first step"
        assert faulty[1:] == [rebuilt] * (crash - 1), "and keeps them"
        replayed = report["window_start"] + 1  # the window's first iteration is restored, not replayed
        assert resumed == [rebuilt] * (MAX_STEPS - replayed), f"rank {rank}: the replayed and the resumed steps"


@pytest.mark.parametrize("data_parallel", ["fsdp2", "hsdp"])
def test_replay_refuses_a_sharded_mode_under_a_strategy_that_does_not_shard_by_name(
    tmp_path: Path, data_parallel: str
) -> None:
    """``fsdp2``/``hsdp`` replay under ``ModelParallelStrategy`` only (a one-device Trainer here), refused before
    training with the mode and the strategy named."""
    recorder = Recorder()
    moc = MoCCheckpoint(_config(tmp_path))
    trainer = cpu_trainer(tmp_path / "run", MAX_STEPS, [moc, recorder])
    with pytest.raises(ValueError, match=None) as err:
        trainer.fit(GPTMoEModule(MODEL, data_parallel=data_parallel), datamodule=datamodule())
    assert f"checkpoint.mode=replay with trainer.data_parallel={data_parallel} under SingleDeviceStrategy" in str(
        err.value
    )
    assert "use checkpoint.mode=pec otherwise" in str(err.value)
    assert recorder.start_step is None, "refused before training started"
