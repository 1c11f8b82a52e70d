"""A fault-injecting HTTP proxy in front of an S3-protocol server, for the tests and the chaos trials (issue 31).

It listens on 127.0.0.1, forwards every request to the server (moto, :mod:`~moc_lightning.tools.chaos.s3_server`)
and answers as the server did, except where a :class:`FaultRule` matches the request. Faults are what a store and the
network between do to a client:

- ``status``: an S3 error answer instead of the server's (``503 SlowDown``, ``500 InternalError``), body drained;
- ``delay``: the request forwarded after a pause (a slow store);
- ``reset_upload``: half of the request's body read, then the connection reset (RST), nothing forwarded;
- ``reset_read``: the server's answer sent up to half of its body, then the connection reset;
- ``stall``: the request forwarded, then the connection silent for ``delay_s`` (after the answer's head and half its
  body, where it has one), then reset: a store or a network that stops moving bytes mid-request;
- ``expired``: ``400 ExpiredToken``, as for a session token past its expiry.

A proxy given ``accepted_key_id`` answers ``403 InvalidAccessKeyId`` to a request signed with another access key id
(a wrong credential; moto itself accepts any). Every fault dealt is recorded (:attr:`S3FaultProxy.injections`) so that
a test can assert it fired: a test whose fault never fired tested nothing. Standard library only: the tests and the
chaos harness start it in their own process, beside the server it fronts.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

FAULTS = ("status", "delay", "reset_upload", "reset_read", "stall", "expired")
"""What a rule does to the requests it matches (module docstring)."""

S3_ERRORS = {500: "InternalError", 503: "SlowDown"}
"""The S3 error code a ``status`` fault answers with, by HTTP status (what AWS sends for each)."""

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"})
"""Headers of one connection, not of the request: the proxy's own connections set their own."""

POLL_S = 0.05
"""How often the serving thread looks whether :meth:`S3FaultProxy.stop` was called (its stop waits up to this)."""

CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
"""The access key id in a SigV4 ``Authorization`` header (never the secret: a signature does not carry it)."""


@dataclass
class FaultRule:
    """Deal ``fault`` to requests whose ``METHOD /bucket/key`` (key unquoted, query dropped) matches ``match``."""

    fault: str
    """One of :data:`FAULTS`."""
    match: str = ""
    """A regular expression searched in ``"METHOD /bucket/key"`` (``^PUT .*/\\.metadata$``); empty: every request."""
    times: int | None = 1
    """How many matching requests get the fault; ``None``: every one, until the rule is removed."""
    after: int = 0
    """Matching requests let through untouched before the first fault (the fault lands mid-run, not on the first)."""
    status: int = 503
    """``status`` faults: the HTTP status (a key of :data:`S3_ERRORS`)."""
    delay_s: float = 0.5
    """``delay`` faults: seconds before the request is forwarded; ``stall`` faults: seconds the connection stays
    silent before it is reset."""
    name: str = ""
    """What the rule is called in :attr:`S3FaultProxy.injections` (default: the fault's name)."""
    seen: int = field(default=0, init=False)
    """Matching requests so far."""
    dealt: int = field(default=0, init=False)
    """Faults dealt so far."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r} is not allowed; choose one of: {', '.join(FAULTS)}")
        if self.fault == "status" and self.status not in S3_ERRORS:
            raise ValueError(f"status={self.status} is not allowed; choose one of: {', '.join(map(str, S3_ERRORS))}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"times={self.times} is not allowed; give an integer >= 1, or None for every request")
        self.pattern = re.compile(self.match)
        self.name = self.name or self.fault

    def claims(self, request: str) -> bool:
        """Whether this rule deals its fault to ``request`` (``"METHOD /path"``); counts it either way."""
        if not self.pattern.search(request):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and self.dealt >= self.times):
            return False
        self.dealt += 1
        return True


@dataclass(frozen=True)
class Injection:
    """One fault dealt: which rule, to which request, when (``time.monotonic()``)."""

    rule: str
    request: str
    at: float


@dataclass
class S3FaultProxy:
    """The proxy: :meth:`start` it, point the S3 client at :attr:`endpoint`, :meth:`add` rules, read
    :attr:`injections`, :meth:`stop` it."""

    upstream: str
    """The server's endpoint, ``http://host:port``."""
    accepted_key_id: str | None = None
    """When set, a request signed with another access key id is answered ``403 InvalidAccessKeyId``."""
    rules: list[FaultRule] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    requests: int = 0
    """Requests received, faulted or not."""

    def __post_init__(self) -> None:
        parsed = urlparse(self.upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"upstream={self.upstream!r} is not allowed; give http://host:port")
        self._upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        """Where clients connect: ``http://127.0.0.1:<port>``."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> S3FaultProxy:
        """Listen on a free port of 127.0.0.1 and serve on a daemon thread."""
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(POLL_S,), name="s3-fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening (connections in progress end with their clients)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def add(self, rule: FaultRule) -> FaultRule:
        """Add ``rule`` (rules are tried in the order added; the first that claims a request deals its fault)."""
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and forget what was dealt and seen; the key check stays."""
        with self._lock:
            self.rules.clear()
            self.injections.clear()
            self.requests = 0

    def dealt(self, name: str) -> list[Injection]:
        """The faults rule ``name`` dealt so far."""
        with self._lock:
            return [i for i in self.injections if i.rule == name]

    def _decide(self, request: str, authorization: str) -> FaultRule | None:
        """The rule that faults ``request``, if any, recorded; a wrong key is a ``deny`` of its own."""
        with self._lock:
            self.requests += 1
            key_id = CREDENTIAL.search(authorization)
            if self.accepted_key_id is not None and (key_id is None or key_id[1] != self.accepted_key_id):
                self.injections.append(Injection("wrong_key", request, time.monotonic()))
                return _WRONG_KEY
            rule = next((r for r in self.rules if r.claims(request)), None)
            if rule is not None:
                self.injections.append(Injection(rule.name, request, time.monotonic()))
            return rule


_WRONG_KEY = FaultRule("status", name="wrong_key", times=None)
"""The answer to a request signed with a key the proxy does not accept (see :class:`_ProxyHandler`)."""


class _ProxyHandler(BaseHTTPRequestHandler):
    """One client connection: requests forwarded over one upstream connection of its own (keep-alive both ways)."""

    protocol_version = "HTTP/1.1"
    owner: S3FaultProxy
    upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a persist is hundreds of requests."""

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        parsed = urlparse(self.path)
        request = f"{self.command} {unquote(parsed.path)}"
        rule = self.owner._decide(request, self.headers.get("Authorization", ""))
        length = int(self.headers.get("Content-Length") or 0)
        if rule is not None and rule.fault == "reset_upload":
            self.rfile.read(length // 2)
            self._reset()
            return
        body = self.rfile.read(length) if length else b""
        if rule is _WRONG_KEY:
            self._error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.")
            return
        if rule is not None and rule.fault == "status":
            self._error(rule.status, S3_ERRORS[rule.status], "Injected by the fault proxy.")
            return
        if rule is not None and rule.fault == "expired":
            self._error(400, "ExpiredToken", "The provided token has expired.")
            return
        if rule is not None and rule.fault == "delay":
            time.sleep(rule.delay_s)
        status, reason, headers, answer = self._forward(body)
        if rule is not None and rule.fault == "stall" and not answer:  # an upload's answer: held back whole
            self._stall(rule.delay_s)
            return
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        declared = dict((n.lower(), v) for n, v in headers).get("content-length")
        self.send_header("Content-Length", declared if self.command == "HEAD" and declared else str(len(answer)))
        self.end_headers()
        if rule is not None and rule.fault == "reset_read" and answer:
            self.wfile.write(answer[: len(answer) // 2])
            time.sleep(0.05)  # let the client take the first half before the reset discards what is unsent
            self._reset()
            return
        if rule is not None and rule.fault == "stall":
            self.wfile.write(answer[: len(answer) // 2])
            self._stall(rule.delay_s)
            return
        if self.command != "HEAD":
            self.wfile.write(answer)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request upstream as received (the signed ``Host`` included); the whole answer."""
        for attempt in (1, 2):  # the server may have closed an idle keep-alive connection: one fresh try
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(*self.owner._upstream, timeout=120)
            try:
                self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "expect":
                        self.upstream.putheader(name, value)
                self.upstream.endheaders(body or None)
                response = self.upstream.getresponse()
                answer = response.read()
                return response.status, response.reason, response.getheaders(), answer
            except (ConnectionError, http.client.HTTPException):
                self.upstream.close()
                self.upstream = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _error(self, status: int, code: str, message: str) -> None:
        """An S3 error answer (the XML body AWS sends), on a connection that stays open."""
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                f"<RequestId>moc-fault-proxy</RequestId></Error>").encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _stall(self, seconds: float) -> None:
        """Send nothing more for ``seconds``, then reset the connection (if the client has not given up on it)."""
        self.wfile.flush()
        time.sleep(seconds)
        self._reset()

    def _reset(self) -> None:
        """Reset the client's connection (RST, not FIN): what a dropped connection looks like to it."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # a connection this handler reset
        if self.upstream is not None:
            self.upstream.close()
