"""Turning ``checkpoint.storage.url`` into a place: a local directory, or a URL for TensorStore.

Both backends accept a plain path or a ``file://`` URL for local (or shared, mounted) file systems; only
``tensorstore`` accepts other schemes (``gs://``, ``s3://``, ...). Errors name the option, since a bad
URL is a configuration mistake the user fixes in Hydra.

``s3://bucket/path`` is S3 or any S3-compatible store (MinIO, Ceph, R2, ...): the endpoint is
``checkpoint.storage.endpoint`` or, when that is empty, the standard AWS environment, as boto3 and the AWS CLI read
it; region and credentials always come from that environment (:func:`s3_spec`). TensorStore's own ``s3://`` URL form
ignores ``AWS_ENDPOINT_URL``, and where the endpoint does not answer its open waits forever, so the endpoint is asked
once, with a bounded wait, before the first open (:func:`check_endpoint`).
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, unquote, urlparse

import tensorstore as ts

URL_OPTION = "checkpoint.storage.url"
ENDPOINT_OPTION = "checkpoint.storage.endpoint"
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Where an S3-compatible store's endpoint is named, most specific first (the AWS SDKs' order)."""
REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")
DEFAULT_REGION = "us-east-1"
ENDPOINT_TIMEOUT_S = 10.0
"""How long :func:`check_endpoint` waits for the endpoint's answer before it fails."""
RETRIES_OPTION = "checkpoint.storage.retries"
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
"""Where TensorStore's default AWS chain finds the keys (then ``~/.aws/credentials``, then the instance's role)."""
REFUSED_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
    "AccessDenied", "AllAccessDisabled", "InvalidSecurity", "RequestExpired",
})  # fmt: skip
"""S3 error codes that mean the store refused the request's credentials (AWS's own list; MinIO and Ceph send the
same)."""
RETRIES_METRIC = "/tensorstore/kvstore/s3/retries"
"""TensorStore's process-wide count of retried S3 requests (reads, writes, deletes, lists)."""
STALL_VARIABLES = ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES")
"""How TensorStore's HTTP transport is told to abort a transfer that moves under LIMIT bytes a second for TIME
seconds (curl's low-speed watchdog): it reads them once per process, when it makes its first HTTP request, and sets
no timeout of its own (google/tensorstore#291)."""
PROBE_KEY = ".moc-access-probe"
"""The key :func:`open_kvstore` reads once per bucket to learn whether the store takes the credentials: it is never
written, so the store answers "not found" to good credentials and "refused" to bad ones."""


def local_path(url: str) -> Path | None:
    """The absolute local path a plain path or ``file://`` URL names; ``None`` for any other scheme."""
    if not url:
        raise ValueError(f"{URL_OPTION} is empty; give a directory path or a URL such as file:///scratch/run/ckpt")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(
                f"{URL_OPTION}={url!r} names host {parsed.netloc!r}; a file URL needs an absolute path "
                "(file:///abs/path, three slashes)"
            )
        return Path(unquote(parsed.path))
    if "://" in url:  # another kvstore's URL (gs://, s3://, memory://); anything else is a path
        return None
    return Path(url).expanduser().resolve()


def open_local_dir(url: str) -> Path:
    """The local root directory of ``url``, created if missing, so a bad path fails at start-up, not at persist."""
    path = local_path(url)
    if path is None:
        raise ValueError(
            f"{URL_OPTION}={url!r} is not a local path or file:// URL; the filesystem backend needs one "
            "(set checkpoint.storage.backend=tensorstore for object stores such as gs:// or s3://)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{URL_OPTION}={url!r}: cannot create directory {path}: {err}") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{URL_OPTION}={url!r}: directory {path} is not writable")
    return path


def kvstore_spec(url: str, endpoint: str = "") -> str | dict[str, Any]:
    """The TensorStore kvstore spec for a storage root: a ``file`` spec for local paths, an ``s3`` spec for
    ``s3://`` (:func:`s3_spec`; ``endpoint``: ``checkpoint.storage.endpoint``), else the URL itself.

    Local paths become a JSON spec rather than a ``file://`` URL so that characters TensorStore would
    percent-decode (``%``, spaces) stay as they are. The trailing ``/`` makes keys children of the root.
    """
    if urlparse(url).scheme == "s3":
        return s3_spec(url, endpoint)
    if endpoint:
        raise ValueError(
            f"{ENDPOINT_OPTION}={endpoint!r} names an S3-compatible store, but {URL_OPTION}={url!r} is not an s3:// "
            f"URL; give {URL_OPTION}=s3://BUCKET/path or leave {ENDPOINT_OPTION} empty"
        )
    path = local_path(url)
    if path is not None:
        return {"driver": "file", "path": f"{path}/"}
    return url if url.endswith("/") else f"{url}/"


def s3_spec(url: str, endpoint: str = "") -> dict[str, Any]:
    """The ``s3`` kvstore spec of ``s3://bucket/path``: the endpoint of :func:`s3_endpoint` (none: AWS itself), the
    region from ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, the credentials from TensorStore's default AWS chain (the
    environment's keys, then the shared files and profile, then the instance's metadata). The spec names the chain,
    never a key, so it may be logged and recorded."""
    bucket, path = _bucket_and_path(url)
    spec: dict[str, Any] = {
        "driver": "s3",
        "bucket": bucket,
        "path": path if not path or path.endswith("/") else f"{path}/",
        "aws_region": s3_region(),
        "aws_credentials": {"type": "default"},
    }
    named = s3_endpoint(endpoint)
    if named is not None:
        spec["endpoint"] = named.url
    return spec


@dataclass(frozen=True)
class Endpoint:
    """An S3-compatible store's endpoint and the option or variable that named it, which an error must name too."""

    url: str
    """``http(s)://host[:port]``, no trailing slash."""
    source: str
    """``checkpoint.storage.endpoint`` or the environment variable it came from."""


def s3_endpoint(endpoint: str = "") -> Endpoint | None:
    """The endpoint of an ``s3://`` root: ``endpoint`` (``checkpoint.storage.endpoint``) if given, else
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, as the AWS SDKs read them; ``None`` for AWS itself."""
    if endpoint:
        return Endpoint(parse_endpoint(endpoint, ENDPOINT_OPTION), ENDPOINT_OPTION)
    found = _first_set(ENDPOINT_VARIABLES)
    if found is None:
        return None
    variable, value = found
    return Endpoint(parse_endpoint(value, variable), variable)


def parse_endpoint(endpoint: str, source: str) -> str:
    """``endpoint`` checked to be ``http(s)://host[:port]`` (an optional trailing ``/`` dropped), else an error naming
    ``source``. A URL with a user or password is refused without being repeated: keys belong in the AWS
    environment, where nothing prints them."""
    parsed = urlparse(endpoint)
    if "@" in parsed.netloc:
        raise ValueError(
            f"{source} holds credentials in its URL (not repeated here); give http(s)://host[:port] and the keys in "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile)"
        )
    if not _is_host_and_port(parsed):
        raise ValueError(
            f"{source}={endpoint!r} is not an endpoint; give http(s)://host[:port], e.g. http://minio.cluster:9000"
        )
    return f"{parsed.scheme}://{parsed.netloc}"


def _is_host_and_port(parsed: ParseResult) -> bool:
    """Whether ``parsed`` is ``http(s)://host[:port]`` with nothing after it but a ``/``; a port that is not a number
    (reading it raises) is not."""
    try:
        parsed.port
    except ValueError:
        return False
    return (
        parsed.scheme in ("http", "https")
        and bool(parsed.hostname)
        and parsed.path in ("", "/")
        and not (parsed.params or parsed.query or parsed.fragment)
    )


def check_endpoint(url: str, endpoint: str = "", timeout_s: float | None = None) -> None:
    """For an ``s3://`` root, ask its endpoint (:func:`s3_endpoint`; AWS's regional host when none is named) for the
    bucket once and wait at most ``timeout_s``: any HTTP answer (even 403 or 404: TensorStore reports those itself,
    naming the object) shows a live store; none is one error naming the endpoint and the option or variable that
    named it, where TensorStore's open would wait forever. ``timeout_s``: :data:`ENDPOINT_TIMEOUT_S` unless given.
    The request carries no credentials."""
    if urlparse(url).scheme != "s3":
        return
    timeout_s = ENDPOINT_TIMEOUT_S if timeout_s is None else timeout_s
    bucket, _ = _bucket_and_path(url)
    named = s3_endpoint(endpoint)
    address = named.url if named is not None else f"https://s3.{s3_region()}.amazonaws.com"
    if (address, bucket) in _ANSWERED:
        return  # every reader and writer opens the root again: ask once per process
    request = urllib.request.Request(f"{address}/{bucket}", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except (OSError, ValueError) as err:
        where = f"{address} (from {named.source})" if named is not None else f"{address} (AWS: no endpoint named)"
        raise ValueError(
            f"{URL_OPTION}={url!r}: the S3 endpoint {where} did not answer within {timeout_s:g} s "
            f"({getattr(err, 'reason', err)}); start the store there, or name the one to use with {ENDPOINT_OPTION} "
            f"or {' / '.join(reversed(ENDPOINT_VARIABLES))}"
        ) from None
    _ANSWERED.add((address, bucket))


def kvstore_url(kvstore: ts.KvStore) -> str:
    """The URL of an open kvstore, for messages and DCP's checkpoint id. TensorStore has none for an ``s3`` spec with
    an endpoint: ``s3://bucket/path`` then, which :func:`kvstore_spec` turns back into the same spec, given the same
    endpoint."""
    try:
        return kvstore.url
    except NotImplementedError:
        spec = kvstore.spec().to_json()
        return f"s3://{spec['bucket']}/{spec.get('path', '')}"


_ANSWERED: set[tuple[str, str]] = set()
"""The ``(endpoint, bucket)`` pairs that answered :func:`check_endpoint` in this process."""


def _first_set(variables: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``variables`` set to a non-empty value in the environment, and that value: an error must name
    the variable a value came from."""
    for variable in variables:
        value = os.environ.get(variable)
        if value:
            return variable, value
    return None


def s3_region() -> str:
    """The region from ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, else :data:`DEFAULT_REGION`."""
    found = _first_set(REGION_VARIABLES)
    return found[1] if found is not None else DEFAULT_REGION


def _bucket_and_path(url: str) -> tuple[str, str]:
    """The bucket and the path inside it (no leading ``/``) of ``s3://bucket/path``; an error naming the option when
    it names no bucket."""
    parsed = urlparse(url)
    if not parsed.netloc:
        raise ValueError(f"{URL_OPTION}={url!r} names no bucket; give s3://BUCKET/path")
    return parsed.netloc, parsed.path.lstrip("/")


def open_kvstore(url: str, context: ts.Context, endpoint: str = "") -> ts.KvStore:
    """Open the kvstore ``url`` names (``file://``, ``gs://``, ``s3://``, ``memory://``, ...); ``endpoint``:
    ``checkpoint.storage.endpoint``, for ``s3://`` only. An ``s3://`` root is checked once per process and bucket
    before it is used: the endpoint answers (:func:`check_endpoint`), and the store takes the credentials (one read
    of :data:`PROBE_KEY`; a refusal is one error naming the options and :data:`CREDENTIAL_VARIABLES`)."""
    spec = kvstore_spec(url, endpoint)  # a bad URL or endpoint fails first, in its own words
    check_endpoint(url, endpoint)
    try:
        kvstore = ts.KvStore.open(spec, context=context).result()
    except ValueError as err:
        raise ValueError(
            f"{URL_OPTION}={url!r} cannot be opened as a TensorStore kvstore "
            f"(a path, or a URL such as file:///abs/path, gs://bucket/path, s3://bucket/path): {err}"
        ) from err
    if isinstance(spec, dict) and spec["driver"] == "s3" and (spec.get("endpoint"), spec["bucket"]) not in _ADMITTED:
        with s3_errors_named(f"{URL_OPTION}={url!r}", endpoint, "the first request"):
            kvstore.read(PROBE_KEY).result()
        _ADMITTED.add((spec.get("endpoint"), spec["bucket"]))
    return kvstore


_ADMITTED: set[tuple[str | None, str]] = set()
"""The ``(endpoint, bucket)`` pairs whose store took this process's credentials (:func:`open_kvstore`)."""


@dataclass
class S3RetryConfig:
    """How an S3 request is retried (``checkpoint.storage.retries``): TensorStore's ``s3_request_retries``, set
    explicitly because its default (32 retries, backoff from 1 s to 32 s) keeps a persist waiting ~17 minutes on a
    store that stays down. TensorStore retries an answer 408, 429, 500, 502, 503 or 504, an S3 error code of
    throttling or an internal error (``SlowDown``, ``InternalError``, ...), and a connection that fails (reset mid-
    upload or mid-read, refused, timed out); it counts each retry (:func:`s3_request_retries`). Any other answer
    (403, 404, ...) is final at once."""

    max_retries: int = 8
    """Tries after the first; the request fails after this many retries all failed (0: no retry)."""
    initial_delay_s: float = 0.5
    """Backoff before the first retry, in seconds; doubled before each next one (plus up to min(1 s, this) of
    jitter)."""
    max_delay_s: float = 8.0
    """Longest backoff before a retry, in seconds. With the defaults a request gives up after ~40 s of backoff."""
    stall_timeout_s: int = 30
    """A request whose transfer moves less than a byte a second for this many seconds (a store or a connection gone
    silent mid-request) is aborted and retried as a reset one is; 0: never (TensorStore's default, under which such a
    request waits until the operating system drops the connection, tens of minutes). Process-wide: the first
    ``s3://`` store a process opens sets it (:func:`apply_stall_timeout`)."""

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"{RETRIES_OPTION}.max_retries={self.max_retries} is not allowed; give an integer >= 0")
        if not self.initial_delay_s > 0:
            raise ValueError(
                f"{RETRIES_OPTION}.initial_delay_s={self.initial_delay_s} is not allowed; give seconds > 0"
            )
        if not self.max_delay_s >= self.initial_delay_s:
            raise ValueError(
                f"{RETRIES_OPTION}.max_delay_s={self.max_delay_s} is not allowed; give seconds >= initial_delay_s="
                f"{self.initial_delay_s}"
            )
        if isinstance(self.stall_timeout_s, bool) or not isinstance(self.stall_timeout_s, int) \
                or self.stall_timeout_s < 0:
            raise ValueError(f"{RETRIES_OPTION}.stall_timeout_s={self.stall_timeout_s!r} is not allowed; give whole "
                             "seconds >= 0 (0: no bound)")

    def context_spec(self) -> dict[str, Any]:
        """The TensorStore context resources of these bounds."""
        return {
            "s3_request_retries": {
                "max_retries": self.max_retries,
                "initial_delay": f"{self.initial_delay_s}s",
                "max_delay": f"{self.max_delay_s}s",
            }
        }

    def describe(self) -> str:
        """The bounds as an operator reads them in a message."""
        stall = f"{self.stall_timeout_s} s" if self.stall_timeout_s else "no bound"
        return (f"{RETRIES_OPTION}: max_retries={self.max_retries}, backoff {self.initial_delay_s:g} s doubling "
                f"to {self.max_delay_s:g} s, a silent request aborted after {stall}")


def apply_stall_timeout(retries: S3RetryConfig) -> None:
    """Set :data:`STALL_VARIABLES` for ``retries.stall_timeout_s`` in this process, before TensorStore's first HTTP
    request reads them; variables an operator set already are kept (they are what the transport may already use)."""
    if retries.stall_timeout_s == 0:
        return
    os.environ.setdefault(STALL_VARIABLES[0], str(retries.stall_timeout_s))
    os.environ.setdefault(STALL_VARIABLES[1], "1")


def s3_request_retries() -> int:
    """How many S3 requests TensorStore has retried in this process so far (its :data:`RETRIES_METRIC` counter)."""
    found = ts.experimental_collect_matching_metrics(RETRIES_METRIC, include_zero_metrics=True)
    return sum(int(v.get("value", 0)) for metric in found for v in metric["values"])


@contextlib.contextmanager
def s3_errors_named(where: str, endpoint: str, what: str) -> Iterator[None]:
    """Re-raise TensorStore's error of a request to the store that the operator must act on as one error naming
    ``where`` (``checkpoint.storage.url=...``, or a checkpoint's URL), the options, and ``what`` (the object or
    operation):

    - credentials the store refused (:data:`REFUSED_CREDENTIAL_CODES`, or a 401/403): the options and
      :data:`CREDENTIAL_VARIABLES`, the S3 error code, never the store's answer (AWS repeats the access key id and the
      string it signed there);
    - a request whose retries all failed: the retry bounds and the last answer.

    Other errors pass unchanged (a missing object, damage: their callers tell those apart)."""
    try:
        yield
    except ValueError as err:
        text = str(err)
        code = _s3_error_code(text)
        if code in REFUSED_CREDENTIAL_CODES or text.startswith(("PERMISSION_DENIED", "UNAUTHENTICATED")):
            named = s3_endpoint(endpoint)
            store = f"the store at {named.url} (from {named.source})" if named is not None else "AWS S3"
            raise ValueError(
                f"{where}: {store} refused the credentials for {what} ({code or text.split(':', 1)[0]}); check "
                f"{', '.join(CREDENTIAL_VARIABLES)} (or ~/.aws/credentials, the instance's role) and that {URL_OPTION} "
                f"and {ENDPOINT_OPTION} name the store they belong to"
            ) from None
        if _RETRIES_EXHAUSTED.search(text):
            raise ValueError(
                f"{where}: {what} failed after every retry ({RETRIES_OPTION}.max_retries): {_without_payloads(text)}"
            ) from None
        raise


_RETRIES_EXHAUSTED = re.compile(r"All \d+ retry attempts failed")
_AWS_CODE = re.compile(r"\b([A-Z][A-Za-z]+): ")
_PAYLOAD = re.compile(r" \[[a-z_-]+='.*?'\](?= \[|$)", re.DOTALL)


def _s3_error_code(text: str) -> str | None:
    """The S3 error code TensorStore puts in its message (``PERMISSION_DENIED: InvalidAccessKeyId: ...``)."""
    codes = [c for c in _AWS_CODE.findall(text.split(" [", 1)[0]) if not c.isupper()]
    return codes[-1] if codes else None


def _without_payloads(text: str) -> str:
    """TensorStore's message without the payloads it appends (the store's whole answer, its request id)."""
    return _PAYLOAD.sub("", text)
