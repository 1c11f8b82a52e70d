"""Unpickling what storage and shared memory hold: only the types MoC writes there, never code.

A pickle names the callables that rebuild it, so a plain ``pickle.load`` of stored bytes runs whatever they name:
anyone who can write to the checkpoint bucket, or to the node's shared memory, could run a command in every rank of
the next restart. The checksums do not stop that (they say the bytes are as written, not who wrote them), so every
load of a stored pickle goes through an unpickler that resolves only the globals on an allow-list:

- DCP's ``.metadata`` (a plain pickle of DCP's metadata dataclasses and the storage infos of MoC's backends):
  :data:`DCP_METADATA` and torch's dtypes (:func:`load_dcp_metadata`);
- ``torch.save``'d values (the trainer state of a slot or a persist, DCP's bytes items, a replay window's tail):
  :data:`TORCH_SAVED` (tensors, containers, torch's dtypes, NumPy arrays of numbers), what the caller adds, and what
  the user allowed with ``torch.serialization.add_safe_globals`` (:func:`load_torch_saved`).

The allow-list is checked where the unpickler resolves a name (``find_class``), so nothing it does not list is ever
imported or called; the unpickler is still C's, which matters for a window's tail, read at every replay resume (torch's
weights-only unpickler, in Python, read a tail of 960 regions in 94 ms against 3.3 ms). A refused pickle raises
:class:`UntrustedPickle` naming the object and the global.
"""

from __future__ import annotations

import _pickle
import functools
import io
import types
from collections.abc import Iterable
from typing import IO, Any

import torch

Global = tuple[str, str]
"""A global as a pickle names it: ``(module, name)``."""

DCP_METADATA: frozenset[Global] = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # DCP's own file writer
        ("moc_lightning.storage.filesystem", "ChecksummedStorageInfo"),
        ("moc_lightning.storage.zarr_dcp", "ArrayRef"),
        ("moc_lightning.storage.zarr_dcp", "BlobRef"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
    }
)  # fmt: skip
"""The globals a ``.metadata`` written by DCP through MoC's backends names, besides torch's dtypes."""

TORCH_SAVED: frozenset[Global] = frozenset(
    {("torch._utils", name) for name in (
        "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
        "_rebuild_parameter_with_state")}
    | {(module, name) for module in ("builtins", "__builtin__") for name in ("set", "frozenset", "bytearray", "complex")}
    | {
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),  # bytes, as protocol 2 writes them
        ("torch", "Size"),
        ("torch", "device"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),  # NumPy 1
        ("numpy._core.multiarray", "_reconstruct"),  # NumPy 2
    }
)  # fmt: skip
"""The globals of a ``torch.save`` of tensors, parameters, containers and NumPy arrays (the NumPy RNG state in every
rank's trainer state), besides torch's dtypes: the rebuild functions torch's weights-only unpickler allows for them."""


class UntrustedPickle(ValueError):
    """Stored bytes that name a global MoC does not write there: refused before anything they name runs."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: refused to unpickle it, {detail}")
        self.what = what


class _Refused(Exception):
    """Raised by a restricted unpickler's ``find_class``; its caller, which knows what it was loading, turns it into
    :class:`UntrustedPickle` naming the object (the unpickler class is built once per allow-list, not per object)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.name = f"{module}.{name}"


def _restricted(allowed: frozenset[Global]) -> type[_pickle.Unpickler]:
    """C's unpickler, resolving only ``allowed`` and torch's dtypes; any other global raises :class:`_Refused`.

    ``_pickle``'s, not ``pickle.Unpickler``: Lightning swaps a pure-Python one in for the latter while it loads a
    ``ckpt_path`` (``pl_legacy_patch``), where a replay resume reads its window."""

    class Restricted(_pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if dtype or (module, name) in allowed:
                return super().find_class(module, name)
            raise _Refused(module, name)

    return Restricted


_DCP_METADATA_UNPICKLER = _restricted(DCP_METADATA)
_DCP_HINT = "which is not one of DCP's metadata classes"
_TORCH_SAVED_HINT = (
    "which MoC does not write there (a type of your own in a callback's or datamodule's state: allow it with "
    "torch.serialization.add_safe_globals)"
)


def load_dcp_metadata(data: bytes, what: str) -> Any:
    """Unpickle a ``.metadata`` body; ``what`` names it in a refusal."""
    try:
        return _DCP_METADATA_UNPICKLER(io.BytesIO(data)).load()
    except _Refused as refused:
        raise UntrustedPickle(what, f"it names {refused.name}, {_DCP_HINT}") from None


def load_torch_saved(data: IO[bytes], what: str, allowed: Iterable[type] = ()) -> Any:
    """``torch.load`` of ``data`` resolving only :data:`TORCH_SAVED`, the classes ``allowed`` (a pickle of MoC's
    holds them) and the user's ``torch.serialization.add_safe_globals``; ``what`` names the object in a refusal."""
    names = TORCH_SAVED | {_name(c) for c in allowed} | {_name(g) for g in torch.serialization.get_safe_globals()}
    try:  # weights_only: see the module's docstring
        return torch.load(data, weights_only=False, pickle_module=_pickle_module(frozenset(names)))
    except _Refused as refused:
        raise UntrustedPickle(what, f"it names {refused.name}, {_TORCH_SAVED_HINT}") from None


@functools.lru_cache(maxsize=16)
def _pickle_module(allowed: frozenset[Global]) -> types.SimpleNamespace:
    """The ``pickle_module`` ``torch.load`` takes, whose unpickler resolves only ``allowed``: built once per allow-list
    (a window's tail is read at every replay resume, a DCP bytes item at every load), keyed by its names so that a
    later ``add_safe_globals`` gets an unpickler of its own."""
    return types.SimpleNamespace(__name__="moc_restricted_pickle", Unpickler=_restricted(allowed))


def _name(allowed: Any) -> Global:
    """``(module, name)`` of a class or function, or of an ``(object, "module.name")`` pair of ``add_safe_globals``."""
    if isinstance(allowed, tuple):
        module, _, name = allowed[1].rpartition(".")
        return module, name
    return allowed.__module__, allowed.__qualname__
