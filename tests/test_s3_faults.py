"""Faults of the network and the store on ``s3://`` (issue 31, item 3), dealt by a fault proxy
(:mod:`moc_lightning.tools.chaos.s3_proxy`) between TensorStore and a live S3-protocol server (moto).

Each fault either is retried (bounded by ``checkpoint.storage.retries``, each retry counted) and the checkpoint round
trip stays bitwise, or ends as one error naming the options or the object, with nothing committed and nothing damaged
loaded. Every test asserts its fault fired: a fault that never fired tested nothing. The model is the one MoE layer of
4 experts of ``test_s3_storage.py`` (each tensor is its own objects in the bucket), driven by hand through the PEC
engine (:class:`~trainee.Trainee`), one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from trainee import Trainee, every_step_config

from moc_lightning.config import StorageConfig
from moc_lightning.engine.layout import build_layout
from moc_lightning.engine.manifest import Manifest
from moc_lightning.models import ExpertParallelTopology, GPTMoEConfig
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.outcomes import PersistFailed
from moc_lightning.pec.stored import MANIFEST
from moc_lightning.storage import CheckpointStorage, corrupt_from, make_storage
from moc_lightning.storage.location import STALL_VARIABLES, S3RetryConfig, s3_request_retries
from moc_lightning.tools.chaos.s3_proxy import FaultRule, S3FaultProxy
from moc_lightning.tools.chaos.s3_server import CREDENTIALS, S3Server

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MODEL = GPTMoEConfig(block_size=16, n_layer=1, moe_every=1, n_embd=32, n_head=2, num_experts=4)
"""One block, an MoE one of 4 experts: every tensor is its own objects in the bucket (~6 requests each), so the fewer
the faster."""
RETRIES = S3RetryConfig(max_retries=3, initial_delay_s=0.05, max_delay_s=0.2)
"""Short backoff, so that a fault past the bound fails in well under a second."""
ONE_RETRY = S3RetryConfig(max_retries=1, initial_delay_s=0.05, max_delay_s=0.05)
"""For faults that outlast any bound: the fewer tries, the fewer requests a failing persist makes (each of its
arrays is tried, concurrently, this many times more)."""
SECRETS = (CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


def _storage(url: str, proxy: S3FaultProxy, retries: S3RetryConfig = RETRIES) -> CheckpointStorage:
    return make_storage("tensorstore", url, proxy.endpoint, retries)


def _engine(trainee: Trainee, storage: CheckpointStorage) -> PECCheckpointer:
    """PEC with K = every expert, so that one persist alone restores every unit (its oracle: the trainee's state)."""
    config = every_step_config(MODEL.num_experts, MODEL.num_experts, storage=StorageConfig(backend="tensorstore"))
    layout = build_layout(trainee.model, trainee.optimizer, num_experts=MODEL.num_experts)
    return PECCheckpointer(config, layout, trainee.model.topology, storage)


def _restored(storage: CheckpointStorage) -> tuple[int | None, dict[str, torch.Tensor]]:
    """A fresh trainee (another seed) restored from ``storage``: the step it resumed at and its state."""
    fresh = Trainee(ExpertParallelTopology(), seed=1, config=MODEL)
    report = _engine(fresh, storage).load_latest()
    return (report.resume_step if report is not None else None), fresh.snapshot()


def _committed(storage: CheckpointStorage) -> list[int]:
    return [r.step for r in Manifest.from_json(storage.get(MANIFEST) or b"").records]


def _assert_bitwise(restored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert restored.keys() == expected.keys()
    assert all(torch.equal(restored[k], expected[k]) for k in expected), "a tensor differs from its committed value"


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16(), "note": f"v{seed}"}


def _round_trip(storage: CheckpointStorage) -> dict[str, object]:
    """:func:`_state` written as checkpoint ``step_1`` and read back into zeros."""
    dcp.save(_state(), storage_writer=storage.writer("step_1"), no_dist=True)
    loaded: dict[str, object] = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "note": None}
    dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    return loaded


WITHIN = {
    "503 SlowDown, 500": (FaultRule("status", "^PUT ", times=3, status=503),
                          FaultRule("status", "^GET ", times=3, status=500)),
    "reset": (FaultRule("reset_upload", "^PUT .*/c/", times=2), FaultRule("reset_read", "^GET .*/c/", times=2)),
    "slow": (FaultRule("delay", "^PUT ", times=3, delay_s=0.2), FaultRule("delay", "^GET ", times=3, delay_s=0.2)),
}  # fmt: skip
"""Per case, the fault dealt to a checkpoint's writes and the one dealt to its reads, each within the bound: a request
fails at most ``RETRIES.max_retries`` times in a row."""


@pytest.mark.parametrize("case", list(WITHIN))
def test_faults_within_the_bound_are_retried_counted_and_the_round_trip_is_bitwise(
    case: str, s3_server: S3Server, proxy: S3FaultProxy
) -> None:
    """Failed before issue 31's item 3 on 86abbc6: ``make_storage`` took no retry bounds (TensorStore's default
    backoff, 1 s doubling to 32 s, would make a fault cost seconds)."""
    storage = _storage(f"s3://{s3_server.new_bucket()}/run", proxy)
    write_fault, read_fault = (proxy.add(dataclasses.replace(rule)) for rule in WITHIN[case])
    retried, start = s3_request_retries(), time.monotonic()
    loaded = _round_trip(storage)
    took = time.monotonic() - start
    assert (write_fault.dealt, read_fault.dealt) == (write_fault.times, read_fault.times), "every fault fired"
    saved = _state()
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"]) and loaded["note"] == "v0"
    counted = s3_request_retries() - retried
    if case == "slow":
        assert took >= 2 * write_fault.delay_s and counted == 0, (took, counted)  # the writes, then the reads
    elif case == "reset":  # curl itself re-sends once, uncounted, a request whose reused connection died unanswered
        assert counted >= 1, "a reset connection is a counted retry"
    else:
        assert counted >= write_fault.dealt + read_fault.dealt, f"each answer is a counted retry: {counted}"


def test_faults_beyond_the_bound_end_in_one_error_commit_nothing_and_load_nothing_damaged(
    s3_server: S3Server, proxy: S3FaultProxy, capfd: pytest.CaptureFixture[str]
) -> None:
    """A PEC run through the proxy; step 1 committed. Then faults that outlast ``checkpoint.storage.retries``:

    - every write of step 2 answered ``503 SlowDown``: the persist fails after the bound with one error naming the
      option and the checkpoint, and the manifest still names step 1 alone;
    - every read of step 1's ``.metadata`` cut off mid-answer: the restore is one error naming the option, and the
      checkpoint is kept (a network fault is no evidence against stored bytes); once the network heals the restore is
      step 1, bitwise.

    Failed on 86abbc6 at the first persist: no retry bounds could be given (``make_storage`` took none)."""
    bucket = s3_server.new_bucket()
    trainee = Trainee(ExpertParallelTopology(), config=MODEL)
    storage = _storage(f"s3://{bucket}/run", proxy, ONE_RETRY)
    engine = _engine(trainee, storage)
    trainee.step(1)
    engine.checkpoint(1)
    at_step_1 = trainee.snapshot()
    trainee.step(2)
    rule = proxy.add(FaultRule("status", "^PUT .*/step_000000002/", times=None, status=503))
    start = time.monotonic()
    with pytest.raises(PersistFailed) as failed:
        engine.checkpoint(2)
    waited = time.monotonic() - start
    proxy.clear()
    assert rule.dealt >= ONE_RETRY.max_retries + 1, f"the fault fired {rule.dealt} times"
    message = str(failed.value)
    assert "failed after every retry (checkpoint.storage.retries.max_retries)" in message, message
    assert f"checkpoint s3://{bucket}/run/step_000000002/: " in message and "SlowDown" in message, message
    assert waited < 20, f"bounded, yet it took {waited:.1f} s"
    assert _committed(storage) == [1], "the failed persist is not committed"

    rule = proxy.add(FaultRule("reset_read", r"^GET .*/step_000000001/\.metadata$", times=None))
    with pytest.raises(BaseException) as cut_off:
        _restored(storage)
    proxy.clear()
    assert rule.dealt >= ONE_RETRY.max_retries + 1
    assert "failed after every retry (checkpoint.storage.retries.max_retries)" in str(cut_off.value), cut_off.value
    assert _committed(storage) == [1], "a network fault must not drop a committed checkpoint"
    step, restored = _restored(storage)
    assert step == 1
    _assert_bitwise(restored, at_step_1)


def test_uploads_cut_off_beyond_the_bound_fail_the_save_and_leave_no_checkpoint(
    s3_server: S3Server, proxy: S3FaultProxy
) -> None:
    """Every chunk upload reset halfway: the save fails after the bound naming the option, and its ``.metadata`` (what
    makes a location a checkpoint, written last) is never written, so nothing of it can be loaded; the engine then
    commits nothing, as for the ``SlowDown`` above (any failed write ends a persist so)."""
    storage = _storage(f"s3://{s3_server.new_bucket()}/run", proxy)
    rule = proxy.add(FaultRule("reset_upload", "^PUT .*/c/", times=None))
    with pytest.raises(BaseException) as failed:
        _round_trip(storage)
    proxy.clear()
    assert rule.dealt >= RETRIES.max_retries + 1
    assert "failed after every retry (checkpoint.storage.retries.max_retries)" in str(failed.value), failed.value
    with pytest.raises(BaseException) as unfinished:
        dcp.load({"w": torch.zeros(64, 32)}, storage_reader=storage.reader("step_1"), no_dist=True)
    damage = corrupt_from(unfinished.value)
    assert damage is not None and ".metadata is missing" in damage.detail, unfinished.value


STALLED_ROUND_TRIP = """
import json, sys, time, torch, torch.distributed.checkpoint as dcp
from moc_lightning.storage import make_storage
from moc_lightning.storage.location import S3RetryConfig, s3_request_retries
url, endpoint = sys.argv[1:3]
storage = make_storage("tensorstore", url, endpoint, S3RetryConfig(3, 0.05, 0.2, stall_timeout_s=1))
saved = {"w": torch.randn(64, 32)}
start = time.monotonic()
dcp.save(saved, storage_writer=storage.writer("step_1"), no_dist=True)
wrote = time.monotonic() - start
loaded = {"w": torch.zeros(64, 32)}
dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
print(json.dumps({"write_s": wrote, "round_trip_s": time.monotonic() - start, "retries": s3_request_retries(),
                  "bitwise": torch.equal(loaded["w"], saved["w"])}))
"""
"""A round trip with ``stall_timeout_s=1``, in a process of its own: TensorStore reads the bound once per process, at
its first HTTP request, which this test process has long made."""

STALL_S = 120.0
"""How long the proxy keeps a stalled request silent: a request that waits it out took no bound."""


def test_a_request_gone_silent_is_aborted_after_the_stall_bound_and_retried(
    s3_server: S3Server, proxy: S3FaultProxy
) -> None:
    """A chunk upload the store never answers (for 120 s): under ``checkpoint.storage.retries.stall_timeout_s=1`` it
    is aborted within seconds (~7 s: curl's speed is a moving average) and retried, counted, and the round trip is
    bitwise. On 7def2ed (no bound) such a request waited out the whole stall (40 s of 40 s in a probe with the same
    rule, and as long for a read stopped halfway): a silent store would hold a persist, and the next, for tens of
    minutes. Reads take the same transport and bound (the probe: 7.3 s for a read stalled 40 s)."""
    rule = proxy.add(FaultRule("stall", "^PUT .*/c/", delay_s=STALL_S))
    env = {k: v for k, v in os.environ.items() if k not in STALL_VARIABLES}
    done = subprocess.run([sys.executable, "-c", STALLED_ROUND_TRIP, f"s3://{s3_server.new_bucket()}/run",
                           proxy.endpoint], env=env, capture_output=True, text=True, timeout=2 * STALL_S)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert rule.dealt == 1, "the stall was dealt"
    assert result["bitwise"], result
    assert result["round_trip_s"] < STALL_S / 4, f"a stalled request waited out the stall: {result}"
    assert result["retries"] >= 1, f"an aborted request is a counted retry: {result}"


def test_an_object_deleted_after_its_commit_is_damage_named_at_load(s3_server: S3Server, proxy: S3FaultProxy) -> None:
    """A chunk object deleted behind MoC's back is :class:`CorruptCheckpointError` naming its array, not fill values
    and not a network error: recovery then drops the checkpoint and falls back, reporting it (shown over ``s3://``
    for an object cut short by ``test_s3_storage.py``; any damage takes the same path)."""
    bucket = s3_server.new_bucket()
    storage = _storage(f"s3://{bucket}/run", proxy)
    _round_trip(storage)
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint)
    s3.delete_object(Bucket=bucket, Key="run/step_1/w/@0.0/c/0/0")
    loaded: dict[str, object] = {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "note": None}
    with pytest.raises(BaseException) as failed:
        dcp.load(loaded, storage_reader=storage.reader("step_1"), no_dist=True)
    damage = corrupt_from(failed.value)
    assert damage is not None and "w/@0.0" in damage.detail, failed.value
    assert torch.equal(loaded["w"], torch.zeros(64, 32)), "nothing of the lost chunk was delivered"


@pytest.mark.parametrize("case", ["wrong key", "expired token", "expired mid-run"])
def test_a_refused_credential_is_one_error_naming_the_options_and_no_key(
    case: str, s3_server: S3Server, proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Failed on 86abbc6: the open succeeded (the endpoint answers), and the first read raised TensorStore's own
    ``PERMISSION_DENIED`` with the store's whole answer appended, naming neither option nor variable."""
    url = f"s3://{s3_server.new_bucket()}/run"
    token = "moc-session-token-5be1"
    secrets = (*SECRETS, token, "moc-wrong-key")
    if case == "wrong key":
        proxy.accepted_key_id = CREDENTIALS["AWS_ACCESS_KEY_ID"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "moc-wrong-key")
    else:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    storage = _storage(url, proxy) if case == "expired mid-run" else None
    if case != "wrong key":
        proxy.add(FaultRule("expired", times=None))
    with pytest.raises(ValueError) as refused:
        if storage is None:
            _storage(url, proxy)
        else:
            storage.get(MANIFEST)
    assert proxy.injections, "the store refused nothing"
    message = str(refused.value)
    code = "InvalidAccessKeyId" if case == "wrong key" else "ExpiredToken"
    assert message.startswith(f"checkpoint.storage.url='{url}': the store at {proxy.endpoint} (from "
                              f"checkpoint.storage.endpoint) refused the credentials"), message
    assert code in message and "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN" in message, message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__, "the store's answer is not chained"
    assert not [s for s in secrets if s in message + "".join(capfd.readouterr())], "a credential was printed"
