"""Dense consolidation (sparse-to-dense): one ordinary checkpoint from a run's partial ones.

PEC spreads the newest model over several checkpoints: the latest holds every dense unit but only K
experts per MoE layer, older ones hold the others. Tools outside MoC (Lightning, inference servers,
evaluation scripts) want one file under the model's own parameter names. This module takes every dense
unit from the latest checkpoint and each part of every expert (weights, optimizer state: under
``checkpoint.pec_scope`` other than ``both`` a checkpoint holds one part of some experts) from the newest
checkpoint that holds it (the choice :meth:`PECCheckpointer.load_latest` makes), reads those tensors with
DCP (whatever world size and EP degree wrote them: chunks are merged), maps unit keys back to parameter
names with the map every checkpoint's ``moc.json`` carries, re-stacks stacked expert tensors, and writes
one of:

- ``lightning``: a ``torch.save``d Lightning-shaped checkpoint (``state_dict``, ``global_step``, ...)
  plus the optimizer state by parameter name; it loads with ``torch.load(..., weights_only=True)``.
- ``dcp``: a DCP directory keyed by parameter name, loadable by ``dcp.load`` into ``model.state_dict()``.
- ``safetensors``: the weights only.
- ``hf``: a directory ``transformers``' ``from_pretrained`` loads (:mod:`moc_lightning.export.hf_format`): the
  weights under the wrapped model's own names, in shards of ``--max-shard-size`` with their index, and the
  model's ``config.json`` when the run recorded one.

Every format holds the persistent buffers (a router's ``e_score_correction_bias``, torchtitan's
``expert_bias``, norm statistics) beside the parameters, as ``state_dict()`` does.

Usage: ``moc-consolidate CHECKPOINT_DIR --out PATH [--format lightning|dcp|safetensors|hf] [--allow-missing]
[--prefix PREFIX] [--max-shard-size SIZE] [--endpoint URL]``; ``CHECKPOINT_DIR`` may be an ``s3://`` URL.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter, StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from moc_lightning.engine.manifest import CheckpointRecord, Manifest, ManifestError
from moc_lightning.engine.parts import PARTS, part_key, part_key_of, split_part_key
from moc_lightning.engine.slots import buffer_key, param_key
from moc_lightning.engine.units import DenseUnit, ExpertUnit, Unit, parse_unit
from moc_lightning.export import hf_format
from moc_lightning.pec.stored import MANIFEST, UnreadableCheckpoint, read_description, read_manifest
from moc_lightning.storage import CheckpointStorage, CorruptCheckpointError, corrupt_from, make_storage
from moc_lightning.storage.location import local_path

CONTROL_BACKEND = "tensorstore"
"""Backend used to read control objects: it opens local roots and kvstore URLs alike, and on a local root
it reads the very files the ``filesystem`` backend writes. Tensors are read through each record's backend."""

OPTIMIZER_KEY = "moc_optimizer_state"
"""Where the ``lightning`` and ``dcp`` formats keep the optimizer state: ``{parameter: {state: tensor}}``."""


class ConsolidateError(ValueError):
    """The checkpoints cannot be consolidated as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Plan:
    """Which checkpoint each part of each unit is read from."""

    step: int
    """Step of the latest checkpoint: the step the dense result stands for."""
    sources: Mapping[str, CheckpointRecord]
    """Part key (``expert/L0/E3/weights``) -> the checkpoint holding that part's newest stored version."""
    missing: tuple[str, ...]
    """What no listed checkpoint holds: an expert's key when neither part of it is stored, a part key when
    only that part is not (``pec_scope`` with ``complete_first_persist=false``)."""

    def reads(self) -> list[tuple[CheckpointRecord, frozenset[str]]]:
        """Each checkpoint to read, oldest first, with the part keys taken from it."""
        records = sorted(set(self.sources.values()), key=lambda r: r.step)
        return [(r, frozenset(k for k, s in self.sources.items() if s == r)) for r in records]

    def provenance(self) -> dict[str, Any]:
        """Where the dense checkpoint came from, written into every format so it stays traceable.

        ``source_steps`` gives each unit one step, its stalest stored part's (the step its lost tokens count
        from, as in ``moc_recovery``'s ``sources``): where every unit came whole from one checkpoint this is
        the format written before parts existed. ``part_steps`` is added only for the units whose parts came
        from different checkpoints (``pec_scope`` other than ``both``): ``{unit: {part: step}}``.
        """
        steps: dict[str, dict[str, int]] = {}
        for key, record in sorted(self.sources.items()):
            unit, part = split_part_key(key)
            steps.setdefault(unit, {})[part] = record.step
        provenance: dict[str, Any] = {
            "step": self.step,
            "source_steps": {unit: min(parts.values()) for unit, parts in steps.items()},
            "missing": list(self.missing),
        }
        mixed = {unit: parts for unit, parts in steps.items() if len(set(parts.values())) > 1}
        if mixed:
            provenance["part_steps"] = mixed
        return provenance


def plan(manifest: Manifest, num_experts: Sequence[int]) -> Plan:
    """Dense units from the latest checkpoint, each part of each expert from the newest checkpoint holding it
    (whole or that part alone): the sources a storage-only recovery (:meth:`PECCheckpointer.load_latest`) takes."""
    latest = manifest.latest
    if latest is None:
        raise ValueError("a plan needs a manifest that lists at least one checkpoint")
    dense = [u for u in latest.units if isinstance(parse_unit(u), DenseUnit)]
    experts = [ExpertUnit(layer, e).key for layer, n in enumerate(num_experts) for e in range(n)]
    newest = {part_key(u, part): manifest.newest(u, part=part) for u in dense + experts for part in PARTS}
    missing: list[str] = []
    for unit in experts:
        gone = [part_key(unit, part) for part in PARTS if newest[part_key(unit, part)] is None]
        missing += [unit] if len(gone) == len(PARTS) else gone
    weightless = {unit for unit in experts if newest[part_key(unit, "weights")] is None}
    return Plan(
        step=latest.step,
        # an optimizer state without its parameter has no name in a dense checkpoint: it is left out with it
        sources={k: r for k, r in newest.items() if r is not None and split_part_key(k)[0] not in weightless},
        missing=tuple(missing),
    )


class StorageRoot:
    """A MoC storage root opened for reading; each checkpoint is read through the backend that wrote it."""

    def __init__(self, url: str, endpoint: str = "") -> None:
        path = local_path(url)
        if path is not None and not path.is_dir():
            raise ConsolidateError(f"checkpoint directory {url!r} does not exist")
        self.url = url
        self.endpoint = endpoint
        self._storages: dict[str, CheckpointStorage] = {}

    def manifest(self) -> Manifest:
        """The committed manifest (the previous one if it is damaged), which must list at least one checkpoint."""
        manifest = read_manifest(self._storage(CONTROL_BACKEND))
        if manifest.latest is None:
            raise ConsolidateError(
                f"no committed checkpoint under {self.url!r}: no {MANIFEST}, or it lists none; is this the "
                "storage root of a MoC run (checkpoint.storage.url)?"
            )
        return manifest

    def layout(self, record: CheckpointRecord) -> dict[str, Any]:
        """The ``layout`` section of a checkpoint's ``moc.json``: ``num_experts``, the parameter map, tied names."""
        layout = self._description(record).get("layout")
        if layout is None:
            raise ConsolidateError(
                f"{record.name}/moc.json has no parameter map (written by an older moc_lightning, or lost); "
                "the checkpoint cannot be mapped back to parameter names"
            )
        return layout

    def model(self, record: CheckpointRecord) -> dict[str, Any] | None:
        """The ``model`` section of a checkpoint's ``moc.json`` (:func:`hf_format.describe_model`), if recorded."""
        return self._description(record).get("model")

    def _description(self, record: CheckpointRecord) -> dict[str, Any]:
        return read_description(self._storage(CONTROL_BACKEND), record.name)

    def reader(self, record: CheckpointRecord) -> StorageReader:
        return self._storage(record.backend).reader(record.name)

    def _storage(self, backend: str) -> CheckpointStorage:
        if backend not in self._storages:
            try:
                self._storages[backend] = make_storage(backend, self.url, self.endpoint)
            except ValueError as err:  # a bad URL or endpoint, or one that does not answer: one line, no traceback
                raise ConsolidateError(str(err)) from err
        return self._storages[backend]


def read_parts(reader: StorageReader, parts: frozenset[str]) -> dict[str, torch.Tensor]:
    """Every stored tensor of ``parts`` (part keys) in one checkpoint, whole: sized from its metadata, filled by
    DCP. A weights part without a tensor is damage; an optimizer part may have none (a parameter not yet
    updated has no state), as :meth:`~moc_lightning.pec.loading.Loader.load_from_storage` allows."""
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and part_key_of(key) in parts  # not the ranks' own states
    }
    absent = {k for k in parts if split_part_key(k)[1] == "weights"} - {part_key_of(key) for key in tensors}
    if absent:
        raise ConsolidateError(f"the manifest says parts {sorted(absent)[:5]} are stored, but no tensor of theirs is")
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


@dataclass(frozen=True)
class Piece:
    """One stored tensor and its place in the dense model."""

    param: str
    """Model parameter (or persistent buffer) name."""
    state: str | None
    """Optimizer state name (``exp_avg``); ``None`` for the weight (or buffer) itself."""
    unit: Unit
    index: int | None
    """Slice of a stacked ``[E, ...]`` parameter (``None``: the unit owns the parameter whole)."""
    flattened: bool
    """The stacked parameter is flattened ``[E*I, ...]`` (DBRX) and the slice ``[I, ...]`` was taken through its
    ``[E, I, ...]`` view (the map's ``view``; absent from checkpoints written before it was recorded)."""
    step: int
    tensor: torch.Tensor


def place(tensors: Mapping[str, torch.Tensor], params: Mapping[str, Any], record: CheckpointRecord) -> list[Piece]:
    """Route every tensor read from ``record`` to its parameter with the checkpoint's parameter map."""
    pieces = []
    for key, tensor in tensors.items():
        unit = parse_unit(key)
        kind, rest = key[len(unit.key) + 1 :].split("/", 1)
        local_name, state = (rest, None) if kind in ("param", "buffer") else rest.rsplit("/", 1)
        named = buffer_key(unit, local_name) if kind == "buffer" else param_key(unit, local_name)
        source = params.get(named)
        if source is None:
            raise ConsolidateError(f"{record.name}/moc.json names no parameter for {named!r}")
        flattened = source.get("view") is not None
        pieces.append(Piece(source["param"], state, unit, source["index"], flattened, record.step, tensor))
    return pieces


def read_pieces(root: StorageRoot, chosen: Plan, progress: bool = True) -> list[Piece]:
    """Read every planned part, one checkpoint at a time.

    A tensor is routed by the parameter map of the checkpoint it is read from, else by another's: a map names
    the weights its checkpoint holds only, so an optimizer part stored alone (``pec_scope=weights``) is routed
    by the map of a checkpoint holding its weights (a unit's map does not change within a run).
    """
    reads = chosen.reads()
    maps = [root.layout(record)["params"] for record, _ in reads]
    pieces: list[Piece] = []
    for (record, parts), own in tqdm(zip(reads, maps), desc="moc-consolidate", unit="checkpoint", total=len(reads),
                                     disable=not progress):
        params = ChainMap(own, *maps)
        try:
            tensors = read_parts(root.reader(record), parts)
        except (CheckpointException, CorruptCheckpointError) as err:  # DCP wraps the reader's report
            corrupt = corrupt_from(err)
            if corrupt is None:
                raise
            raise UnreadableCheckpoint(record.name, corrupt.detail) from err
        pieces += place(tensors, params, record)
    return pieces


@dataclass(frozen=True)
class DenseCheckpoint:
    """The consolidated state under the model's parameter names."""

    weights: dict[str, torch.Tensor]
    """The model's ``state_dict``: parameters and persistent buffers, under their module names."""
    optimizer: dict[str, dict[str, torch.Tensor]]
    provenance: dict[str, Any]
    model: dict[str, Any] | None = None
    """The model the run recorded (:func:`hf_format.describe_model`); ``None`` when it recorded none."""


def assemble(
    pieces: Sequence[Piece],
    num_experts: Sequence[int],
    provenance: dict[str, Any],
    model: dict[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> DenseCheckpoint:
    """Group pieces by parameter (and optimizer state) and join each group into one dense tensor.

    ``aliases`` (the map's other names of tied tensors, :attr:`Layout.aliases`) repeat their tensor under each
    name, as ``state_dict()`` does; as copies, since safetensors refuses two names for one memory.
    """
    groups: dict[tuple[str, str | None], list[Piece]] = {}
    for piece in pieces:
        groups.setdefault((piece.param, piece.state), []).append(piece)
    weights = {param: _join(g, num_experts) for (param, state), g in groups.items() if state is None}
    weights |= {alias: weights[name].clone() for alias, name in (aliases or {}).items() if name in weights}
    slices = {param: g[0].tensor.shape for (param, state), g in groups.items() if state is None}
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for (param, state), group in groups.items():
        if state is not None:
            optimizer.setdefault(param, {})[state] = _join(group, num_experts, slices[param])
    return DenseCheckpoint(weights, optimizer, provenance, model)


def _join(group: Sequence[Piece], num_experts: Sequence[int], slice_shape: torch.Size | None = None) -> torch.Tensor:
    """One dense tensor from its pieces.

    A parameter owned whole comes from exactly one unit. A stacked parameter is its experts' slices in
    global expert order, so it needs every expert of its MoE layer; a flattened one (``[E*I, ...]``) gets its
    own shape back by merging the stack's first two dims. Optimizer state (given with the shape
    ``slice_shape`` of its parameter's slices) that is not of that shape was never sliced (Adam's scalar
    ``step``, shared by a stacked parameter's experts): the newest piece's value is taken, as the live
    loader's last copy would.
    """
    first = group[0]
    if first.index is None:
        if len(group) > 1:
            raise ConsolidateError(
                f"units {[p.unit.key for p in group]} all map to parameter {first.param!r}: the checkpoint names "
                "experts by rank-local names, which do not identify one parameter of a dense model"
            )
        return first.tensor
    if slice_shape is not None and first.tensor.shape != slice_shape:
        return max(group, key=lambda p: p.step).tensor
    ordered = sorted(group, key=lambda p: p.unit)
    experts = [p.unit for p in ordered if isinstance(p.unit, ExpertUnit)]
    assert len(experts) == len(ordered), "only an expert's tensor is a slice of a stacked parameter"
    held = [unit.expert for unit in experts]
    expected = list(range(num_experts[experts[0].layer]))
    if held != expected:
        raise ConsolidateError(
            f"stacked parameter {first.param!r} needs experts {expected}, only {held} are stored; "
            "a stacked tensor cannot leave out a never-stored expert, even with --allow-missing"
        )
    stacked = torch.stack([p.tensor for p in ordered])
    return stacked.flatten(0, 1) if first.flattened else stacked


def write_lightning(dense: DenseCheckpoint, out: Path) -> None:
    """A Lightning-shaped checkpoint of plain tensors, ints, strings and dicts (``weights_only`` loads it)."""
    torch.save(
        {
            "state_dict": dense.weights,
            "global_step": dense.provenance["step"],
            "epoch": 0,
            "pytorch-lightning_version": lightning.__version__,
            OPTIMIZER_KEY: dense.optimizer,
            "moc": dense.provenance,
        },
        out,
    )


def write_dcp(dense: DenseCheckpoint, out: Path) -> None:
    """A single-process DCP checkpoint whose top-level keys are the parameter names; replaces one at ``out``."""
    state = {**dense.weights, OPTIMIZER_KEY: dense.optimizer, "moc": json.dumps(dense.provenance)}
    dcp.save(state, storage_writer=FileSystemWriter(out, overwrite=True), no_dist=True)


def write_safetensors(dense: DenseCheckpoint, out: Path) -> None:
    """The weights only (safetensors holds tensors), with the provenance as JSON metadata."""
    tensors = {name: tensor.contiguous() for name, tensor in dense.weights.items()}
    save_file(tensors, str(out), metadata={"format": "pt", "moc": json.dumps(dense.provenance)})


def write_hf(
    dense: DenseCheckpoint, out: Path, *, prefix: str | None = None, max_shard_size: str = hf_format.DEFAULT_MAX_SHARD_SIZE
) -> None:
    """A ``from_pretrained`` directory: the weights under the model's own names, sharded, with its config."""
    hf_format.write_hf(
        dense.weights, out, model=dense.model, provenance=dense.provenance, prefix=prefix, max_shard_size=max_shard_size
    )


WRITERS: dict[str, Callable[..., None]] = {
    "lightning": write_lightning,
    "dcp": write_dcp,
    "safetensors": write_safetensors,
    "hf": write_hf,
}


def consolidate(
    url: str,
    out: str | Path,
    fmt: str = "lightning",
    *,
    allow_missing: bool = False,
    progress: bool = True,
    prefix: str | None = None,
    max_shard_size: str | None = None,
    endpoint: str = "",
) -> dict[str, Any]:
    """Write the newest stored version of every unit of the run under ``url`` as one dense checkpoint.

    ``prefix`` and ``max_shard_size`` are options of the ``hf`` format (:func:`write_hf`; ``None``: its
    default). ``endpoint``: an S3-compatible store's, for an ``s3://`` URL, as ``checkpoint.storage.endpoint`` names
    it (empty: the AWS environment's). Returns the provenance written with it: the step, each unit's source step and any missing
    experts.
    """
    if fmt not in WRITERS:
        raise ConsolidateError(f"--format {fmt!r} is not supported; choose one of: {', '.join(WRITERS)}")
    options = _format_options(fmt, prefix=prefix, max_shard_size=max_shard_size)
    root = StorageRoot(url, endpoint)
    manifest = root.manifest()
    latest = manifest.latest
    assert latest is not None, "StorageRoot.manifest() refuses a manifest that lists no checkpoint"
    layout = root.layout(latest)
    num_experts = layout["num_experts"]
    chosen = plan(manifest, num_experts)
    if chosen.missing and not allow_missing:
        raise ConsolidateError(
            f"experts {list(chosen.missing)} were never stored (a part key: only that part of the expert), so no "
            "dense checkpoint holds the whole model; pass --allow-missing to write one without them"
        )
    dense = assemble(
        read_pieces(root, chosen, progress),
        num_experts,
        chosen.provenance(),
        root.model(latest),
        layout.get("aliases"),  # absent from checkpoints written before aliases were recorded
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        WRITERS[fmt](dense, out, **options)
    except hf_format.HFFormatError as err:  # a --prefix that fits no name of this run
        raise ConsolidateError(str(err)) from err
    return dense.provenance


def _format_options(fmt: str, **options: str | None) -> dict[str, str]:
    """The options given (not ``None``) for the writer of ``fmt``, checked before anything is read: only the
    ``hf`` format takes any, and its shard size must be a size."""
    given = {name: value for name, value in options.items() if value is not None}
    if given and fmt != "hf":
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ConsolidateError(f"{flags} applies to --format hf only, not --format {fmt}")
    try:
        hf_format.parse_size(given.get("max_shard_size", hf_format.DEFAULT_MAX_SHARD_SIZE))
    except hf_format.HFFormatError as err:
        raise ConsolidateError(str(err)) from err
    return given


def main(argv: Sequence[str] | None = None) -> None:
    """``moc-consolidate``: the command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="moc-consolidate",
        description="Write one dense checkpoint holding every unit of a MoC run at its newest stored version.",
    )
    parser.add_argument("checkpoint_dir", help="storage root of the run (the directory holding manifest.json)")
    parser.add_argument("--out", required=True, help="output file (lightning, safetensors) or directory (dcp, hf)")
    parser.add_argument("--format", default="lightning", choices=tuple(WRITERS), help="output format")
    parser.add_argument(
        "--allow-missing", action="store_true", help="leave out experts that were never stored instead of failing"
    )
    parser.add_argument(
        "--prefix",
        help="hf: attribute path of the model inside the LightningModule, stripped from every name (default: the one "
        "the run recorded, else the first name component when all names share it; '' strips nothing)",
    )
    parser.add_argument(
        "--max-shard-size",
        help=f"hf: largest safetensors shard, e.g. 500MB or 2GiB (default {hf_format.DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--endpoint",
        default="",
        help="an s3:// run's S3-compatible endpoint, http(s)://host[:port], as checkpoint.storage.endpoint names it "
        "(default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS)",
    )
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # DCP warns on every single-process call, which is all this command makes
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            provenance = consolidate(
                args.checkpoint_dir,
                args.out,
                args.format,
                allow_missing=args.allow_missing,
                prefix=args.prefix,
                max_shard_size=args.max_shard_size,
                endpoint=args.endpoint,
            )
    except (ConsolidateError, ManifestError, UnreadableCheckpoint) as err:  # damage included: one line, no traceback
        message = " ".join(str(err).split())
        parser.exit(1, f"moc-consolidate: error: {message}\n")
    print(f"moc-consolidate: wrote step {provenance['step']} to {args.out} ({args.format})")


if __name__ == "__main__":
    main()
