"""Turning ``checkpoint.storage.url`` into a place: a local directory, or a URL for TensorStore.

Both backends accept a plain path or a ``file://`` URL for local (or shared, mounted) file systems; only
``tensorstore`` accepts other schemes (``gs://``, ``s3://``, ...). Errors name the option, since a bad
URL is a configuration mistake the user fixes in Hydra.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import tensorstore as ts

URL_OPTION = "checkpoint.storage.url"


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


def kvstore_spec(url: str) -> str | dict[str, str]:
    """The TensorStore kvstore spec for a storage root: a ``file`` spec for local paths, else the URL itself.

    Local paths become a JSON spec rather than a ``file://`` URL so that characters TensorStore would
    percent-decode (``%``, spaces) stay as they are. The trailing ``/`` makes keys children of the root.
    """
    path = local_path(url)
    if path is not None:
        return {"driver": "file", "path": f"{path}/"}
    return url if url.endswith("/") else f"{url}/"


def open_kvstore(url: str, context: ts.Context) -> ts.KvStore:
    """Open the kvstore ``url`` names (``file://``, ``gs://``, ``s3://``, ``memory://``, ...)."""
    try:
        return ts.KvStore.open(kvstore_spec(url), context=context).result()
    except ValueError as err:
        raise ValueError(
            f"{URL_OPTION}={url!r} cannot be opened as a TensorStore kvstore "
            f"(a path, or a URL such as file:///abs/path, gs://bucket/path, s3://bucket/path): {err}"
        ) from err
