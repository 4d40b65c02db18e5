"""The token data set the Trainer scripts train on: arithmetic sequences (a start and a stride per row), which a
small causal LM learns within a few steps; the same rows for the same seed on every rank and in every run."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __init__(self, n: int, block: int, vocab: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.seq = (start + stride * torch.arange(block)) % vocab

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.seq[i], "labels": self.seq[i]}
