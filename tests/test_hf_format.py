"""The pieces of ``--format hf`` that need no ``transformers``: sizes, the model prefix, shards and the index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moc_lightning.export.hf_format import INDEX, HFFormatError, model_prefix, parse_size, shard, write_hf


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5kb", 1500), ("1000", 1000)]
)
def test_sizes_read_as_save_pretrained_writes_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "5 GBs", "-1MB", "0"])
def test_a_size_that_is_not_one_names_the_option(text: str) -> None:
    with pytest.raises(HFFormatError, match=r"--max-shard-size .* is not a size; .* KB, MB, GB"):
        parse_size(text)


def test_prefix_given_then_recorded_then_the_shared_first_component() -> None:
    names = ["model.model.embed_tokens.weight", "model.lm_head.weight"]
    assert model_prefix(names, {"prefix": "net."}, "model") == "model."
    assert model_prefix(names, {"prefix": "net."}, "") == ""
    assert model_prefix(names, {"prefix": "net."}, None) == "net."
    assert model_prefix(names, None, None) == "model."
    assert model_prefix([*names, "head.weight"], None, None) == "", "no component shared by every name"
    assert model_prefix(["model", "model.x"], None, None) == "", "a top-level name keeps every name as it is"


def test_shards_stay_under_the_limit_and_a_larger_tensor_gets_its_own() -> None:
    tensors = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5)}
    shards = shard(tensors, max_bytes=80)  # float32: a, b = 40 bytes each, big = 400, c = 20
    assert [list(s) for s in shards] == [["a", "b"], ["big"], ["c"]]


def test_directory_has_the_index_of_every_tensor_without_the_prefix(tmp_path: Path) -> None:
    weights = {f"model.layers.{i}.weight": torch.full((64,), float(i)) for i in range(4)}
    written = write_hf(weights, tmp_path, model=None, provenance={"step": 3}, prefix="model", max_shard_size="512B")
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 4 * 64 * 4
    assert sorted(index["weight_map"]) == [f"layers.{i}.weight" for i in range(4)]
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert written == [*shards, INDEX], "no config.json without a recorded model"
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / file)[name], weights[f"model.{name}"])


def test_a_prefix_that_leaves_tensors_out_is_refused(tmp_path: Path) -> None:
    weights = {"model.w": torch.zeros(2), "value_head.w": torch.zeros(2)}
    with pytest.raises(HFFormatError, match=r"--prefix 'model\.': tensors \['value_head\.w'\] .* are not under it"):
        write_hf(weights, tmp_path, model={"prefix": "model.", "config": {}}, provenance={})
