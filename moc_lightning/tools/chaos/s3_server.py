"""A live S3-protocol server for the tests: moto's standalone server (``moto[server]``, in the ``dev`` extra) on
127.0.0.1, started once per test process by the ``s3_server`` fixture of ``conftest.py``.

TensorStore's ``s3`` driver talks to it over HTTP as it would to AWS, MinIO or Ceph; the fixture points the standard
AWS environment at it (``AWS_ENDPOINT_URL``, test credentials, the region), which the code under test and every
process a test starts read, as a user's job would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import boto3

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "moc-test-key", "AWS_SECRET_ACCESS_KEY": "moc-test-secret-7f3a",
    "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
}  # fmt: skip
"""Test credentials and region (both variables: the SDKs and tools differ in which they read): moto takes any keys;
these are distinctive so that a test can look for them where they must not be."""


@dataclass(frozen=True)
class S3Server:
    """The running server: its endpoint, and fresh buckets on it."""

    endpoint: str

    def new_bucket(self) -> str:
        """A new empty bucket's name (one per test, so tests never see each other's objects)."""
        name = f"moc-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_REGION"]).create_bucket(Bucket=name)
        return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_s3_server(timeout_s: float = 60.0) -> Iterator[S3Server]:
    """moto's server on a free port of 127.0.0.1 with the AWS environment pointed at it, until the block ends."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: one request per line would fill it and block the server
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log, text=True
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    try:
        _wait_until_it_answers(endpoint, server, log, timeout_s)
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        yield S3Server(endpoint)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_until_it_answers(endpoint: str, server: subprocess.Popen[str], log: IO[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"moto's S3 server exited with {server.returncode}: {log.read()[-2000:]}")
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"moto's S3 server at {endpoint} did not answer within {timeout_s} s")
