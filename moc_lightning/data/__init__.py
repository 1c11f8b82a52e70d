"""Language-modelling data that needs no download.

``stdlib`` (the default) is a byte-level corpus the package ships: 30 modules of CPython 3.11.7's standard
library (PSF License), gzip-compressed in ``stdlib_corpus.txt.gz``, so every machine trains on the same
bytes. ``text`` reads a user's text files as bytes; ``bin`` memory-maps a pre-tokenized ``uint16`` file
(nanoGPT's format). The split is fixed: the last ``val_fraction`` of the tokens is validation. The training
loader is a :class:`StatefulDataLoader` shuffled from ``seed``, so a resume continues the epoch exactly.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from moc_lightning.data.stateful import StatefulDataLoader

__all__ = ["DataConfig", "LMDataModule", "StatefulDataLoader", "TokenWindows", "load_tokens"]

CORPUS = Path(__file__).with_name("stdlib_corpus.txt.gz")
SOURCES = ("stdlib", "text", "bin")


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched."""

    source: str = "stdlib"
    """One of ``stdlib`` (shipped byte corpus), ``text`` (byte-level, from ``paths``), ``bin`` (uint16 tokens)."""
    paths: list[str] = field(default_factory=list)
    """Input files for ``text`` (concatenated in order) or the single ``.bin`` file for ``bin``."""
    batch_size: int = 16
    """Sequences per batch on each rank."""
    val_fraction: float = 0.1
    """Share of the tokens, taken from the end, held out for validation."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 0
    """Seed of the training order (one device; under DDP Lightning's ``DistributedSampler`` shuffles from the
    global seed and the epoch)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source={self.source!r} is not one of {', '.join(SOURCES)}")
        if self.source != "stdlib" and not self.paths:
            raise ValueError(f"data.source={self.source} needs data.paths (a list of files)")
        if self.source == "bin" and len(self.paths) != 1:
            raise ValueError(f"data.source=bin takes exactly one file in data.paths, got {len(self.paths)}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.batch_size < 1 or self.num_workers < 0:
            raise ValueError("data.batch_size must be >= 1 and data.num_workers >= 0")


def load_tokens(cfg: DataConfig) -> torch.Tensor:
    """All tokens of the configured source as a 1-D int64 tensor."""
    if cfg.source == "stdlib":
        raw = gzip.decompress(CORPUS.read_bytes())
    elif cfg.source == "text":
        raw = b"".join(Path(p).read_bytes() for p in cfg.paths)
    else:
        return torch.from_numpy(np.memmap(cfg.paths[0], dtype=np.uint16, mode="r").astype(np.int64))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size`` tokens and their next-token targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() <= block_size:
            raise ValueError(f"{tokens.numel()} tokens are too few for block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class LMDataModule(L.LightningDataModule):
    """Train/validation loaders over a fixed split; Lightning adds the distributed sampler."""

    def __init__(self, cfg: DataConfig, block_size: int, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.train: TokenWindows | None = None
        self.val: TokenWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        tokens = load_tokens(self.cfg)
        if int(tokens.max()) >= self.vocab_size:
            raise ValueError(
                f"data holds token id {int(tokens.max())} but model.vocab_size={self.vocab_size}; "
                "raise model.vocab_size"
            )
        split = int(tokens.numel() * (1 - self.cfg.val_fraction))
        self.train = TokenWindows(tokens[:split], self.block_size)
        self.val = TokenWindows(tokens[split:], self.block_size)

    def _dataset(self, split: TokenWindows | None) -> TokenWindows:
        if split is None:
            raise RuntimeError("LMDataModule.setup() builds the datasets; call it before asking for a loader")
        return split

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self._dataset(self.train),
            batch_size=self.cfg.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.cfg.num_workers,
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.val), batch_size=self.cfg.batch_size, num_workers=self.cfg.num_workers)
