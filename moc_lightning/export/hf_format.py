"""Hugging Face's own checkpoint format: what a run records for it and what ``moc-consolidate --format hf`` writes.

A user who trains a ``transformers`` model wraps it in a ``LightningModule`` (``self.model = ...``), so every
parameter and buffer name MoC sees carries that attribute path (``model.``), and the model's config is not a
tensor at all. To hand the result back to the model's own tools, a run records in every checkpoint's
``moc.json`` (:func:`describe_model`) where the ``PreTrainedModel`` sits inside the module, its class and its
config; consolidation strips that prefix and writes the directory ``from_pretrained`` reads: safetensors
shards of at most ``--max-shard-size`` bytes, ``model.safetensors.index.json`` mapping every name to its
shard, and ``config.json`` when the run recorded one (:func:`write_hf`).

Nothing here imports ``transformers``: a module that wraps a ``PreTrainedModel`` was built by code that
imported it already (it is looked up in ``sys.modules``), and writing needs only ``safetensors``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""``save_pretrained``'s default shard size."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


class HFFormatError(ValueError):
    """An option of the ``hf`` format that cannot be used as given; the message names it and what is allowed."""


def describe_model(module: nn.Module) -> dict[str, Any] | None:
    """Where a ``transformers.PreTrainedModel`` sits inside ``module``, its class and config; ``None`` if none does.

    The first such submodule in ``named_modules()`` order is the model (an outer ``PreTrainedModel`` holds
    its inner ones). The config is taken as ``save_pretrained`` writes it, so it is plain JSON.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    for path, sub in module.named_modules():
        if isinstance(sub, transformers.PreTrainedModel):
            config = json.loads(sub.config.to_json_string(use_diff=False))
            config["architectures"] = [type(sub).__name__]
            return {"format": "hf", "prefix": f"{path}." if path else "", "config": config}
    return None


def parse_size(text: str) -> int:
    """Bytes of a size written like ``save_pretrained``'s ``max_shard_size``: ``5GB``, ``500MB``, ``2GiB``, ``1000``."""
    found = _SIZE.fullmatch(text)
    unit = found[2].upper() if found else ""
    if found is None or unit not in _UNITS or float(found[1]) * _UNITS[unit] < 1:
        raise HFFormatError(
            f"--max-shard-size {text!r} is not a size; give a positive number of bytes with an optional unit: "
            f"{', '.join(u for u in _UNITS if u)} (e.g. 5GB, 500MB)"
        )
    return int(float(found[1]) * _UNITS[unit])


def model_prefix(names: Iterable[str], recorded: Mapping[str, Any] | None, given: str | None) -> str:
    """The prefix to strip from every name: ``given`` (``--prefix``), else the recorded one, else the first name
    component when every name shares it (a ``LightningModule``'s ``self.model``), else none."""
    if given is not None:
        return given if not given or given.endswith(".") else f"{given}."
    if recorded is not None:
        return recorded["prefix"]
    firsts = {name.partition(".")[0] if "." in name else None for name in names}
    return f"{firsts.pop()}." if len(firsts) == 1 and None not in firsts else ""


def strip_prefix(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``weights`` under the model's own names; every name must start with ``prefix``."""
    outside = [name for name in weights if not name.startswith(prefix)]
    if outside:
        raise HFFormatError(
            f"--prefix {prefix!r}: tensors {outside[:5]} ({len(outside)} in all) are not under it; a Hugging Face "
            "directory holds the model alone, so give the attribute path of the model inside your LightningModule "
            "(e.g. --prefix model.), or write them all with --format safetensors"
        )
    return {name[len(prefix) :]: tensor for name, tensor in weights.items()}


def shard(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of ``tensors`` of at most ``max_bytes`` each (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_hf(
    weights: Mapping[str, torch.Tensor],
    out: Path,
    *,
    model: Mapping[str, Any] | None,
    provenance: Mapping[str, Any],
    prefix: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write ``weights`` (parameters and persistent buffers) as a directory ``from_pretrained`` loads.

    ``model`` is the run's recorded :func:`describe_model` (``None``: no ``config.json`` is written, and the
    user's own config goes beside the weights). Files of an earlier consolidation into ``out`` are replaced.
    Returns the names of the files written.
    """
    max_bytes = parse_size(max_shard_size)
    own = strip_prefix(weights, model_prefix(weights, model, prefix))
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX, out / CONFIG]:
        stale.unlink(missing_ok=True)
    shards = shard({name: tensor.contiguous() for name, tensor in own.items()}, max_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    metadata = {"format": "pt", "moc": json.dumps(provenance)}
    for name, tensors in zip(names, shards):
        save_file(tensors, str(out / name), metadata=metadata)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in own.values())},
        "weight_map": {tensor: name for name, tensors in zip(names, shards) for tensor in tensors},
    }
    (out / INDEX).write_text(json.dumps(index, indent=2))
    written = [*names, INDEX]
    if model is not None:
        (out / CONFIG).write_text(json.dumps(model["config"], indent=2))
        written.append(CONFIG)
    return written

