"""A user's torch optimizer, pointed at this rank's fp32 master shards instead of the full parameters.

Each parameter in the optimizer's param groups is replaced by a shard parameter: a view of the part
of its group's fp32 master that this rank holds (possibly empty), whose ``.grad`` is the matching
view of the fp32 gradient shard. The optimizer object itself is kept (so LR schedulers and
frameworks holding it keep working) and its hyper-parameters per param group are untouched. This is
exact for optimizers whose update is element-wise (Adam, AdamW, SGD, Adagrad, RMSprop, ...).

As in PyTorch, a parameter is stepped only when it has a gradient: a frozen parameter never (it gets
no gradient view, so no gradient shard memory and, with torch's optimizers, no state), and one that
no rank produced a gradient for since the last step (a skipped branch) not in that step (see
[Note: stepped parameters] in zinf/param/flat_group.py). A parameter of a frozen group, which keeps no
master (see [Note: frozen groups] there), is replaced by a placeholder of its shard's size (one element,
expanded) that is never stepped.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import group_of
from zinf.report import tier_of

__all__ = ["ShardedOptimizer", "NOT_ELEMENTWISE"]

# optimizers whose update couples elements of a tensor: a shard alone cannot reproduce them
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


class ShardedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence[FlatParamGroup]) -> None:
        name = type(optimizer).__name__
        if name in NOT_ELEMENTWISE:
            raise UnsupportedModelError(
                f"zinf: optimizer {name} couples the elements of a parameter, so it cannot step on 1/world shards. "
                "Use an element-wise optimizer (Adam, AdamW, SGD, Adagrad, RMSprop, ...)."
            )
        if any(optimizer.state.values()):
            raise UnsupportedModelError(
                "zinf: the optimizer has already taken steps (its state is not empty). Build it on the model's "
                "parameters and hand it to the engine before the first step; restore state with engine.load_state_dict."
            )
        self.optimizer = optimizer
        self.groups = list(groups)
        self.shard_params: list[nn.Parameter] = []
        self.full_params: list[nn.Parameter] = []
        self._grads: list[tuple[FlatParamGroup, int, torch.Tensor | None]] = []
        for pg in optimizer.param_groups:
            replaced = []
            for p in pg["params"]:
                group = group_of(p)
                if group is None:
                    raise UnsupportedModelError(
                        "zinf: the optimizer holds a parameter that is not part of the model given to the engine "
                        f"(shape {tuple(p.shape)}). Build the optimizer from model.parameters() of that model."
                    )
                index = group.index_of(p)
                a, b = group.local_range(index)
                if group.shard_only:
                    placeholder = torch.zeros(1, dtype=torch.float32, device=group.device).expand(b - a)
                    shard = nn.Parameter(placeholder, requires_grad=False)
                else:
                    assert group.master is not None, f"{group.name}: a device-tier optimizer needs the master in the group"
                    shard = nn.Parameter(group.master[a:b], requires_grad=p.requires_grad)
                self._grads.append((group, index, group.grad.tensor()[a:b] if p.requires_grad else None))
                replaced.append(shard)
                self.shard_params.append(shard)
                self.full_params.append(p)
            pg["params"] = replaced

    def step(self) -> None:
        for g in self.groups:  # unscale / clip, one multiply each, before torch reads the gradients
            g.grad.apply_pending()
        # set every time: a zero_grad(set_to_none=True) in user code must not detach the shards
        for s, (group, index, grad) in zip(self.shard_params, self._grads):
            s.grad = grad if grad is not None and bool(group.grad_used[index]) else None
        self.optimizer.step()
        for g in self.groups:
            if not g.shard_only:
                g.refresh_shard_from_master()  # the storage-dtype shard follows the fp32 master
                g.zero_grad()

    def wait(self) -> None:
        return None

    def before_backward(self) -> None:
        return None

    def after_backward(self) -> None:
        return None

    def settle(self) -> None:
        return None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    kinds = out.setdefault(tier_of(v), {})
                    kinds["optimizer_state"] = kinds.get("optimizer_state", 0) + v.untyped_storage().nbytes()
        return out
