"""A synthetic language with learnable structure, generated on the fly (no download): a fixed random
Markov chain over ``vocab`` tokens, deterministic from a seed.

Every token has ``branching`` possible successors, drawn at random once from the seed, taken with the
fixed probabilities ``profile`` (each token's successors in a random order). A model that has learnt the
chain predicts the next token with a cross-entropy equal to the entropy of ``profile`` (``floor``), far
below the ``ln(vocab)`` of guessing (``chance``). Batches are deterministic from (seed, step, rank), so
each rank sees its own data and a run is reproducible.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovLanguage"]


class MarkovLanguage:
    def __init__(self, vocab: int, branching: int = 4, seed: int = 0) -> None:
        if not 1 <= branching <= vocab:
            raise ValueError(f"MarkovLanguage: expected 1 <= branching <= vocab ({vocab}), found {branching}")
        self.vocab, self.branching, self.seed = vocab, branching, seed
        g = torch.Generator().manual_seed(seed)
        # successors[t] = the tokens that may follow t, most likely first
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
        weights = torch.tensor([1.0 / (i + 1) for i in range(branching)], dtype=torch.float64)  # Zipf-like
        self.profile = weights / weights.sum()

    @property
    def chance(self) -> float:
        """Cross-entropy (nats) of a uniform guess over the vocabulary."""
        return math.log(self.vocab)

    @property
    def floor(self) -> float:
        """Cross-entropy (nats) of a model that knows the chain: the entropy of each token's successors."""
        return float(-(self.profile * self.profile.log()).sum())

    def batch(self, batch: int, block: int, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` sequences of ``block`` + 1 tokens from the chain: inputs and next-token targets (int64)."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 4099 + rank)
        choice = torch.multinomial(self.profile.float(), batch * block, replacement=True, generator=g).view(batch, block)
        seq = torch.empty(batch, block + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        for t in range(block):
            seq[:, t + 1] = self.successors[seq[:, t], choice[:, t]]
        return seq[:, :-1], seq[:, 1:]
