"""examples/synthetic_language.py: deterministic per (seed, step, rank), and every target is one of its
input token's successors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from synthetic_language import MarkovLanguage  # noqa: E402


def test_batches_follow_the_chain() -> None:
    lang = MarkovLanguage(64, branching=4, seed=3)
    idx, targets = lang.batch(8, 16, step=5, rank=1)
    assert idx.shape == targets.shape == (8, 16) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    allowed = lang.successors[idx]  # (8, 16, 4)
    assert bool((allowed == targets.unsqueeze(-1)).any(-1).all())
    assert torch.equal(lang.batch(8, 16, 5, 1)[0], MarkovLanguage(64, 4, seed=3).batch(8, 16, 5, 1)[0])
    assert not torch.equal(lang.batch(8, 16, 5, 0)[0], idx)  # another rank, other data
    assert math.isclose(lang.chance, math.log(64))
    assert 0 < lang.floor < math.log(4)
