"""Replay mode's core (moc_lightning/replay/core.py): a window of sparse captures, replayed from any state, lands
bitwise on the fault-free state; restoring the captures without the replay does not."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from buffered_model import WIDTH, BufferedMoE, assert_same_state, full_state
from torch import nn

from moc_lightning.engine.layout import Layout, UnitBytes, build_layout
from moc_lightning.engine.units import ExpertUnit, dense, expert
from moc_lightning.models import GPTMoE, GPTMoEConfig
from moc_lightning.replay.core import Replay, WindowRecord, capture_bytes, replay, restore_units, window_schedule

GPT = GPTMoEConfig(block_size=16, n_layer=2, n_embd=32, num_experts=4, gate_noise=0.1)
"""The reference GPT-MoE with 4 experts and noisy gating, so an iteration consumes global RNG."""


@dataclass(frozen=True)
class Model:
    """A model family: how to build one (``seed`` picks its initial weights) and one iteration's forward/backward."""

    build: Callable[[int], nn.Module]
    forward_backward: Callable[[nn.Module, int], None]


def _buffered_step(model: nn.Module, iteration: int) -> None:
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(iteration))
    model(x).pow(2).mean().backward()


def _gpt_step(model: nn.Module, iteration: int) -> None:
    generator = torch.Generator().manual_seed(iteration)
    tokens = torch.randint(0, GPT.vocab_size, (4, GPT.block_size + 1), generator=generator)
    torch.manual_seed(10_000 + iteration)  # the RNG state of the iteration (gate noise), as the caller restores it
    _, loss, aux = model(tokens[:, :-1], tokens[:, 1:])
    (loss + GPT.aux_loss_coef * aux).backward()


MODELS = {
    "buffered": Model(lambda seed: BufferedMoE(seed), _buffered_step),
    "gpt": Model(lambda seed: GPTMoE(GPT, seed=seed), _gpt_step),
}


class Run:
    """A model and AdamW (weight decay on) trained iteration by iteration, as a training loop does it."""

    def __init__(self, model: Model, seed: int) -> None:
        self.family = model
        self.model = model.build(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.layout: Layout = build_layout(self.model, self.optimizer)

    def train(self, iteration: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.family.forward_backward(self.model, iteration)
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        return full_state(self.model, self.optimizer)


def _train_with_captures(name: str, window: int, iterations: int) -> tuple[list[dict], dict[int, WindowRecord], Run]:
    """The fault-free run: the oracle (every tensor after every iteration, by the model's own names), the
    record of each window, captured after each iteration's optimizer step, and the run itself."""
    run = Run(MODELS[name], seed=0)
    schedule = window_schedule(run.layout.units, window)
    oracle, records = [], {}
    for iteration in range(iterations):
        run.train(iteration)
        oracle.append(run.state())
        k, offset = divmod(iteration, window)
        records.setdefault(k, WindowRecord(schedule, window)).capture(run.layout, offset)
    return oracle, records, run


@pytest.mark.parametrize("start", ["fresh", "ahead"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_replay_restores_the_fault_free_state_bitwise(name: str, window: int, start: str) -> None:
    """From another initialisation with no optimizer state (a restarted process), or from the run's own later
    state with the gradients of a half-done iteration (a process that survives), the replay of the newest
    complete window lands on the fault-free state after its last iteration, and training goes on identically."""
    iterations = 3 * window
    fault = random.Random(f"{name}/{window}").randrange(window, iterations)
    complete = fault // window - 1  # the newest window that ended before the fault
    last = (complete + 1) * window - 1
    print(f"{name} W={window} from {start}: fault in iteration {fault}, replay window {complete} to iteration {last}")
    oracle, records, run = _train_with_captures(name, window, iterations)
    if start == "fresh":
        run = Run(MODELS[name], seed=1)
    else:
        run.family.forward_backward(run.model, iterations)
    assert not all(torch.equal(run.state()[k], v) for k, v in oracle[last].items() if k in run.state())

    first = complete * window
    replayed = replay(records[complete], run.layout, lambda i: run.family.forward_backward(run.model, first + i))

    assert replayed == window - 1
    assert_same_state(run.state(), oracle[last])
    for iteration in range(last + 1, iterations):
        run.train(iteration)
    assert_same_state(run.state(), oracle[-1])


def test_replay_skips_the_optimizer_on_frozen_units() -> None:
    """A frozen unit's gradients are gone when the optimizer steps (its state is overwritten at its restore
    anyway, so this only spares the step's work), a trained unit's are kept."""
    window = 4
    _, records, _ = _train_with_captures("gpt", window, window)
    run = Run(MODELS["gpt"], seed=1)
    replay_ = Replay(records[0], run.layout)
    schedule = records[0].schedule
    for i in replay_.iterations:
        replay_.before_forward(i)
        run.family.forward_backward(run.model, i)
        replay_.before_optimizer_step(i)
        for unit, t in schedule.items():
            grads = {run.layout.params[n].grad is None for n in run.layout.param_names(unit)}
            assert grads == {t >= i}, (unit, t, i)
        run.optimizer.step()


def test_restore_removes_optimizer_state_the_capture_did_not_have() -> None:
    """An expert that had no token when captured has no optimizer state; restored into an optimizer that has
    some for it, it must end with none, as the fault-free run has."""
    run = Run(MODELS["buffered"], seed=0)
    run.train(0)
    idle = expert(0, 3)  # buffered_model routes no token to the last expert of MoE layer 0
    record = WindowRecord({u: 0 for u in run.layout.units}, 1)
    record.capture(run.layout, 0)
    assert set(record.full[idle]) == set(run.layout.model_tensors([idle]))
    weight = run.layout.params[run.layout.param_names(idle)[0]]
    run.optimizer.state[weight] = {"step": torch.tensor(5.0), "exp_avg": torch.ones_like(weight)}
    restore_units(run.layout, {idle: record.full[idle]})
    assert weight not in run.optimizer.state


def test_a_restore_creates_the_optimizer_state_from_the_captures_without_zero_filling_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted process restores every unit into an optimizer without state: the state is allocated and the
    captured bytes copied into it once, with no zero fill before (it doubled a restore's bytes moved, issue 14 item
    7), and it is the captured state bitwise."""
    run = Run(MODELS["buffered"], seed=0)
    run.train(0)
    record = WindowRecord({u: 0 for u in run.layout.units}, 1)
    record.capture(run.layout, 0)
    fresh = Run(MODELS["buffered"], seed=1)
    zero_filled: list[int] = []
    for name in ("zeros", "zeros_like"):
        real = getattr(torch, name)

        def counted(*args: object, _real: Callable[..., torch.Tensor] = real, **kwargs: object) -> torch.Tensor:
            tensor = _real(*args, **kwargs)
            zero_filled.append(tensor.numel() * tensor.element_size())
            return tensor

        monkeypatch.setattr(torch, name, counted)
    restore_units(fresh.layout, record.full)
    assert sum(zero_filled) == 0
    assert_same_state(fresh.state(), run.state())


@pytest.mark.usefixtures("poisoned_empty")
def test_restoring_some_experts_of_a_stacked_parameter_exposes_no_uninitialised_memory() -> None:
    """The units active at a window's first iteration, restored into a fresh optimizer, include some experts of
    the stacked layer but not all: its state is created whole, and the slices of the experts not yet restored are
    zeros until their own restore, whatever memory the allocator hands out."""
    window = 2
    _, records, run = _train_with_captures("buffered", window, window)
    schedule = records[0].schedule
    stacked = [u for u in run.layout.expert_units if u.layer == 1]
    assert {schedule[u] for u in stacked} == {0, 1}, "the stacked layer's experts are spread over both iterations"
    fresh = Run(MODELS["buffered"], seed=1)
    restore_units(fresh.layout, {u: records[0].full[u] for u, t in schedule.items() if t == 0})
    weight = fresh.layout.params[fresh.layout.param_names(stacked[0])[0]]
    state = fresh.optimizer.state[weight]
    later = [u.expert for u in stacked if schedule[u] == 1]
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    assert all(bool((state[name][later] == 0).all()) for name in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_restoring_the_captures_without_replay_is_not_the_fault_free_state(name: str) -> None:
    window = 3
    oracle, records, _ = _train_with_captures(name, window, window)
    fresh = Run(MODELS[name], seed=1)
    record = records[0]
    for unit in fresh.layout.units:
        restore_units(fresh.layout, {unit: record.full[unit]})
    got = fresh.state()
    differ = sorted(k for k, v in oracle[-1].items() if k not in got or not torch.equal(got[k], v))
    stale = [u for u, t in record.schedule.items() if t < window - 1]
    print(f"{name}: without replay, {len(differ)} of {len(oracle[-1])} tensors differ ({len(stale)} stale units)")
    assert differ


def test_schedule_activates_every_unit_once_and_spreads_experts_and_bytes() -> None:
    units = [dense("embed"), dense("blocks.0.attn"), dense("blocks.1.attn"), dense("head")]
    units += [expert(layer, e) for layer in (0, 1) for e in range(8)]
    full_only = {u: UnitBytes(weights=0, optimizer=10, weight_numel=0) for u in units}
    full_only[dense("embed")] = UnitBytes(weights=0, optimizer=100, weight_numel=0)
    for window in (1, 3, 8, 20):
        schedule = window_schedule(units, window, full_only)
        assert sorted(schedule) == sorted(units) and all(0 <= t < window for t in schedule.values())
        for layer in (0, 1):
            per_iteration = [
                sum(1 for u, t in schedule.items() if isinstance(u, ExpertUnit) and u.layer == layer and t == i)
                for i in range(window)
            ]
            assert max(per_iteration) == -(-8 // window) and min(per_iteration) == 8 // window, (window, per_iteration)
    schedule = window_schedule(units, 4, full_only)
    loads = [sum(full_only[u].total for u, t in schedule.items() if t == i) for i in range(4)]
    assert loads == [140, 50, 50, 50], loads  # 4 experts an iteration; the big dense unit alone beside them
    assert window_schedule(units, 4, full_only) == schedule  # pure


def test_schedule_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        window_schedule([dense("head")], 0)


def test_capture_bytes_per_iteration_against_a_full_checkpoint() -> None:
    """The bytes each iteration copies (full state of its active units, weights and buffers of the frozen ones)
    are what the record measures; printed beside a full checkpoint's. Placing units by their bytes lowers the
    largest copy of the window against placing them by count."""
    for name in sorted(MODELS):
        run = Run(MODELS[name], seed=0)
        run.train(0)  # AdamW creates its state at the first step
        sizes = {u: run.layout.unit_bytes(u) for u in run.layout.units}
        full = sum(s.total for s in sizes.values())
        for window in (2, 4, 8):
            schedule = window_schedule(run.layout.units, window, sizes)
            predicted = capture_bytes(run.layout, schedule, window)
            record = WindowRecord(schedule, window)
            measured = [record.capture(run.layout, t) for t in range(window)]
            assert measured == predicted
            assert sum(measured) == full + sum(t * (sizes[u].weights + sizes[u].buffers) for u, t in schedule.items())
            by_count = max(capture_bytes(run.layout, window_schedule(run.layout.units, window), window))
            print(
                f"{name} W={window}: capture per iteration mean {sum(measured) / window:,.0f} B, max "
                f"{max(measured):,} B (by count {by_count:,} B); a full checkpoint {full:,} B"
            )
            assert max(measured) <= by_count and max(measured) < full


def test_a_record_reuses_its_buffers_and_replays_only_a_complete_window() -> None:
    """The next window copies into the buffers of the first (no allocation in steady state); captures go in
    order; a window still being captured cannot be replayed."""
    run = Run(MODELS["buffered"], seed=0)
    schedule = window_schedule(run.layout.units, 2)
    record = WindowRecord(schedule, 2)
    storages = []
    for iteration in range(4):
        run.train(iteration)
        record.capture(run.layout, iteration % 2)
        if iteration % 2:
            storages.append({k: v.data_ptr() for state in record.full.values() for k, v in state.items()})
    assert storages[0] == storages[1]
    with pytest.raises(ValueError, match="in order; got offset 1 after 0 captured"):
        WindowRecord(schedule, 2).capture(run.layout, 1)
    record.capture(run.layout, 0)
    with pytest.raises(ValueError, match="only a complete window can be replayed: 1 of 2"):
        replay(record, run.layout, lambda i: None)
