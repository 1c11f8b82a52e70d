"""MoC over FSDP2 (``trainer.data_parallel=fsdp2``): parameters and optimizer state are DTensors, and each rank
snapshots and writes only its local pieces (issue 12, items 2 and 5). Nothing is gathered, except by these tests'
oracles (:meth:`Trainee.full_snapshot`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_run import source_step
from safetensors.torch import load_file
from test_checkpointer import check_round_trip
from test_consolidate import _assert_weights_equal as assert_weights_equal
from test_sharded_data_parallel import CFG as SMALL
from test_sharded_data_parallel import _loader as sharded_loader
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from trainee import TINY, Trainee, every_step_config, load_fresh, train_and_checkpoint

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.parts import split_part_key
from moc_lightning.engine.pieces import check_supported, replicas
from moc_lightning.engine.size_model import size_model
from moc_lightning.engine.units import ExpertUnit, parse_unit
from moc_lightning.export.consolidate import consolidate
from moc_lightning.lightning.callback import MoCCheckpoint
from moc_lightning.memory.snapshot import SnapshotStore
from moc_lightning.memory.two_level import TwoLevelCheckpointer
from moc_lightning.models import ExpertParallelTopology, GPTMoE
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.models.sharded import data_parallel_meshes, shard_gpt_moe

pytestmark = pytest.mark.xdist_group("fsdp2_checkpoint")  # one worker writes the module's checkpoints once

TINY_MOE_LAYERS = [i for i in range(TINY.n_layer) if (i + 1) % TINY.moe_every == 0]


def _layouts(rank: int, world_size: int) -> dict:
    """Unit keys and bytes of the same model under DDP and under FSDP2 (ep=1: experts sharded over both ranks;
    ep=2: each expert whole on its one holder); under HSDP with shard groups of 1, who holds a piece."""
    out = {}
    for mode, ep in (("ddp", 1), ("fsdp2", 1), ("ddp", 2), ("fsdp2", 2)):
        trainee = Trainee(ExpertParallelTopology.from_process_group(ep), fsdp2=mode == "fsdp2")
        trainee.step(1)  # the optimizer state exists
        layout = build_layout(trainee.model, trainee.optimizer, num_experts=TINY.num_experts)
        out[(mode, ep)] = {
            "units": [u.key for u in layout.units],
            "bytes": {u.key: layout.unit_bytes(u) for u in layout.units},
            "local_bytes": {u.key: layout.unit_bytes(u, local=True).total for u in layout.units},
            "scalar_bytes": {
                u.key: sum(t.numel() * t.element_size() for t in layout.tensors([u]).values() if t.dim() == 0)
                for u in layout.units
            },
            "dtensors": all(isinstance(t, DTensor) for k, t in layout.tensors().items() if t.dim() > 0),
        }
    hsdp = GPTMoE(TINY, ExpertParallelTopology.from_process_group(1), seed=0)
    dense, experts = data_parallel_meshes(world_size, 1, 1, "cpu")
    shard_gpt_moe(hsdp, dense, experts, MixedPrecisionPolicy())
    check_supported(dict(hsdp.named_parameters()), "GPTMoE")
    out["hsdp"] = {name: replicas(p) for name, p in hsdp.named_parameters()}
    return out


@pytest.mark.slow
def test_layout_of_fsdp2_dtensors_has_ddps_units_and_bytes(tmp_path: Path) -> None:
    """Experts are found in DTensor parameters as in DDP's plain ones, under the same unit keys (checkpoints are
    interchangeable between the modes), and a unit's bytes are the whole unit's (eq. 5/6), while its local bytes
    are this rank's pieces: half of a unit sharded over 2 ranks. Under HSDP with shard groups of 1 every piece is
    whole and held by both ranks, its replicas."""
    ranks = run_ranks(_layouts, 2, tmp_path)
    for rank in ranks:
        for ep in (1, 2):
            ddp, fsdp2 = rank[("ddp", ep)], rank[("fsdp2", ep)]
            assert fsdp2["dtensors"] and not ddp["dtensors"]
            assert fsdp2["units"] == ddp["units"]
            assert fsdp2["bytes"] == ddp["bytes"]
        sharded = rank[("fsdp2", 1)]
        for key, total in sharded["bytes"].items():
            assert sharded["local_bytes"][key] < total.total, f"{key} is sharded over both ranks"
        assert set(rank["hsdp"].values()) == {(0, 1)}
    sharded = [rank[("fsdp2", 1)] for rank in ranks]
    for key, total in sharded[0]["bytes"].items():
        pieces = sharded[0]["local_bytes"][key] + sharded[1]["local_bytes"][key]
        # the pieces cover the unit once; Adam's scalar steps are held whole by both ranks
        assert pieces == total.total + sharded[0]["scalar_bytes"][key], key


@pytest.fixture(scope="module")
def written_by_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Checkpoints at steps 2 and 4 (K=4 of 8) written by 2 FSDP2 ranks with the experts sharded over both; and, from
    a second model at its step 3, a K=1 persist and a full one, each to storage of its own (:func:`_write`)."""
    root = tmp_path_factory.mktemp("fsdp2")
    return root, run_ranks(_write, 2, root, str(root))


def _write(rank: int, world_size: int, root: str) -> dict:
    """:func:`train_and_checkpoint` under FSDP2 (ep=1), then three more steps with a K=1 persist of step 3 and a
    full one, each to storage of its own."""
    written = train_and_checkpoint(rank, world_size, Path(root, "ckpt").as_uri(), 1, "filesystem", False, True)
    trainee = Trainee(ExpertParallelTopology.from_process_group(1), fsdp2=True)
    k1 = trainee.engine(every_step_config(1, 1), Path(root, "k1").as_uri())
    full = trainee.engine(every_step_config(1, 1), Path(root, "full").as_uri())
    for step in (1, 2, 3):
        trainee.step(step)
        for engine in (k1, full):
            engine.record_tokens(trainee.model.moe_layers())
    report = k1.checkpoint(3)
    full.tokens.mark_step(3)
    experts = [ExpertUnit(layer, e) for layer in range(len(TINY_MOE_LAYERS)) for e in range(TINY.num_experts)]
    full.persist(3, [*full.layout.dense_units, *experts])
    return written | {"captured_3": trainee.snapshot(), "k1_report": report, "k1_eq6": k1.size_model().c_pec(1)}


@pytest.mark.slow
def test_an_fsdp2_checkpoint_round_trips_bitwise_on_the_same_ranks(
    tmp_path: Path, written_by_fsdp2: tuple[Path, list[dict]]
) -> None:
    """Each rank of a fresh FSDP2 model loads its own pieces of every unit, weights and Adam state, bitwise as they
    were at their source step (dense and the step-4 experts from step 4, the others from step 2), PLT by hand."""
    root, written = written_by_fsdp2
    loaded = run_ranks(load_fresh, 2, tmp_path, (root / "ckpt").as_uri(), 1, "filesystem", False, True)
    for wrote, got in zip(written, loaded):
        check_round_trip(wrote | got)
        assert any("/optim/" in k for k in got["loaded"]), "the optimizer state came back too"


@pytest.mark.slow
def test_a_full_fsdp2_persist_round_trips_bitwise(tmp_path: Path, written_by_fsdp2: tuple[Path, list[dict]]) -> None:
    """A persist of every unit comes back whole: every rank's pieces, weights and Adam state, bitwise."""
    root, written = written_by_fsdp2
    full = run_ranks(load_fresh, 2, tmp_path / "full", (root / "full").as_uri(), 1, "filesystem", False, True)
    for wrote, got in zip(written, full):
        assert set(got["sources"].values()) == {3}
        assert got["loaded"].keys() == wrote["captured_3"].keys()
        for key, tensor in got["loaded"].items():
            assert torch.equal(tensor, wrote["captured_3"][key]), key


@pytest.mark.slow
def test_an_fsdp2_checkpoint_loads_in_one_ddp_process(written_by_fsdp2: tuple[Path, list[dict]]) -> None:
    """FSDP2 on 2 ranks -> one process with plain tensors: DCP reassembles every unit from the two ranks' pieces,
    bitwise the whole tensors as they were (the oracle all-gathered them)."""
    root, written = written_by_fsdp2
    loaded = load_fresh(0, 1, (root / "ckpt").as_uri())
    check_round_trip(written[0] | {"captured": written[0]["captured_full"]} | loaded)
    assert {parse_unit(k).key for k in loaded["loaded"]} == {parse_unit(k).key for k in written[0]["captured_full"][4]}


@pytest.mark.slow
def test_a_ddp_checkpoint_loads_under_fsdp2(tmp_path: Path) -> None:
    """One DDP process -> FSDP2 on 2 ranks: each rank loads its pieces of every unit from the whole tensors, and
    together (all-gathered by the oracle) they are bitwise the tensors one process wrote."""
    url = (tmp_path / "ckpt").as_uri()
    written = train_and_checkpoint(0, 1, url)
    loaded = run_ranks(load_fresh, 2, tmp_path, url, 1, "filesystem", False, True)
    for got in loaded:
        check_round_trip(written | got | {"loaded": got["loaded_full"]})
    assert loaded[0]["loaded"]["dense/wte/param/weight"].shape[0] == TINY.vocab_size // 2, "each rank holds half"


@pytest.mark.slow
def test_a_k1_persist_writes_each_ranks_pieces_and_eq6_over_ranks(written_by_fsdp2: tuple[Path, list[dict]]) -> None:
    """A K=1 persist: each rank writes exactly its local pieces of the selected units (Adam's scalar steps, held
    whole by both, once, by rank 0), and the ranks' bytes sum to eq. 6."""
    _, written = written_by_fsdp2
    for rank, wrote in enumerate(written):
        report = wrote["k1_report"]
        units = set(report.units)
        assert sum(u.startswith("expert/") for u in units) == len(TINY_MOE_LAYERS)
        pieces = {k: t for k, t in wrote["captured_3"].items() if parse_unit(k).key in units}
        expected = sum(t.numel() * t.element_size() for t in pieces.values() if t.dim() > 0 or rank == 0)
        assert report.bytes_written == expected
    total = sum(w["k1_report"].bytes_written for w in written)
    assert total == pytest.approx(written[0]["k1_eq6"], rel=0.01)
    assert total == written[0]["k1_report"].expected_bytes
    print(f"fsdp2 K=1 persist bytes per rank: {[w['k1_report'].bytes_written for w in written]}, sum {total}, "
          f"eq. 6 {written[0]['k1_eq6']:.0f}")


def _under_scope(rank: int, world_size: int, root: str, scope: str) -> dict:
    """Under FSDP2 (ep=1) and ``pec_scope=scope``: :func:`train_and_checkpoint` with nothing gathered while
    checkpointing, then a fresh FSDP2 model restored from it; and, to storage and slots of their own,
    :func:`snapshot_and_recover` with every slot kept (in ``"memory"``)."""
    url = Path(root, "ckpt").as_uri()
    written = train_and_checkpoint(rank, world_size, url, 1, fsdp2=True, pec_scope=scope, guard=no_gathering)
    loaded = load_fresh(rank, world_size, url, 1, fsdp2=True)
    memory = snapshot_and_recover(rank, world_size, str(Path(root, "two_level")), None, pec_scope=scope)
    return written | loaded | {"memory": memory}


@pytest.fixture(scope="module", params=["optimizer", "weights"])
def under_scope(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """The scope and what 2 FSDP2 ranks wrote and restored under it (:func:`_under_scope`): one run per scope."""
    root = tmp_path_factory.mktemp(f"fsdp2_{request.param}")
    return request.param, run_ranks(_under_scope, 2, root, str(root), request.param)


@pytest.mark.slow
def test_an_fsdp2_checkpoint_under_each_pec_scope_round_trips_bitwise_and_matches_eq6(
    under_scope: tuple[str, list[dict]]
) -> None:
    """``pec_scope=optimizer``/``weights`` under FSDP2: each rank writes its local pieces of the K=4 experts whole and
    of the other experts' non-PEC part, nothing gathered; the ranks' bytes sum to eq. 6 of the scope (evaluated on the
    same model in one plain process), and a fresh model takes each part of each expert from its newest copy, bitwise,
    PLT by hand."""
    scope, ranks = under_scope
    for rank in ranks:
        check_round_trip(rank, scope)
    plain = Trainee(ExpertParallelTopology())
    plain.step(1)
    eq6 = size_model(build_layout(plain.model, plain.optimizer, num_experts=TINY.num_experts)).c_pec(4, scope)
    per_rank = [rank["reports"][4].bytes_written for rank in ranks]
    assert sum(per_rank) == pytest.approx(eq6, rel=0.01)
    assert sum(per_rank) == ranks[0]["reports"][4].expected_bytes
    assert 0.3 * sum(per_rank) < per_rank[1] < 0.7 * sum(per_rank), "each rank writes its own pieces"
    print(f"fsdp2 K=4 pec_scope={scope} persist bytes per rank: {per_rank}, eq. 6 {eq6:.0f}")


@contextlib.contextmanager
def no_gathering() -> Iterator[None]:
    """Fail a DTensor gathered (``full_tensor``, ``redistribute``) or a tensor all-gather through ``torch.distributed``
    while inside (DCP's exchange of plans, pickled objects, still runs)."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a snapshot or persist gathered a sharded tensor")

    with (
        mock.patch.object(DTensor, "full_tensor", refuse),
        mock.patch.object(DTensor, "redistribute", refuse),
        mock.patch.object(dist, "all_gather_into_tensor", refuse),
        mock.patch.object(dist, "all_gather", refuse),
    ):
        yield


def snapshot_and_recover(
    rank: int, world_size: int, root: str, lose_rank: int | None, shard_size: int | None = None, pec_scope: str = "both"
) -> dict:
    """Two steps with a snapshot (K=2) and persist (K=1) each under ``pec_scope``, during which nothing may gather a
    DTensor; then a fresh FSDP2 model (HSDP with ``shard_size``) recovers. With ``lose_rank``, that rank's slots are
    gone first (its node was lost). ``captured``: this rank's pieces at each step; ``snapshotted``: the units its
    slot of each step holds whole; ``whole_bytes``: the last slot's units and parts, whole."""
    url = Path(root, "ckpt").as_uri()
    shm = Path(root, "shm", f"rank{rank}")
    trainee = Trainee(ExpertParallelTopology.from_process_group(1), fsdp2=True, shard_size=shard_size)
    pec = trainee.engine(every_step_config(2, 1, pec_scope=pec_scope), url)
    engine = TwoLevelCheckpointer(pec, SnapshotStore(shm))
    captured = {}
    for step in (1, 2):
        trainee.step(step)
        pec.record_tokens(trainee.model.moe_layers())
        with no_gathering():
            engine.snapshot(step, {"step": step})
            engine.wait_snapshot()
            engine.finish()
        captured[step] = trainee.snapshot()
    snapshotted = {meta.step: set(meta.units) for meta in engine.store.committed()}
    slot = engine.store.committed()[-1]
    whole_bytes = sum(pec.plan.unit_nbytes(parse_unit(key)) for key in slot.units) + sum(
        pec.plan.unit_nbytes(parse_unit(unit), part) for unit, part in map(split_part_key, slot.parts)
    )
    fresh = Trainee(ExpertParallelTopology.from_process_group(1), seed=1, fsdp2=True, shard_size=shard_size)
    store = SnapshotStore(shm)
    if rank == lose_rank:
        store.clear()
    dist.barrier()
    report = TwoLevelCheckpointer(fresh.engine(every_step_config(2, 1, pec_scope=pec_scope), url), store).recover()
    return {"captured": captured, "loaded": fresh.snapshot(), "report": report, "snapshotted": snapshotted,
            "slot_bytes": engine.stats.snapshot_bytes[-1], "whole_bytes": whole_bytes}


@pytest.mark.slow
@pytest.mark.parametrize("lose_rank", [None, 1])
def test_fsdp2_recovers_from_memory_only_where_every_piece_survived(tmp_path: Path, lose_rank: int | None) -> None:
    """Every rank snapshots its own pieces (a slot holds about half of the units' bytes) and recovers them bitwise
    from its own slot. When one rank's slots are lost, no unit is whole in memory any more: every unit comes from
    storage (dense and the persisted expert of step 2) or is lost (the experts only snapshotted)."""
    ranks = run_ranks(snapshot_and_recover, 2, tmp_path, str(tmp_path), lose_rank)
    for rank in ranks:
        report = rank["report"]
        assert report.resume_step == 2
        levels = {key: source["level"] for key, source in report.sources.items()}
        from_step_2 = {k for k, s in report.sources.items() if s["step"] == 2}
        if lose_rank is None:
            assert {levels[k] for k in from_step_2} == {"memory_local"}
            assert sum(k.startswith("expert/") for k in from_step_2) == 2 * len(TINY_MOE_LAYERS)
        else:
            assert {levels[k] for k in from_step_2} == {"storage"}
            assert sum(k.startswith("expert/") for k in from_step_2) == len(TINY_MOE_LAYERS)
        for key, tensor in rank["loaded"].items():
            if parse_unit(key).key in from_step_2:
                assert torch.equal(tensor, rank["captured"][2][key]), key
    for rank in ranks:  # a rank's slot holds its half of each unit (and the scalar steps), not whole units
        assert rank["slot_bytes"] == pytest.approx(rank["whole_bytes"] / 2, rel=0.01)
    print(f"fsdp2 slot bytes per rank {[r['slot_bytes'] for r in ranks]}; its units whole {ranks[0]['whole_bytes']}")


@pytest.mark.slow
def test_fsdp2_recovers_each_part_from_its_newest_slot_under_each_pec_scope(
    under_scope: tuple[str, list[dict]]
) -> None:
    """Under ``pec_scope=optimizer``/``weights`` each rank's slots hold its pieces of 2 experts per MoE layer whole and
    of the other experts' non-PEC part (about half the bytes of those units and parts). A fresh model takes each part
    of each expert from its newest slot, bitwise: the non-PEC part of every expert from step 2, the PEC part from the
    step that snapshotted the expert whole (1 or 2), else it is lost."""
    scope, ranks = under_scope[0], [rank["memory"] for rank in under_scope[1]]
    other = "weights" if scope == "optimizer" else "optimizer"
    for rank in ranks:
        report = rank["report"]
        assert report.resume_step == 2
        experts = {unit: source for unit, source in report.sources.items() if unit.startswith("expert/")}
        non_pec = {(s["parts"][other]["level"], s["parts"][other]["step"]) for s in experts.values()}
        assert non_pec == {("memory_local", 2)}
        snapshotted = rank["snapshotted"]
        assert {s["parts"][scope]["step"] for s in experts.values()} == {NEVER, 1, 2}
        for unit, source in experts.items():
            newest = max((step for step in (1, 2) if unit in snapshotted[step]), default=NEVER)
            assert source["parts"][scope]["step"] == newest, f"{unit}'s {scope} part is its newest slot's"
        for key, tensor in rank["loaded"].items():
            step = source_step(report.sources, key)
            if step != NEVER:
                assert torch.equal(tensor, rank["captured"][step][key]), f"{key} is not its version of step {step}"
        assert rank["slot_bytes"] == pytest.approx(rank["whole_bytes"] / 2, rel=0.01)
    print(f"fsdp2 pec_scope={scope} slot bytes per rank {[r['slot_bytes'] for r in ranks]}; "
          f"its units and parts whole {ranks[0]['whole_bytes']}")


class _RecordPieces(L.Callback):
    """This rank's pieces of every unit when training starts (after a resume's restore) and when fit ends, and the
    learning rate of every param group (what the warm-up schedule sets)."""

    def __init__(self) -> None:
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}

    def _record(self, when: str, trainer: L.Trainer, module: L.LightningModule) -> None:
        layout = build_layout(module, trainer.optimizers[0])
        self.pieces[when] = {k: t.clone() for k, t in layout.pieces(layout.units).items()}
        for i, group in enumerate(trainer.optimizers[0].param_groups):
            self.pieces[when][f"lr/{i}"] = torch.tensor(float(group["lr"]), dtype=torch.float64)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._record("start", trainer, module)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._record("end", trainer, module)


def _lightning_fits(rank: int, world_size: int, root: str) -> dict:
    """Under ``ModelParallelStrategy`` with fsdp2: a fit of 4 steps with MoCCheckpoint, then a fresh module resumed
    through ``ckpt_path=moc.resume_target()`` for 2 more steps."""
    results = {}
    for run, (seed, max_steps) in enumerate(((0, 4), (1, 6))):
        moc = MoCCheckpoint(CheckpointConfig(
            k_snapshot=2, k_persist=1, every_n_train_steps=2, storage=StorageConfig(url=Path(root, "moc").as_uri()),
            shm_root=f"{root}/shm",
        ))
        record = _RecordPieces()
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, max_steps=max_steps, callbacks=[moc, record],
            strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
            logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            use_distributed_sampler=False, default_root_dir=f"{root}/{run}",
        )
        module = GPTMoEModule(SMALL, ep=1, seed=seed, data_parallel="fsdp2")
        loader = sharded_loader(rank, world_size)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=moc.resume_target() if run else None)
        results[run] = {"pieces": record.pieces, "step": trainer.global_step,
                        "recovery": moc.recovery.to_json() if moc.recovery else None}
    return results


@pytest.mark.slow
def test_moc_checkpoint_persists_and_resumes_under_model_parallel_strategy(tmp_path: Path) -> None:
    """A Lightning user moving from DDP to ``ModelParallelStrategy`` (fsdp2) keeps MoCCheckpoint unchanged: the fit
    persists every unit at its end, and a fresh module resumed through ``ckpt_path=moc.resume_target()`` starts
    training from exactly those pieces (weights and Adam state, bitwise on every rank) at the learning rate the run
    had reached (``ModelParallelStrategy`` restores no optimizer from a checkpoint dict), then trains on."""
    ranks = run_ranks(_lightning_fits, 2, tmp_path, str(tmp_path), init_process_group=False)
    for rank in ranks:
        first, resumed = rank[0], rank[1]
        assert resumed["recovery"]["resume_step"] == 4 and resumed["step"] == 6
        assert {s["step"] for s in resumed["recovery"]["sources"].values()} == {4}
        before, after = first["pieces"]["end"], resumed["pieces"]["start"]
        assert after.keys() == before.keys() and any("/optim/" in k for k in after)
        for key, tensor in before.items():
            assert torch.equal(after[key], tensor), key


def test_an_fsdp2_checkpoint_consolidates_to_the_dense_model(
    tmp_path: Path, written_by_fsdp2: tuple[Path, list[dict]]
) -> None:
    """``moc-consolidate`` joins the pieces two FSDP2 ranks wrote into the dense model: the weights one process
    restores from the same checkpoints."""
    root, _ = written_by_fsdp2
    url = (root / "ckpt").as_uri()
    restored = Trainee(ExpertParallelTopology(), seed=1)
    restored.engine(every_step_config(4, 4), url).load_latest()
    consolidate(url, tmp_path / "dense.safetensors", "safetensors", progress=False)
    assert_weights_equal(load_file(tmp_path / "dense.safetensors"), restored.model)
