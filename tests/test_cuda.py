"""What only CUDA can get wrong: pinned slots on the rank's own device, the side-stream device-to-host copy, the wait
before the optimizer step, the host-to-device restore, NCCL expert parallelism, bf16 autocast, device memory.

Every test is marked ``cuda`` (``cuda(gpus=2)`` for two devices) and skipped, saying why, without them;
``make gpu-check`` (``scripts/gpu_check.py``) runs them all on a GPU node. They drive the library's own paths
(:class:`SnapshotStore` with ``pin_device``, :class:`TwoLevelCheckpointer` snapshots and recovery, the Lightning
callback), on the highest-numbered device, so that a path that silently uses device 0 shows where there are two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_expert_parallel import _ep_step, check_against_one_process

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.data import DataConfig, LMDataModule
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.routing import LayerCounts, read_routing
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.memory import snapshot
from moc_lightning.memory.snapshot import NUM_SLOTS, SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology, GPTMoE, GPTMoEConfig
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.tokens import TokenAccounting
from moc_lightning.runtime.background import background_executor
from moc_lightning.storage import make_storage

WIDE = GPTMoEConfig(block_size=32, n_layer=2, n_embd=512, n_head=4, num_experts=8)
"""Experts of 2 x 512 x 2048 weights: with AdamW's moments 0.25 GB of state, whose copy takes milliseconds."""


def _device() -> torch.device:
    """The highest-numbered device: a path that uses device 0 instead of the rank's shows where there are two."""
    return torch.device("cuda", torch.cuda.device_count() - 1)


def _batch(cfg: GPTMoEConfig, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _forward_backward(model: GPTMoE, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(model.cfg, next(model.parameters()).device, step)
    optimizer.zero_grad()
    _, loss, aux = model(x, y)
    (loss + aux).backward()


def _trained(device: torch.device, seed: int = 0, steps: int = 2) -> tuple[GPTMoE, torch.optim.Optimizer]:
    """The wide model on ``device`` after ``steps`` AdamW steps (so every expert that got tokens has its moments)."""
    torch.cuda.set_device(device)
    model = GPTMoE(WIDE, seed=seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        _forward_backward(model, optimizer, 100 * seed + step)
        optimizer.step()
    return model, optimizer


def _engine(model: GPTMoE, optimizer: torch.optim.Optimizer, root: Path) -> TwoLevelCheckpointer:
    """MoC's engine over ``model``: every unit in every snapshot, slots pinned for the model's device."""
    config = CheckpointConfig(
        k_snapshot=WIDE.num_experts, k_persist=WIDE.num_experts, every_n_train_steps=1,
        storage=StorageConfig(url=(root / "ckpt").as_uri()), shm_root=str(root / "shm"),
    )  # fmt: skip
    layout = build_layout(model, optimizer, num_experts=WIDE.num_experts)
    pec = PECCheckpointer(config, layout, ExpertParallelTopology(), make_storage("filesystem", config.storage.url))
    device = next(model.parameters()).device
    return TwoLevelCheckpointer(pec, SnapshotStore(root / "shm", pin_device=device))


def _state(engine: TwoLevelCheckpointer) -> dict[str, torch.Tensor]:
    """Every tensor the engine snapshots, as a host copy."""
    layout = engine.pec.layout
    return {k: v.detach().cpu().clone() for k, v in layout.pieces(layout.units).items()}


def _hold(stream: torch.cuda.Stream, seconds: float) -> torch.cuda.Event:
    """Keep ``stream`` busy for about ``seconds`` (a spin kernel, its cycles calibrated on this device) and return an
    event recorded after it. About: the clock may rise after the calibration (an idle H200 runs at 345 MHz, a busy
    one at 1980), so a test asks the event whether the hold is over rather than timing it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
    end.synchronize()
    cycles_per_s = 1_000_000 / (start.elapsed_time(end) / 1000)
    held = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * cycles_per_s))
        held.record()
    return held


@pytest.mark.cuda
def test_slots_are_pinned_for_the_device_and_a_failed_pin_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``reserve`` page-locks every slot (``cudaHostRegister``), so the side-stream copy is asynchronous; the real
    runtime's error code is checked: a registration the driver refuses is an error that names it, not an unpinned
    slot that silently turns every copy synchronous."""
    device = _device()
    store = SnapshotStore(tmp_path / "pinned", pin_device=device)
    store.reserve(1 << 20)
    views = [torch.frombuffer(store._mappings[slot], dtype=torch.uint8) for slot in range(NUM_SLOTS)]
    assert all(view.is_pinned() for view in views), "every slot is page-locked"
    unpinned = SnapshotStore(tmp_path / "unpinned")
    unpinned.reserve(1 << 20)
    assert not torch.frombuffer(unpinned._mappings[0], dtype=torch.uint8).is_pinned(), "CPU training pins nothing"
    store.remove()
    unpinned.remove()

    monkeypatch.setattr(snapshot, "_address", lambda mapping: 0)  # the driver refuses to register address 0
    failing = SnapshotStore(tmp_path / "failing", pin_device=device)
    with pytest.raises(RuntimeError, match=rf"cudaHostRegister failed on {device} with CUDA error [1-9]"):
        failing.reserve(1 << 20)


def _pin_from_the_copy_thread(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank: its device set, slots reserved on a background thread as the engine's copy thread does, whose
    current device is 0 unless the pinning sets the rank's; which devices now have a CUDA context."""
    torch.cuda.set_device(rank)
    store = SnapshotStore(Path(root) / f"rank{rank}", pin_device=torch.device("cuda", rank))
    background_executor("moc-snapshot").submit(store.reserve, 1 << 20).result()
    contexts = [torch._C._cuda_hasPrimaryContext(d) for d in range(torch.cuda.device_count())]
    pinned = torch.frombuffer(store._mappings[0], dtype=torch.uint8).is_pinned()
    store.remove()
    return {"contexts": contexts, "pinned": pinned}


@pytest.mark.cuda(gpus=2)
def test_each_rank_pins_on_its_own_device_and_touches_no_other(tmp_path: Path) -> None:
    """7dbc115 pinned every rank's slots from the copy thread, where the current device is 0: every rank then made a
    CUDA context (hundreds of MB) on GPU 0. Each rank must have a context on its own device only."""
    results = run_ranks(_pin_from_the_copy_thread, 2, tmp_path, str(tmp_path / "shm"), init_process_group=False)
    for rank, result in enumerate(results):
        assert result["pinned"], f"rank {rank}'s slots are not page-locked"
        expected = [device == rank for device in range(len(result["contexts"]))]
        assert result["contexts"] == expected, f"rank {rank} made CUDA contexts on {result['contexts']}"


@pytest.mark.cuda
def test_real_slots_copy_from_the_device_bitwise(tmp_path: Path) -> None:
    """A write from device tensors of every dtype MoC snapshots lands bitwise in the pinned slot."""
    device = _device()
    tensors = {
        "a": torch.arange(10.0, device=device), "b": torch.ones(3, 5, dtype=torch.bfloat16, device=device),
        "s": torch.tensor(7, dtype=torch.int64, device=device),
    }  # fmt: skip
    store = SnapshotStore(tmp_path, pin_device=device)
    store.write(0, 1, (), tensors, {})
    loaded = store.read(store.committed()[0])
    assert all(torch.equal(loaded[k], v.cpu()) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    store.remove()


@pytest.mark.cuda
def test_the_side_stream_copy_overlaps_the_next_forward(tmp_path: Path) -> None:
    """``fill`` enqueues the device-to-host copy on a side stream and returns: the next forward's kernels start on
    the training stream while the copy runs (CUDA events), and the slot then holds the values of the snapshot's
    step bitwise. A copy on the training stream, or into unpinned memory (synchronous for the host), starts the
    forward only after the copy."""
    device = _device()
    torch.cuda.set_device(device)
    tensors = {f"w{i}": torch.randn(16 << 20, device=device) for i in range(8)}  # 512 MB
    expected = {k: v.cpu() for k, v in tensors.items()}
    a = torch.randn(4096, 4096, device=device)
    store = SnapshotStore(tmp_path, pin_device=device)
    store.write(1, 0, (), tensors, {})  # warm-up: the slot mapped, pinned, its views built
    for _ in range(2):
        a @ a
    begin, forward, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    begin.record()
    fill = store.fill(1, tensors)
    forward.record()
    for _ in range(20):
        a @ a
    assert fill.stream is not None, "device tensors are copied on a side stream"
    copied.record(fill.stream)
    meta = store.finish(1, 1, (), fill, {})
    torch.cuda.synchronize()
    copy_ms, forward_starts_ms = begin.elapsed_time(copied), begin.elapsed_time(forward)
    assert copy_ms > 2, f"the copy took {copy_ms:.2f} ms: too short to show an overlap"
    assert forward_starts_ms < 0.5 * copy_ms, (
        f"the next forward started {forward_starts_ms:.2f} ms into a {copy_ms:.2f} ms copy: it waited for it"
    )
    loaded = store.read(meta)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    store.remove()


@pytest.mark.cuda
def test_the_optimizer_step_waits_for_an_unfinished_copy(tmp_path: Path) -> None:
    """The training stream is held 0.3 s before the snapshot of step 2, so its side-stream copy (which waits for the
    training stream's work so far) cannot have run when the snapshot returns. ``wait_snapshot`` before the optimizer
    step must block the training thread until it has: then the step's in-place update cannot race the copy, and the
    slot holds step 2's weights and moments bitwise although the step changed them. (The next iteration's forward
    and backward run before the snapshot here: a host sync in them would end the hold before the wait.)"""
    device = _device()
    model, optimizer = _trained(device)
    engine = _engine(model, optimizer, tmp_path)
    engine.reserve_slots()
    _forward_backward(model, optimizer, 2)  # the gradients of the step that must wait
    expected = _state(engine)
    held = _hold(torch.cuda.current_stream(device), 1.0)
    engine.snapshot(2, {})
    assert not held.query(), "the hold was over when the snapshot returned: the test would show nothing"
    engine.wait_snapshot()
    assert held.query(), "wait_snapshot returned while the work before the snapshot still ran: the copy had not"
    optimizer.step()
    engine.finish()
    torch.cuda.synchronize()
    after = _state(engine)
    changed = [k for k in expected if not torch.equal(after[k], expected[k])]
    assert changed, "the optimizer step changed nothing: the test would show no race"
    got = engine.store.read(engine.store.committed()[-1])
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), f"{key} in the slot is not its value at step 2"
    engine.store.remove()


@pytest.mark.cuda
def test_restore_copies_into_the_ranks_own_device_in_place(tmp_path: Path) -> None:
    """A recovery from the slots copies host to device: the parameters and buffers in place (same storage), the
    optimizer state onto its parameter's device (this rank's), every tensor bitwise its snapshotted value."""
    device = _device()
    model, optimizer = _trained(device)
    engine = _engine(model, optimizer, tmp_path)
    engine.snapshot(2, {})
    engine.wait_snapshot()
    engine.finish()
    expected = _state(engine)

    fresh, fresh_optimizer = _trained(device, seed=1)  # other values, the same shapes, its own moments
    restarted = _engine(fresh, fresh_optimizer, tmp_path)
    live = restarted.pec.layout.pieces(restarted.pec.layout.units)
    where = {k: (t.device, t.data_ptr()) for k, t in live.items()}
    assert any(not torch.equal(t.cpu(), expected[k]) for k, t in live.items()), "the fresh model differs"
    report = restarted.recover()
    assert report is not None and report.resume_step == 2
    assert {s["level"] for s in report.sources.values()} == {"memory_local"}
    for key, tensor in restarted.pec.layout.pieces(restarted.pec.layout.units).items():
        assert tensor.device == where[key][0], f"{key} restored on {tensor.device}, not {where[key][0]}"
        if "/optim/" not in key:  # optimizer state is made afresh for the load, on its parameter's device
            assert tensor.data_ptr() == where[key][1], f"parameter or buffer {key} was replaced, not copied into"
        assert torch.equal(tensor.cpu(), expected[key]), f"{key} is not its snapshotted value"
    restarted.store.remove()


def _nccl_ep_step(rank: int, world_size: int, ep: int) -> dict:
    """:func:`test_expert_parallel._ep_step` on this rank's GPU over NCCL."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    return _ep_step(rank, world_size, ep, device)


@pytest.mark.cuda(gpus=2)
def test_nccl_all_to_all_expert_parallel_matches_one_process(tmp_path: Path) -> None:
    """Tokens travel to their experts by NCCL all-to-all (EP 2 over 2 GPUs): the loss and every gradient match one
    process's on the CPU."""
    results = run_ranks(_nccl_ep_step, 2, tmp_path, 2, init_process_group=False)
    check_against_one_process(results, world_size=2, ep=2)


class _ExpertDtypes(L.Callback):
    """Records the dtype of the first expert's output in each training forward."""

    def __init__(self) -> None:
        self.seen: set[torch.dtype] = set()

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        expert = next(m for name, m in module.named_modules() if name.endswith(".experts.0"))
        expert.register_forward_hook(lambda _m, _args, out: self.seen.add(out.dtype))


@pytest.mark.cuda
def test_bf16_autocast_trains_with_fp32_master_state_in_the_snapshots(tmp_path: Path) -> None:
    """``precision=bf16-mixed`` on the GPU: the experts compute in bf16, while the weights and AdamW moments stay fp32
    and are snapshotted in fp32, bitwise their values at the snapshot's step."""
    cfg = GPTMoEConfig(block_size=32)
    config = CheckpointConfig(
        every_n_train_steps=5, k_snapshot=cfg.num_experts, storage=StorageConfig(url=(tmp_path / "ckpt").as_uri()),
        shm_root=str(tmp_path / "shm"), remove_snapshots_on_fit_end=False, persist_on_fit_end=False,
    )  # fmt: skip
    moc, dtypes = MoCCheckpoint(config), _ExpertDtypes()
    states: dict[int, dict[str, torch.Tensor]] = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
            layout = build_layout(module, trainer.optimizers[0], num_experts=cfg.num_experts)
            states[trainer.global_step] = {k: v.detach().cpu().clone() for k, v in layout.pieces(layout.units).items()}

    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=6, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "run"),
        callbacks=[moc, dtypes, Record()],
    )  # fmt: skip
    data = LMDataModule(DataConfig(batch_size=8), block_size=cfg.block_size, vocab_size=cfg.vocab_size)
    trainer.fit(GPTMoEModule(cfg, seed=0), datamodule=data)
    assert dtypes.seen == {torch.bfloat16}, f"the experts computed in {dtypes.seen}"
    store = moc.engine.store
    slot = next(m for m in store.committed() if m.step == 5)
    floats = {k: e.torch_dtype for k, e in slot.entries.items() if e.torch_dtype.is_floating_point}
    assert floats and set(floats.values()) == {torch.float32}, "masters and moments are snapshotted in fp32"
    assert any("/optim/" in k for k in floats), "the snapshot holds optimizer state"
    got = store.read(slot)
    for key, tensor in got.items():
        assert torch.equal(tensor, states[5][key]), f"{key} in the slot is not its value at step 5"
    store.remove()


@pytest.mark.cuda
def test_snapshots_grow_no_device_allocation(tmp_path: Path) -> None:
    """Snapshots copy into host slots allocated once: after the first, six more (each persisted) leave the device's
    allocated and reserved memory where they were, and allocate no more at their peak than the first did."""
    device = _device()
    model, optimizer = _trained(device)
    engine = _engine(model, optimizer, tmp_path)
    engine.reserve_slots()
    torch.cuda.reset_peak_memory_stats(device)
    engine.snapshot(2, {})
    engine.wait_snapshot()
    engine.finish()
    first_peak = torch.cuda.max_memory_allocated(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(3, 9):
        engine.snapshot(step, {})
        engine.wait_snapshot()
        engine.finish()
        assert torch.cuda.memory_allocated(device) == allocated, f"device memory grew by the snapshot of step {step}"
        assert torch.cuda.memory_reserved(device) == reserved, f"the allocator reserved more at step {step}"
    assert torch.cuda.max_memory_allocated(device) <= first_peak
    assert engine.stats.snapshots == 7
    engine.store.remove()


@pytest.mark.cuda
def test_router_counts_on_the_device_are_added_there_and_summed_at_the_mark() -> None:
    """Each step's counts on the GPU are counted from a router's indices and added on the device, with no wait for it
    (a host copy would wait for the step's kernels, once per MoE layer), and copied once, at the mark; a layer without
    a forward that step reports host zeros beside them. Indices outside ``[0, N)`` count for no expert."""
    device = _device()
    tokens = TokenAccounting(CheckpointConfig(k_snapshot=1, k_persist=1), [3, 2], rank=0)

    def on(*counts: int) -> torch.Tensor:
        return torch.tensor(counts, device=device)

    tokens.record([LayerCounts(on(1, 0, 2), 6), LayerCounts(torch.zeros(2, dtype=torch.int64), 0)])
    top2, counts = on(2, 1, -1, 1, 0, 9).reshape(3, 2), on(0, 3, 0)  # a router's top-2 indices; a layer's counts
    torch.cuda.set_sync_debug_mode("error")  # from here, any wait for the device raises
    try:
        routed = read_routing(top2, num_experts=2, k=2)
        assert routed is not None
        tokens.record([LayerCounts(counts, 6), LayerCounts(*routed)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens.mark_step(2)
    assert tokens.ledger.state_dict()["marks"][2] == {"processed": [[1, 3, 2], [1, 2]], "assigned": [12, 6]}
