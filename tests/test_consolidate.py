"""Dense consolidation: every format holds bitwise what ``load_latest`` restores, under the model's own names."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file
from storage_faults import flip_byte_of, flip_middle_byte
from torch import nn
from trainee import TINY, Trainee, every_step_config, train_and_checkpoint

from moc_lightning.config import StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.manifest import CheckpointRecord
from moc_lightning.engine.slots import param_key, state_key
from moc_lightning.engine.units import ExpertUnit
from moc_lightning.export.consolidate import (
    OPTIMIZER_KEY,
    ConsolidateError,
    DenseCheckpoint,
    assemble,
    consolidate,
    main,
    place,
)
from moc_lightning.models import ExpertParallelTopology
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.storage import make_storage

pytestmark = pytest.mark.xdist_group("consolidate")  # one pytest-xdist worker trains the module's run once

CHECKPOINT_STEPS = (2, 4)


@dataclass
class Run:
    """A model with its optimizer, and the PEC engine checkpointing it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    engine: PECCheckpointer


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY.vocab_size, (8, TINY.block_size + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _engine_run(model: nn.Module, url: str, k: int, backend: str = "filesystem", pec_scope: str = "both") -> Run:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layout = build_layout(model, optimizer, num_experts=TINY.num_experts)
    cfg = every_step_config(k, k, storage=StorageConfig(backend=backend), pec_scope=pec_scope)
    engine = PECCheckpointer(cfg, layout, ExpertParallelTopology(), make_storage(backend, url), backend=backend)
    return Run(model, optimizer, engine)


def _lightning_run(url: str, seed: int = 0, pec_scope: str = "both") -> Run:
    """The reference ``GPTMoEModule`` as Lightning builds it (parameters named ``model.…``), ep=1, K=4 of 8."""
    module = GPTMoEModule(TINY, seed=seed)
    module.configure_model()
    return _engine_run(module, url, k=4, pec_scope=pec_scope)


def _train(run: Run, steps: int, checkpoint_steps: tuple[int, ...]) -> None:
    """Train a ``_lightning_run`` by hand (no Trainer needed to exercise the engine) and checkpoint it."""
    for step in range(1, steps + 1):
        _, loss, _ = run.model.model(*_batch(step))
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.engine.record_tokens(run.model.moe_layers())
        if step in checkpoint_steps:
            run.engine.checkpoint(step)


@torch.no_grad()
def _val_loss(module: GPTMoEModule) -> torch.Tensor:
    return module.model(*_batch(999))[1]


def _assert_weights_equal(weights: dict[str, torch.Tensor], model: nn.Module) -> None:
    live = dict(model.named_parameters())
    assert weights.keys() == live.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, live[name]), f"{name} differs from the restored model"


def _assert_optimizer_equal(state: dict[str, dict[str, torch.Tensor]], run: Run) -> None:
    live = {name: run.optimizer.state[p] for name, p in run.model.named_parameters()}
    assert state.keys() == live.keys()
    for name, states in state.items():
        assert states.keys() == live[name].keys()
        for key, tensor in states.items():
            assert torch.equal(tensor, live[name][key]), f"optimizer state {key} of {name} differs"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    """A run checkpointed at steps 2 and 4 (disjoint experts), and a fresh model restored by ``load_latest``."""
    url = tmp_path_factory.mktemp("ckpt").as_uri()
    _train(_lightning_run(url), steps=6, checkpoint_steps=CHECKPOINT_STEPS)
    restored = _lightning_run(url, seed=1)
    restored.engine.load_latest()
    return url, restored


def test_lightning_format_loads_strictly_with_the_restored_loss(trained: tuple[str, Run], tmp_path: Path) -> None:
    url, restored = trained
    out = tmp_path / "dense.ckpt"
    main([url, "--out", str(out), "--format", "lightning"])
    ckpt = torch.load(out, weights_only=True)
    fresh = GPTMoEModule(TINY, seed=2)
    fresh.configure_model()
    fresh.load_state_dict(ckpt["state_dict"], strict=True)
    assert torch.equal(_val_loss(fresh), _val_loss(restored.model))
    _assert_weights_equal(ckpt["state_dict"], restored.model)
    _assert_optimizer_equal(ckpt[OPTIMIZER_KEY], restored)
    assert ckpt["global_step"] == 4
    source_steps = ckpt["moc"]["source_steps"]
    assert {s for u, s in source_steps.items() if u.startswith("expert/")} == set(CHECKPOINT_STEPS)
    assert {s for u, s in source_steps.items() if u.startswith("dense/")} == {4}


@pytest.mark.parametrize("scope", ["optimizer", "weights"])
def test_each_part_comes_from_its_newest_stored_copy_under_a_partial_scope(tmp_path: Path, scope: str) -> None:
    """Under ``pec_scope=optimizer`` (``weights``) the checkpoints of steps 2 and 4 hold 4 of 8 experts whole and
    the other part (weights, optimizer state) of the rest: every expert's other part is of step 4, also for the
    experts last stored whole at step 2. The dense result is what a storage-only recovery restores, bitwise."""
    url = (tmp_path / "ckpt").as_uri()
    run = _lightning_run(url, pec_scope=scope)
    _train(run, steps=4, checkpoint_steps=CHECKPOINT_STEPS)
    at_4 = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    state_at_4 = {name: {k: t.clone() for k, t in run.optimizer.state[p].items()}
                  for name, p in run.model.named_parameters()}
    restored = _lightning_run(url, seed=1, pec_scope=scope)
    restored.engine.load_latest()

    provenance = consolidate(url, tmp_path / "dense.ckpt", progress=False)
    ckpt = torch.load(tmp_path / "dense.ckpt", weights_only=True)
    _assert_weights_equal(ckpt["state_dict"], restored.model)
    _assert_optimizer_equal(ckpt[OPTIMIZER_KEY], restored)
    if scope == "optimizer":
        assert all(torch.equal(ckpt["state_dict"][name], t) for name, t in at_4.items()), "every weight is of step 4"
    else:
        assert all(torch.equal(ckpt[OPTIMIZER_KEY][name][k], t) for name, s in state_at_4.items() for k, t in s.items())
    other = "weights" if scope == "optimizer" else "optimizer"
    stale = {u for u, s in provenance["source_steps"].items() if s == 2}
    assert len(stale) == 2 * 4 and all(u.startswith("expert/") for u in stale)
    assert provenance["part_steps"] == {u: {scope: 2, other: 4} for u in stale}, "only the units with mixed parts"
    assert ckpt["moc"] == provenance


def test_dcp_format_loads_into_the_model_state_dict(trained: tuple[str, Run], tmp_path: Path) -> None:
    url, restored = trained
    consolidate(url, tmp_path / "dense", "dcp", progress=False)
    state = {name: torch.empty_like(t) for name, t in restored.model.state_dict().items()}
    dcp.load(state, checkpoint_id=tmp_path / "dense", no_dist=True)
    _assert_weights_equal(state, restored.model)
    optimizer = {
        name: {key: torch.empty_like(t) for key, t in restored.optimizer.state[p].items()}
        for name, p in restored.model.named_parameters()
    }
    dcp.load({OPTIMIZER_KEY: optimizer}, checkpoint_id=tmp_path / "dense", no_dist=True)
    _assert_optimizer_equal(optimizer, restored)


def test_safetensors_format_holds_the_weights(trained: tuple[str, Run], tmp_path: Path) -> None:
    url, restored = trained
    provenance = consolidate(url, tmp_path / "dense.safetensors", "safetensors", progress=False)
    _assert_weights_equal(load_file(tmp_path / "dense.safetensors"), restored.model)
    assert provenance["step"] == 4


def test_never_stored_expert_is_an_error_unless_allowed(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    _train(_lightning_run(url), steps=1, checkpoint_steps=(1,))  # K=4 of 8: half the experts never stored
    with pytest.raises(ConsolidateError, match=r"experts \[.*'expert/L0/E\d'.*\] were never stored"):
        consolidate(url, tmp_path / "dense.ckpt", progress=False)
    provenance = consolidate(url, tmp_path / "dense.ckpt", allow_missing=True, progress=False)
    assert len(provenance["missing"]) == 2 * 4
    weights = torch.load(tmp_path / "dense.ckpt", weights_only=True)["state_dict"]
    for unit in provenance["missing"]:
        layer, expert = unit.removeprefix("expert/L").split("/E")
        block = 2 * int(layer) + 1  # tiny model: every second block is an MoE block
        assert not any(name.startswith(f"model.blocks.{block}.moe.experts.{expert}.") for name in weights)


@pytest.mark.parametrize("scope", ["optimizer", "weights"])
def test_a_never_stored_part_is_named_and_a_weightless_expert_is_left_out_whole(tmp_path: Path, scope: str) -> None:
    """One checkpoint under a partial scope holds 4 of 8 experts whole and one part of the others: the part
    never stored is named by its part key; an expert whose weights were never stored is left out with its
    optimizer state (it has no parameter to belong to), one whose optimizer state was not keeps its weights."""
    url = (tmp_path / "ckpt").as_uri()
    _train(_lightning_run(url, pec_scope=scope), steps=1, checkpoint_steps=(1,))
    with pytest.raises(ConsolidateError, match=rf"experts \[.*'expert/L0/E\d/{scope}'.*\] were never stored"):
        consolidate(url, tmp_path / "dense.ckpt", progress=False)
    provenance = consolidate(url, tmp_path / "dense.ckpt", allow_missing=True, progress=False)
    assert len(provenance["missing"]) == 2 * 4 and all(key.endswith(f"/{scope}") for key in provenance["missing"])
    ckpt = torch.load(tmp_path / "dense.ckpt", weights_only=True)
    for key in provenance["missing"]:
        layer, expert = key.removeprefix("expert/L").split("/")[0:2]
        prefix = f"model.blocks.{2 * int(layer) + 1}.moe.experts.{expert.removeprefix('E')}."
        assert any(name.startswith(prefix) for name in ckpt["state_dict"]) == (scope == "optimizer")
        assert not any(name.startswith(prefix) for name in ckpt[OPTIMIZER_KEY])


def test_bad_format_and_missing_manifest_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--out", str(tmp_path / "x"), "--format", "onnx"])
    assert exit_info.value.code == 2
    assert "--format" in capsys.readouterr().err
    with pytest.raises(ConsolidateError, match="--format 'onnx' is not supported; choose one of: lightning, dcp"):
        consolidate(str(tmp_path), tmp_path / "x", "onnx")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 1
    assert "no committed checkpoint under" in capsys.readouterr().err
    with pytest.raises(ConsolidateError, match="does not exist"):
        consolidate(str(tmp_path / "nowhere"), tmp_path / "x")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        pytest.param("__0_0.distcp", flip_middle_byte, id="data"),
        pytest.param(".metadata", lambda p: flip_byte_of(p, b"expert/L1/E"), id="metadata_key"),
        pytest.param("moc.json", lambda p: flip_byte_of(p, b"num_experts"), id="moc_json_key"),
    ],
)
def test_damaged_checkpoint_is_one_clear_line_and_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str, damage: Callable[[Path], None]
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    _train(_lightning_run(url), steps=4, checkpoint_steps=CHECKPOINT_STEPS)
    damage(tmp_path / "ckpt" / "step_000000004" / file)
    with pytest.raises(SystemExit) as exit_info:
        main([url, "--out", str(tmp_path / "dense.ckpt")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    shown = [line.rsplit("\r", 1)[-1] for line in err.splitlines()]  # the last state of tqdm's progress line
    (error,) = [line for line in shown if line.startswith("moc-consolidate: error:")]
    assert "Traceback" not in err, err
    assert "step_000000004" in error and ("corrupt" in error or "unreadable" in error), error
    assert not (tmp_path / "dense.ckpt").exists()


class StackedExperts(nn.Module):
    """Grouped-GEMM style: one ``[E, d, d]`` expert tensor, each expert a slice along dim 0."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(4, 4, generator=generator))
        self.moe = nn.Module()
        self.moe.experts = nn.Module()
        self.moe.experts.w = nn.Parameter(torch.randn(TINY.num_experts, 4, 4, generator=generator))

    def loss(self, step: int) -> torch.Tensor:
        x = torch.randn(4, generator=torch.Generator().manual_seed(step))
        return torch.einsum("i,ij,ejk->", x, self.embed, self.moe.experts.w).square()


@pytest.mark.parametrize(
    ("backend", "scope"),
    [("filesystem", "both"), ("tensorstore", "both"), ("filesystem", "optimizer"), ("filesystem", "weights")],
)
def test_stacked_experts_are_restacked_in_expert_order(tmp_path: Path, backend: str, scope: str) -> None:
    """Under a partial scope a stacked tensor's slices, and their optimizer state, come from several steps."""
    url = tmp_path.as_uri()
    run = _engine_run(StackedExperts(seed=0), url, k=2, backend=backend, pec_scope=scope)  # all stored in steps 1-4
    for step in range(1, 6):
        run.optimizer.zero_grad()
        run.model.loss(step).backward()
        run.optimizer.step()
        run.engine.checkpoint(step)
    restored = _engine_run(StackedExperts(seed=1), url, k=2, backend=backend, pec_scope=scope)
    restored.engine.load_latest()
    consolidate(url, tmp_path / "dense.ckpt", progress=False)
    ckpt = torch.load(tmp_path / "dense.ckpt", weights_only=True)
    assert len(set(ckpt["moc"]["source_steps"].values())) > 1, "experts come from different checkpoints"
    _assert_weights_equal(ckpt["state_dict"], restored.model)
    _assert_optimizer_equal(ckpt[OPTIMIZER_KEY], restored)


def _train_ep2(rank: int, world_size: int, url: str) -> dict:
    return train_and_checkpoint(rank, world_size, url, ep=2)


@pytest.mark.slow
def test_checkpoint_written_with_ep2_consolidates_to_the_dense_model(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    run_ranks(_train_ep2, 2, tmp_path, url)
    restored = Trainee(ExpertParallelTopology(), seed=1)  # ep=1: holds every expert
    restored.engine(every_step_config(4, 4), url).load_latest()
    consolidate(url, tmp_path / "dense.safetensors", "safetensors", progress=False)
    weights = load_file(tmp_path / "dense.safetensors")
    _assert_weights_equal(weights, restored.model)
    moc = json.loads(_safetensors_metadata(tmp_path / "dense.safetensors")["moc"])
    assert moc["step"] == 4


def _safetensors_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_a_flattened_stack_rejoins_in_its_own_shape_and_a_map_without_views_stacks_as_before() -> None:
    """DBRX keeps its experts as one ``[E*I, H]`` tensor, sliced through ``[E, I, H]``: the map's ``view`` turns the
    stacked slices back into ``[E*I, H]`` (weights and Adam moments alike). A map written before views were
    recorded has no ``view`` key and gives ``[E, ...]``, as it always did."""
    experts, rows, hidden = 4, 3, 2
    flat = torch.arange(experts * rows * hidden, dtype=torch.float32).view(experts * rows, hidden)
    record = CheckpointRecord("step_00000002", 2, (), "equal", 1, 1, "filesystem")
    units = [ExpertUnit(0, e) for e in range(experts)]
    tensors = {param_key(u, "w1"): flat.view(experts, rows, hidden)[u.expert] for u in units}
    tensors |= {state_key(u, "w1", "exp_avg"): -tensors[param_key(u, "w1")] for u in units}
    tensors |= {state_key(u, "w1", "step"): torch.tensor(2.0) for u in units}

    def consolidated(view: list[int] | None) -> DenseCheckpoint:
        params = {param_key(u, "w1"): {"param": "ffn.experts.mlp.w1", "index": u.expert} for u in units}
        if view is not None:
            params = {key: {**source, "view": view} for key, source in params.items()}
        return assemble(place(tensors, params, record), [experts], provenance={})

    dense = consolidated([experts, rows, hidden])
    assert torch.equal(dense.weights["ffn.experts.mlp.w1"], flat)
    assert torch.equal(dense.optimizer["ffn.experts.mlp.w1"]["exp_avg"], -flat)
    assert torch.equal(dense.optimizer["ffn.experts.mlp.w1"]["step"], torch.tensor(2.0))
    assert torch.equal(consolidated(None).weights["ffn.experts.mlp.w1"], flat.view(experts, rows, hidden))
