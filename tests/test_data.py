"""The default corpus is deterministic and split; user text and uint16 .bin files load the same way."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from moc_lightning.data import DataConfig, LMDataModule, StatefulDataLoader, TokenWindows, load_tokens


def test_stdlib_corpus_is_fixed_bytes() -> None:
    tokens = load_tokens(DataConfig())
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    digest = hashlib.sha256(bytes(tokens.to(torch.uint8).tolist())).hexdigest()
    assert tokens.numel() == 1_604_230
    assert digest == hashlib.sha256(bytes(load_tokens(DataConfig()).to(torch.uint8).tolist())).hexdigest()


def test_split_is_fixed_and_disjoint() -> None:
    dm = LMDataModule(DataConfig(val_fraction=0.1), block_size=32, vocab_size=256)
    dm.setup()
    tokens = load_tokens(DataConfig())
    split = int(tokens.numel() * 0.9)
    assert torch.equal(dm.train.tokens, tokens[:split]) and torch.equal(dm.val.tokens, tokens[split:])
    x, y = dm.train[3]
    assert torch.equal(x[1:], y[:-1]) and x.shape == (32,)


def test_text_files_are_read_as_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello ")
    b.write_text("world")
    tokens = load_tokens(DataConfig(source="text", paths=[str(a), str(b)]))
    assert bytes(tokens.tolist()) == b"hello world"


def test_uint16_bin_file(tmp_path: Path) -> None:
    ids = np.arange(0, 50_000, 7, dtype=np.uint16)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    tokens = load_tokens(DataConfig(source="bin", paths=[str(path)]))
    assert tokens.tolist() == ids.astype(np.int64).tolist()
    dm = LMDataModule(DataConfig(source="bin", paths=[str(path)]), block_size=8, vocab_size=256)
    with pytest.raises(ValueError, match="raise model.vocab_size"):
        dm.setup()


def test_too_short_data_is_refused() -> None:
    with pytest.raises(ValueError, match="too few for block_size=8"):
        TokenWindows(torch.arange(5), block_size=8)


@pytest.mark.parametrize("cut", [0, 4, 13])  # epoch 2's start, its middle, and its end (13 batches an epoch)
def test_stateful_loader_resumes_where_it_stopped_with_shuffling(cut: int) -> None:
    windows = TokenWindows(torch.arange(200), block_size=3)  # 66 windows: 13 batches of 5, one left over

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(
            windows, batch_size=5, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(7)
        )

    def ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
        return (batch[0][:, 0] // 3).tolist()

    straight = loader()
    expected = [ids(b) for _ in range(3) for b in straight]
    first = loader()
    seen = [ids(b) for b in first]
    epoch_two = iter(first)
    seen += [ids(next(epoch_two)) for _ in range(cut)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    seen += [ids(b) for b in second] + [ids(b) for b in second]
    assert seen[: len(expected)] == expected
    assert len(second) == 13, "the length Lightning reads stays the epoch's"
