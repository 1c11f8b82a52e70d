"""The bench's ``storage=s3`` row: MoC's persist and restore through ``s3://`` beside the endpoint's own speed of light,
measured against the same server in the same run (issue 31, item 4).

MoC persists the whole trained state (every unit: ``moc_full``'s bytes) with ``checkpoint.storage.backend=tensorstore
url=s3://BUCKET/...`` through its engine (DCP's plan, a zarr array per tensor, checksums, ``moc.json``, the manifest
commit), and a fresh engine restores it (:meth:`~moc_lightning.pec.checkpointer.PECCheckpointer.load_latest`), each
alone in the process: the figure the endpoint allows MoC's writer and reader, not their overlap with training.

The bounds are what a plain client gets from the same server for the same bytes:

- **PUT**: the checkpoint's bytes as one object, uploaded by boto3's multipart upload with its defaults (8 MiB parts,
  10 requests in flight; ``aws s3 cp`` moves a file so). That is the endpoint's speed of light for those bytes: S3's
  fastest way in, where each request carries a full part and the server always has several to work on. Any layout of
  the same bytes in objects (MoC's: one or more per tensor, with metadata) takes at least as many requests, so a
  ratio under 1 is what MoC's layout and bookkeeping cost; kvstore writes of MoC's own object sizes would hide the
  layout's share.
- **GET**: the very objects the persist wrote, each read whole through TensorStore's ``s3`` kvstore, all requested
  at once: plain GETs with the restore's own HTTP client and concurrency, so that the ratio is what MoC's restore adds
  (the manifest, DCP's planning, the checksums, the copy into the live tensors). boto3's GETs of the same objects, 10
  at a time, were slower than the restore itself where the objects are small (a 2-layer model's 330 objects: 2.0 s
  against 1.4 s on the reference machine): a bound that the measured method beats is no bound.

Each trial runs all four on a fresh prefix and removes what it wrote; the order alternates (persist, PUT, restore, GET;
then PUT, persist, GET, restore), and the best of each over the trials is kept, so that a quiet moment favours no one.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import boto3
import tensorstore as ts
from boto3.s3.transfer import TransferConfig

from moc_lightning.config import CheckpointConfig, StorageConfig
from moc_lightning.engine.layout import Layout
from moc_lightning.models.lightning import GPTMoEModule
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.storage import make_storage
from moc_lightning.storage.location import open_kvstore, parse_endpoint, s3_endpoint, s3_region
from moc_lightning.tools.bench.config import GB, BenchConfig
from moc_lightning.tools.bench.fitting import fit
from moc_lightning.tools.bench.methods import layout_of

TRANSFER = TransferConfig()
"""boto3's defaults, as ``aws s3 cp`` uses them: multipart above 8 MiB, 8 MiB parts, 10 requests in flight."""

PHASES = ("persist", "put", "restore", "get")
"""What each trial times: MoC's persist, its bound, MoC's restore, its bound."""

PUT_MEASURED = "the checkpoint's bytes as one object: boto3 multipart upload, 8 MiB parts, 10 in flight"
GET_MEASURED = "the checkpoint's objects, each read whole through TensorStore's s3 kvstore, all requested at once"


@dataclass
class ObjectStoreRow:
    """The object-store row of the result; ``docs/bench.md`` documents every field. GB/s are the best trial's."""

    endpoint: str
    """The endpoint's URL (never with a key: one with a user or password is refused)."""
    server: str
    """Where the endpoint came from: the ``endpoint`` option, the variable that named it, or moto started by the run."""
    trials: int
    checkpoint_bytes: int
    """Bytes of every object the persist wrote under its checkpoint's prefix (the manifest aside)."""
    checkpoint_objects: int
    tensor_bytes: int
    """Tensor bytes the persist wrote (eq. 5 on this model)."""
    persist_gbps: float
    put_gbps: float
    persist_put_ratio: float
    restore_gbps: float
    get_gbps: float
    restore_get_ratio: float
    persist_seconds: list[float]
    """Every trial's, in order (as are the next three)."""
    put_seconds: list[float]
    restore_seconds: list[float]
    get_seconds: list[float]
    put_measured: str = PUT_MEASURED
    get_measured: str = GET_MEASURED


@dataclass
class _Written:
    """What one trial's persist left in the bucket."""

    keys: list[str]
    nbytes: int
    tensor_bytes: int


def object_store_row(cfg: BenchConfig, work: Path) -> ObjectStoreRow:
    """Train the benchmark's model without checkpointing, then run ``cfg.s3_trials`` interleaved trials on its state."""
    run = fit(cfg, work / "object_store", [])
    layout = layout_of(run.trainer)
    module = cast(GPTMoEModule, run.trainer.lightning_module)
    with _endpoint(cfg) as (endpoint, server):
        client: Any = boto3.client("s3", endpoint_url=endpoint, region_name=s3_region())
        with _bucket(client, cfg.bucket) as bucket:
            bench = _Trials(cfg, layout, module, client, bucket, endpoint)
            for trial in range(cfg.s3_trials):
                bench.run(trial)
    return bench.row(endpoint, server)


@contextlib.contextmanager
def _endpoint(cfg: BenchConfig) -> Iterator[tuple[str, str]]:
    """The endpoint and where it came from: ``cfg.endpoint``, else the AWS environment's, else moto's server, started
    on 127.0.0.1 for the block (the AWS environment pointed at it meanwhile)."""
    if cfg.endpoint:
        yield parse_endpoint(cfg.endpoint, "endpoint"), "the endpoint option"
        return
    named = s3_endpoint()
    if named is not None:
        yield named.url, named.source
        return
    from moc_lightning.tools.chaos.s3_server import running_s3_server  # moto: only where no endpoint is named

    with running_s3_server() as server:
        yield server.endpoint, "moto's server, started by the bench on 127.0.0.1"


@contextlib.contextmanager
def _bucket(client: Any, name: str) -> Iterator[str]:
    """``name``, or a new bucket removed at the end with what is left in it."""
    if name:
        yield name
        return
    made = f"moc-bench-{uuid.uuid4().hex[:12]}"
    region = s3_region()
    where = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    client.create_bucket(Bucket=made, **where)
    try:
        yield made
    finally:
        _delete_prefix(client, made, "")
        client.delete_bucket(Bucket=made)


@dataclass
class _Trials:
    """The interleaved trials on one bucket, under a prefix of their own, and their figures."""

    cfg: BenchConfig
    layout: Layout
    """The trained state's units, which every persist writes and every restore loads back."""
    module: GPTMoEModule
    client: Any
    """boto3's S3 client of the endpoint: the PUT, the listings, the clean-up."""
    bucket: str
    endpoint: str
    prefix: str = field(default_factory=lambda: f"moc_bench_{uuid.uuid4().hex[:12]}")
    seconds: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in PHASES})
    """Every trial's seconds, by phase."""
    written: _Written | None = None
    payload: bytes = b""
    """The PUT's bytes: as many as the checkpoint's, random (made once, outside any timing)."""

    def run(self, trial: int) -> None:
        """One trial on a fresh prefix, removed afterwards; the first starts with MoC's persist (its size sizes the
        PUT), later ones alternate which of each pair goes first."""
        root = f"{self.prefix}/trial{trial}"
        url = f"s3://{self.bucket}/{root}"
        steps: list[tuple[str, Callable[[], float]]] = [
            ("persist", lambda: self._persist(url, root)), ("put", lambda: self._put(root)),
            ("restore", lambda: self._restore(url)), ("get", lambda: self._get(url, root)),
        ]  # fmt: skip
        if trial % 2:
            steps = [steps[1], steps[0], steps[3], steps[2]]
        try:
            for name, step in steps:
                self.seconds[name].append(step())
        finally:
            _delete_prefix(self.client, self.bucket, f"{root}/")

    def _engine(self, url: str) -> PECCheckpointer:
        """A PEC engine of every unit on ``url``: opening it asks the endpoint once, outside any timing."""
        n = min(self.layout.num_experts)
        storage = StorageConfig(backend="tensorstore", url=url, endpoint=self.endpoint)
        config = CheckpointConfig(k_snapshot=n, k_persist=n, every_n_train_steps=1, persist_every_n_snapshots=1,
                                  storage=storage)  # fmt: skip
        return PECCheckpointer(config, self.layout, self.module.expert_topology,
                               make_storage("tensorstore", url, self.endpoint), backend="tensorstore")  # fmt: skip

    def _persist(self, url: str, root: str) -> float:
        engine = self._engine(url)
        start = time.perf_counter()
        report = engine.checkpoint(1)  # K = N: every unit, the ledger marked at the step as a training run marks it
        seconds = time.perf_counter() - start
        if report is None or set(report.units) != {u.key for u in self.layout.units}:
            raise RuntimeError(f"the persist at {url} did not write every unit of the state")
        listed = _listed(self.client, self.bucket, f"{root}/{report.name}/")
        written = _Written(sorted(listed), sum(listed.values()), report.bytes_written)
        if self.written is not None and written.nbytes != self.written.nbytes:
            raise RuntimeError(f"the persist wrote {written.nbytes} bytes, an earlier trial's {self.written.nbytes}")
        self.written = written
        if not self.payload:
            self.payload = os.urandom(written.nbytes)
        return seconds

    def _put(self, root: str) -> float:
        if not self.payload:
            raise RuntimeError("the PUT's size is the persist's: the first trial persists first")
        start = time.perf_counter()
        self.client.upload_fileobj(io.BytesIO(self.payload), self.bucket, f"{root}/put.bin", Config=TRANSFER)
        return time.perf_counter() - start

    def _restore(self, url: str) -> float:
        engine = self._engine(url)
        start = time.perf_counter()
        report = engine.load_latest()
        seconds = time.perf_counter() - start
        if report is None:
            raise RuntimeError(f"nothing to restore at {url}: the trial's persist is not in its manifest")
        return seconds

    def _get(self, url: str, root: str) -> float:
        written = self._persisted()
        kvstore = open_kvstore(url, ts.Context(), self.endpoint)  # asks the endpoint once, outside the timing
        keys = [key.removeprefix(f"{root}/") for key in written.keys]
        start = time.perf_counter()
        reads = [kvstore.read(key) for key in keys]
        nbytes = sum(len(read.result().value) for read in reads)
        seconds = time.perf_counter() - start
        if nbytes != written.nbytes:
            raise RuntimeError(f"the GET read {nbytes} bytes of the persist's {written.nbytes}")
        return seconds

    def _persisted(self) -> _Written:
        if self.written is None:
            raise RuntimeError("no persist yet: a trial's GET reads what its persist wrote")
        return self.written

    def row(self, endpoint: str, server: str) -> ObjectStoreRow:
        """The figures: each GB/s from the fastest of its trials, and the ratios of those."""
        written = self._persisted()
        best = {name: written.nbytes / min(seconds) / GB for name, seconds in self.seconds.items()}
        kept = {name: [round(s, 6) for s in seconds] for name, seconds in self.seconds.items()}
        return ObjectStoreRow(
            endpoint=endpoint, server=server, trials=self.cfg.s3_trials, checkpoint_bytes=written.nbytes,
            checkpoint_objects=len(written.keys), tensor_bytes=written.tensor_bytes,
            persist_gbps=_digits(best["persist"]), put_gbps=_digits(best["put"]),
            persist_put_ratio=_digits(best["persist"] / best["put"]),
            restore_gbps=_digits(best["restore"]), get_gbps=_digits(best["get"]),
            restore_get_ratio=_digits(best["restore"] / best["get"]),
            persist_seconds=kept["persist"], put_seconds=kept["put"], restore_seconds=kept["restore"],
            get_seconds=kept["get"],
        )  # fmt: skip


def _digits(value: float) -> float:
    """``value`` to 4 significant digits: GB/s of a few MB on a slow server are thousandths."""
    return float(f"{value:.4g}")


def _listed(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    """Key -> size of every object under ``prefix``."""
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
    return found


def _delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Remove every object under ``prefix`` (``""``: the whole bucket's)."""
    keys = list(_listed(client, bucket, prefix))
    for start in range(0, len(keys), 1000):  # DeleteObjects takes up to 1000 keys
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})
