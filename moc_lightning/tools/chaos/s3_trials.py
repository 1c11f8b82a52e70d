"""Chaos trials on ``s3://`` (``recipes/chaos.py storage=s3``, issue 31): each trial's job keeps its checkpoints in a
bucket of a local S3-protocol server (moto), reached through the fault proxy, which deals the trial's network fault
beside its kills, node losses and damage. PEC trials only: replay windows in a bucket are checked by
``tests/test_replay_lightning.py`` (a lost node's resume from the bucket, bitwise).

A trial draws one network fault (:data:`NETWORK_FAULTS`): answers ``503 SlowDown`` or ``500``, slow answers,
connections reset mid-upload or mid-read, each a few times from a random request on (retried within
:data:`S3_RETRIES`), or an ``outage``: every write of one control object refused past the bound, so that a persist
fails with nothing committed. The oracle judges the trial as on a local directory; a network fault that never fired
leaves the trial unfired, no pass. Damage between incarnations is done to the bucket's objects with an ordinary S3
client, behind MoC's back.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3

from moc_lightning.storage.location import S3RetryConfig
from moc_lightning.tools.chaos.s3_proxy import FaultRule, S3FaultProxy
from moc_lightning.tools.chaos.s3_server import running_s3_server

S3_RETRIES = S3RetryConfig(max_retries=4, initial_delay_s=0.1, max_delay_s=1.0)
"""``checkpoint.storage.retries`` of the trials' jobs: a burst of up to 4 failures of one request is retried, within
~2 s; an outage outlasts it."""

NETWORK_FAULTS = ("slowdown", "internal_error", "reset_upload", "reset_read", "slow", "outage")
"""What the proxy does to a trial's requests (:func:`draw_network_fault`)."""

FIRST_REQUESTS = 400
"""A network fault starts at a random one of the first this many requests it matches, so that it lands in the first
incarnation's persists (a persist of the chaos model is ~1,000 requests) or its first restore."""


def draw_network_fault(rng: random.Random) -> dict[str, Any]:
    """One network fault, as the keyword arguments of a :class:`FaultRule`."""
    kind = rng.choice(NETWORK_FAULTS)
    after = rng.randrange(FIRST_REQUESTS)
    if kind == "slowdown":
        return {"fault": "status", "status": 503, "match": "^PUT ", "times": rng.randint(1, 8), "after": after,
                "name": kind}
    if kind == "internal_error":
        return {"fault": "status", "status": 500, "match": "^(GET|PUT) ", "times": rng.randint(1, 8), "after": after,
                "name": kind}
    if kind == "reset_upload":
        return {"fault": "reset_upload", "match": "^PUT .*/c/", "times": rng.randint(1, 4), "after": after,
                "name": kind}
    if kind == "reset_read":  # reads: the manifest at every start, then a restore's objects
        return {"fault": "reset_read", "match": "^GET ", "times": rng.randint(1, 4), "after": rng.randrange(40),
                "name": kind}
    if kind == "slow":
        return {"fault": "delay", "match": "^(GET|PUT) ", "times": rng.randint(20, 100),
                "delay_s": round(rng.uniform(0.2, 1.0), 2), "after": after, "name": kind}
    target = rng.choice((r"\.metadata", "moc\\.json", r"manifest\.json"))  # outage: one control object's writes
    at_start = 1 if target == r"manifest\.json" else 0  # the job's start writes the manifest: fail a persist's commit
    return {"fault": "status", "status": 503, "match": f"^PUT .*/{target}$", "after": at_start + rng.randrange(2),
            "times": S3_RETRIES.max_retries + 1 + rng.randrange(3), "name": kind}


def network_label(rule: dict[str, Any]) -> str:
    return f"net:{rule['name']}"


@dataclass
class BucketStore:
    """The server and the proxy of a campaign of trials: a fresh bucket per trial, its network fault armed."""

    endpoint: str
    """The server's own endpoint (damage and listings go there, around the proxy)."""
    proxy: S3FaultProxy
    armed: list[FaultRule] = field(default_factory=list)

    def new_trial(self, seed: int, network: dict[str, Any] | None) -> str:
        """A fresh bucket for trial ``seed`` with ``network`` (:func:`draw_network_fault`) armed; its run's URL."""
        self.proxy.clear()
        self.armed = [self.proxy.add(FaultRule(**network))] if network is not None else []
        bucket = f"chaos-{seed}-{random.randrange(16**8):08x}"
        self._client().create_bucket(Bucket=bucket)
        return f"s3://{bucket}/ckpt"

    def fired(self) -> bool:
        """Whether the armed network fault was dealt at least once."""
        return all(rule.dealt > 0 for rule in self.armed)

    def dealt(self) -> int:
        return sum(rule.dealt for rule in self.armed)

    def damage(self, url: str, target: str, op: str, rng: random.Random) -> str:
        """Damage one object of the newest checkpoint, or the manifest, as
        :func:`~moc_lightning.tools.chaos.harness.damage` does to files; says what was done."""
        bucket, _, root = url.removeprefix("s3://").partition("/")
        client = self._client()
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/")
                for o in page.get("Contents", [])]
        key = _damage_target(keys, root, target, rng)
        if key is None or key not in keys:
            return f"no {target} object to damage under {url}"
        if op == "delete":
            client.delete_object(Bucket=bucket, Key=key)
            return f"delete {key}"
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        if op == "truncate":
            client.put_object(Bucket=bucket, Key=key, Body=bytes(data[: len(data) // 2]))
            return f"truncate {key}"
        if not data:
            return f"{key} is empty"
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        return f"flipped a bit of byte {i} of {key}"

    def _client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint)


def _damage_target(keys: list[str], root: str, target: str, rng: random.Random) -> str | None:
    """The key :meth:`BucketStore.damage` damages, chosen as the local harness chooses a file: of the newest
    checkpoint (by name, committed or not) a random chunk (``data``), its ``.metadata`` or ``moc.json``; or the
    manifest."""
    if target == "manifest":
        return f"{root}/manifest.json"
    names = (key[len(root) + 1:].split("/", 1) for key in keys)
    checkpoints = sorted({parts[0] for parts in names if len(parts) == 2 and parts[0].startswith("step_")})
    if not checkpoints:
        return None
    newest = f"{root}/{checkpoints[-1]}/"
    if target == "data":
        chunks = sorted(k for k in keys if k.startswith(newest) and "/c/" in k)
        return rng.choice(chunks) if chunks else None
    return newest + (".metadata" if target == "metadata" else "moc.json")


@contextmanager
def bucket_store() -> Iterator[BucketStore]:
    """moto's server on 127.0.0.1 (the AWS environment pointed at it, inherited by every incarnation) and the fault
    proxy in front of it, for the whole campaign."""
    with ExitStack() as stack:
        server = stack.enter_context(running_s3_server())
        proxy = S3FaultProxy(server.endpoint).start()
        stack.callback(proxy.stop)
        yield BucketStore(server.endpoint, proxy)
