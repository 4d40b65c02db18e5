"""Global-norm gradient clipping over gradient shards, computed the way torch.nn.utils.clip_grad_norm_ does.

Per parameter: the norm of its gradient (taken by its gradient shard, whatever its tier: see
[Note: gradient shard states] in zinf/param/grad_shard.py) (on several ranks: the square root of the all-reduced sum of
each rank's squared partial norm); total: the norm of those norms. With one rank this reproduces
torch's result bit for bit, so clipped runs still match plain PyTorch exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zinf.runtime.comm import Comm
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import group_of

__all__ = ["grad_norm", "clip_grad_norm_"]


def grad_norm(params: Sequence[nn.Parameter], comm: Comm) -> torch.Tensor:
    norms, by_group = [], {}
    for p in params:
        if not p.requires_grad:  # frozen: no gradient (torch skips grads that are None)
            continue
        g = group_of(p)
        assert g is not None
        if id(g) not in by_group:
            by_group[id(g)] = g.grad.norms()
        norms.append(by_group[id(g)][g.index_of(p)])
    if not norms:
        return torch.zeros(())
    # with a device share of the optimizer some shards are on the device, the others on the host
    per_param = torch.stack([n.to(norms[0].device) for n in norms])
    if comm.world > 1:
        per_param = comm.all_reduce(per_param.square(), op="sum").sqrt()
    return torch.linalg.vector_norm(per_param)


def clip_grad_norm_(params: Sequence[nn.Parameter], groups: Sequence[FlatParamGroup], max_norm: float,
                    comm: Comm) -> torch.Tensor:
    total = grad_norm(params, comm)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in groups:
        if g.trainable:
            g.grad.scale(coef)
    return total
