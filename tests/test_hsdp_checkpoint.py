"""MoC over HSDP (``trainer.data_parallel=hsdp``): parameters and optimizer state are DTensors sharded within a shard
group and replicated across the groups. Each rank snapshots its local pieces; a persist writes every piece once,
split over its replicas by ownership (issue 12, item 2). Nothing is gathered, except by these tests' oracles
(:meth:`Trainee.full_snapshot`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from lightning_run import source_step
from test_checkpointer import check_round_trip
from test_fsdp2_checkpoint import no_gathering, snapshot_and_recover
from trainee import Trainee, every_step_config, load_fresh, train_and_checkpoint

from moc_lightning.engine.ledger import NEVER
from moc_lightning.engine.parts import part_of
from moc_lightning.engine.units import parse_unit
from moc_lightning.models import ExpertParallelTopology

pytestmark = pytest.mark.xdist_group("hsdp_checkpoint")  # one worker writes the module's checkpoints once

WORLD, SHARD = 4, 2
"""Two replica groups of a shard group of 2: ranks r and r + 2 hold the same pieces."""
LOST = 1
"""The rank whose slots are lost before the in-memory recovery; rank 3 holds the same pieces."""
K1_SCOPE, MEMORY_SCOPE = "weights", "optimizer"
"""``checkpoint.pec_scope`` of the K=1 persist and of the snapshots and in-memory recovery: the storage round trip
checks ``both``, these the parts of the other experts, written and restored in pieces (``test_pec_scope.py`` and
``test_fsdp2_checkpoint.py`` check each scope on its own)."""


def _write_and_reload(rank: int, world_size: int, root: str) -> dict:
    """:func:`train_and_checkpoint` under HSDP (ep=1) with nothing gathered while checkpointing; fresh models restored
    from it on the same ranks, under HSDP and under FSDP2 over all 4 ranks (shard groups of 4, not 2: DCP reshards);
    then a second model's K=1 persist of its step 3 under :data:`K1_SCOPE`, to storage of its own; then snapshots
    and a recovery with rank 1's slots lost under :data:`MEMORY_SCOPE` (:func:`snapshot_and_recover`)."""
    url = Path(root, "ckpt").as_uri()
    written = train_and_checkpoint(rank, world_size, url, 1, fsdp2=True, shard_size=SHARD, guard=no_gathering)
    reloaded = load_fresh(rank, world_size, url, 1, fsdp2=True, shard_size=SHARD)
    as_fsdp2 = load_fresh(rank, world_size, url, 1, fsdp2=True)
    trainee = Trainee(ExpertParallelTopology.from_process_group(1), fsdp2=True, shard_size=SHARD)
    k1 = trainee.engine(every_step_config(1, 1, pec_scope=K1_SCOPE), Path(root, "k1").as_uri())
    for step in (1, 2, 3):
        trainee.step(step)
        k1.record_tokens(trainee.model.moe_layers())
    with no_gathering():
        report = k1.checkpoint(3)
    recovered = snapshot_and_recover(rank, world_size, str(Path(root, "two_level")), LOST, SHARD, MEMORY_SCOPE)
    return written | {"recovered": recovered} | {
        "reloaded": reloaded, "as_fsdp2": as_fsdp2, "captured_3": trainee.snapshot(), "k1_report": report,
        "k1_eq6": k1.size_model().c_pec(1, K1_SCOPE)
    }


@pytest.fixture(scope="module")
def written_by_hsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """What 4 HSDP ranks (2 replica groups x shard groups of 2) wrote and restored (:func:`_write_and_reload`)."""
    root = tmp_path_factory.mktemp("hsdp")
    return root, run_ranks(_write_and_reload, WORLD, root, str(root))


@pytest.mark.slow
def test_an_hsdp_checkpoint_round_trips_bitwise_on_the_same_ranks(written_by_hsdp: tuple[Path, list[dict]]) -> None:
    """Each rank of a fresh HSDP model loads its own pieces of every unit, weights and Adam state, bitwise as they were
    at their source step (dense and the step-4 experts from step 4, the others from step 2), PLT by hand; the
    replicas of a piece load the same bytes."""
    _, written = written_by_hsdp
    for wrote in written:
        check_round_trip(wrote | wrote["reloaded"])
        assert any("/optim/" in k for k in wrote["reloaded"]["loaded"]), "the optimizer state came back too"
    for rank in range(SHARD):
        mine, replica = written[rank]["reloaded"]["loaded"], written[rank + SHARD]["reloaded"]["loaded"]
        assert mine.keys() == replica.keys()


@pytest.mark.slow
def test_a_k1_persist_splits_each_replicated_piece_over_its_holders(written_by_hsdp: tuple[Path, list[dict]]) -> None:
    """A K=1 persist under ``pec_scope=weights`` writes every piece of the selected units and of the other experts'
    optimizer state once: the two replicas of a piece (ranks r and r + 2) together write exactly its bytes (Adam's
    scalar steps once, by rank 0), each about half of them, never the same bytes twice; the ranks' bytes sum to eq. 6
    of the scope within 1%."""
    _, written = written_by_hsdp
    per_rank = [w["k1_report"].bytes_written for w in written]
    for rank in range(SHARD):
        units = set(written[rank]["k1_report"].units)
        assert sum(u.startswith("expert/") for u in units) == 2  # K=1 in each of TINY's two MoE layers
        pieces = {
            k: t for k, t in written[rank]["captured_3"].items()
            if parse_unit(k).key in units or (k.startswith("expert/") and part_of(k) != K1_SCOPE)
        }
        held = sum(t.numel() * t.element_size() for t in pieces.values() if t.dim() > 0 or rank == 0)
        pair = per_rank[rank] + per_rank[rank + SHARD]
        assert pair == held, f"ranks {rank} and {rank + SHARD} write their shared pieces once"
        assert 0.3 * held < per_rank[rank] < 0.7 * held, "the replicas split the writing"
    total = sum(per_rank)
    assert total == pytest.approx(written[0]["k1_eq6"], rel=0.01)
    assert total == written[0]["k1_report"].expected_bytes
    print(f"hsdp K=1 pec_scope={K1_SCOPE} persist bytes per rank: {per_rank}, sum {total}, "
          f"eq. 6 {written[0]['k1_eq6']:.0f}")


@pytest.mark.slow
def test_an_hsdp_checkpoint_loads_under_fsdp2(written_by_hsdp: tuple[Path, list[dict]]) -> None:
    """HSDP (shard groups of 2, replicated twice) -> FSDP2 sharded over all 4 ranks: each rank loads its quarter of every
    unit, which DCP cuts from the pieces the replicas wrote; together (all-gathered by the oracle) they are bitwise the
    whole tensors as they were."""
    _, written = written_by_hsdp
    for wrote in written:
        got = wrote["as_fsdp2"]
        check_round_trip(written[0] | {"captured": written[0]["captured_full"]} | got | {"loaded": got["loaded_full"]})
        hsdp_rows = wrote["reloaded"]["loaded"]["dense/wte/param/weight"].shape[0]
        assert got["loaded"]["dense/wte/param/weight"].shape[0] * 2 == hsdp_rows, "FSDP2 pieces are half HSDP's"


@pytest.mark.slow
def test_an_hsdp_checkpoint_loads_in_one_ddp_process(written_by_hsdp: tuple[Path, list[dict]]) -> None:
    """HSDP on 4 ranks -> one process with plain tensors: every unit whole, bitwise."""
    root, written = written_by_hsdp
    loaded = load_fresh(0, 1, (root / "ckpt").as_uri())
    check_round_trip(written[0] | {"captured": written[0]["captured_full"]} | loaded)
    assert {parse_unit(k).key for k in loaded["loaded"]} == {parse_unit(k).key for k in written[0]["captured_full"][4]}


@pytest.mark.slow
def test_hsdp_replicas_stand_in_for_a_lost_slot_in_memory(written_by_hsdp: tuple[Path, list[dict]]) -> None:
    """Every rank snapshots its own pieces (a slot holds half of its units' and parts' bytes: the shard group is 2)
    under ``pec_scope=optimizer``: 2 experts per MoE layer whole, the weights of the others. Rank 1's slots are lost,
    but rank 3 holds the same pieces: every unit and part of steps 1 and 2 still comes from memory, rank 1's pieces
    sent by rank 3, bitwise; every expert's weights come from step 2, and only the optimizer state of the experts
    never snapshotted whole is lost."""
    _, written = written_by_hsdp
    for rank, wrote in enumerate(written):
        recovered = wrote["recovered"]
        report = recovered["report"]
        assert report.resume_step == 2
        expected = {"level": "memory_peer", "rank": LOST + SHARD} if rank == LOST else {"level": "memory_local"}
        parts = [part for source in report.sources.values() for part in source.get("parts", {"": source}).values()]
        for source in parts:
            if source["step"] != NEVER:
                assert {k: source[k] for k in expected} == expected, (rank, source)
        experts = [source for unit, source in report.sources.items() if unit.startswith("expert/")]
        assert {source["parts"]["weights"]["step"] for source in experts} == {2}
        assert sum(source["step"] == 2 for source in experts) == 2 * 2  # K=2 in each of TINY's two MoE layers
        for key, tensor in recovered["loaded"].items():
            step = source_step(report.sources, key)
            if step != NEVER:
                assert torch.equal(tensor, recovered["captured"][step][key]), f"{key} is not its version of step {step}"
        assert recovered["slot_bytes"] == pytest.approx(recovered["whole_bytes"] / SHARD, rel=0.01)
    print(f"hsdp pec_scope={MEMORY_SCOPE} slot bytes per rank {[w['recovered']['slot_bytes'] for w in written]}; "
          f"its units and parts whole {written[0]['recovered']['whole_bytes']}")
