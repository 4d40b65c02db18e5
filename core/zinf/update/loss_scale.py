"""Dynamic loss scaling for fp16: scale the loss, skip a step whose gradients overflowed, adapt the scale."""

from __future__ import annotations

from typing import Sequence

import torch

from zinf.config_sections import LossScaleConfig
from zinf.runtime.comm import Comm
from zinf.param.flat_group import FlatParamGroup

__all__ = ["DynamicLossScaler", "found_nonfinite"]


def found_nonfinite(groups: Sequence[FlatParamGroup], comm: Comm) -> bool:
    """True on every rank when any rank's gradient shard holds an inf or a nan."""
    bad = torch.zeros(1, device=comm.device)
    for g in groups:
        if not g.trainable:
            continue
        if not g.grad.finite():
            bad.fill_(1.0)
            break
    return bool(comm.all_reduce(bad, op="max").item() > 0)


class DynamicLossScaler:
    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale)
        self._good_steps = 0
        self.num_skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            self._good_steps = 0
            self.num_skipped += 1
            return
        self._good_steps += 1
        if self._good_steps == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.num_skipped = int(state["num_skipped"])
