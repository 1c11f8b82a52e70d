"""One tensor chunk as one zarr v3 array through TensorStore: dtypes, chunk grid, write, region read.

Arrays are plain zarr v3 (regular chunk grid, ``bytes`` then ``crc32c`` codec, no compression) so
zarr-python 3 and any other zarr v3 reader open them without this package. bfloat16 is the zarr-extensions
``bfloat16`` data type: TensorStore reads it natively; zarr-python 3.1 needs it registered first (a few
lines over ``ml_dtypes``, as ``tests/test_storage.py`` shows).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorstore as ts
import torch

ZARR_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
"""Tensor dtypes a checkpoint can hold, by their zarr v3 ``data_type`` name."""

CODECS: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
"""Raw little-endian bytes followed by their CRC32C in every zarr chunk: TensorStore verifies it on every read,
partial (resharded) reads included, which a checksum of the whole array could not offer without reading it all."""

TARGET_CHUNK_BYTES = 64 << 20
"""Bytes per zarr chunk (one object in the kvstore): big enough that object stores see few, large
requests; small enough that a resharded load reading a few rows does not fetch a whole expert stack."""


def zarr_dtype(dtype: torch.dtype) -> str:
    """The zarr v3 name of ``dtype``; other dtypes are refused before anything is written."""
    try:
        return ZARR_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in ZARR_DTYPES)
        raise TypeError(f"the tensorstore storage backend cannot store {dtype}; it stores: {allowed}") from None


def chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Whole trailing dimensions and as many leading rows as fit ``TARGET_CHUNK_BYTES`` (at least one).

    Splitting only along dim 0 matches how DCP and the MoC planner split tensors, so a resharded read
    of a row range touches only the chunks holding those rows.
    """
    if not shape:
        return []
    dims = [max(1, d) for d in shape]
    row_bytes = math.prod(dims[1:]) * itemsize
    dims[0] = max(1, min(dims[0], TARGET_CHUNK_BYTES // row_bytes))
    return dims


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy view of ``tensor`` (bfloat16 reinterpreted as TensorStore's numpy bfloat16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ts.bfloat16.numpy_dtype)
    return tensor.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """The inverse of ``to_numpy``."""
    if array.dtype == ts.bfloat16.numpy_dtype:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def open_new_array(kvstore: ts.KvStore, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> ts.Future:
    """Start creating the array at ``key/``, replacing what a failed earlier attempt left there."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "metadata": {
            "shape": list(shape),
            "data_type": zarr_dtype(dtype),
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": chunk_shape(shape, dtype.itemsize)},
            },
            "codecs": CODECS,
        },
    }
    return ts.open(spec, kvstore=kvstore / f"{key}/", create=True, delete_existing=True)


def open_array(kvstore: ts.KvStore, key: str) -> ts.Future:
    """Start opening the existing array at ``key/``; reading a missing zarr chunk fails rather than give fill values."""
    return ts.open({"driver": "zarr3", "fill_missing_data_reads": False}, kvstore=kvstore / f"{key}/", open=True)


def region(offsets: torch.Size, lengths: torch.Size) -> tuple[slice, ...]:
    """The index expression for the box ``offsets`` + ``lengths`` (empty for a 0-dim array)."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
