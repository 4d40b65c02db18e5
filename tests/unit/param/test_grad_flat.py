"""zinf/param/grad_flat.py: a group's flat gradient as a backward assembles it; a lone gradient adopted as the flat
gradient itself where it already is one ([Note: a lone gradient adopted]), copied into a fresh flat buffer
everywhere else."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from zinf.param.grad_flat import FlatGrad
from zinf.param.grad_shard import GradShard
from zinf.param.layout import FlatLayout

CPU = torch.device("cpu")


@dataclass
class Group:
    """What a gradient shard reads of its group (``GroupKey``)."""

    name: str
    shard_numel: int
    device: torch.device = CPU
    storage_dtype: torch.dtype = torch.float32
    shard: torch.Tensor | None = None
    shard_nbytes: int = 0

    def shard_values(self, shard: torch.Tensor) -> torch.Tensor:
        return shard


def _flat(params: list[nn.Parameter], world: int = 2) -> tuple[FlatGrad, GradShard]:
    layout = FlatLayout.of([f"p{i}" for i in range(len(params))], [p.detach() for p in params], rank=0, world=world)
    shard = GradShard(Group("g", layout.shard_numel), [layout.local_range(i) for i in range(len(params))], CPU)
    return FlatGrad(layout, CPU, params), shard


def _autograd_grad(weight: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    """The gradient autograd hands the parameter (a linear layer's weight)."""
    weight.grad = None
    nn.functional.linear(x, weight).square().sum().backward()
    grad, weight.grad = weight.grad, None
    return grad


def test_a_lone_gradient_is_the_flat_gradient_and_a_second_one_adds_into_it() -> None:
    w = nn.Parameter(torch.randn(6, 4))
    flat, shard = _flat([w])
    g1, g2 = _autograd_grad(w, torch.randn(3, 4)), _autograd_grad(w, torch.randn(3, 4))
    expected = (g1 + g2).reshape(-1)
    assert flat.add(0, g1, torch.float32, shard)
    assert flat.full is not None and flat.full.data_ptr() == g1.data_ptr()  # no copy, no second buffer
    flat.add(0, g2, torch.float32, shard)  # a re-entrant checkpoint's second gradient
    full = flat.take(torch.float32, off_device=False)
    assert full is not None and torch.equal(full, expected)


@pytest.mark.parametrize("case", ["padded", "two trained", "a view", "another dtype"])
def test_anything_else_is_copied_into_a_fresh_flat_buffer(case: str) -> None:
    w = nn.Parameter(torch.randn(5, 3) if case == "padded" else torch.randn(6, 4))  # 15 elements pad to 16
    params = [w, nn.Parameter(torch.randn(2))] if case == "two trained" else [w]
    flat, shard = _flat(params)
    grad = _autograd_grad(w, torch.randn(3, w.shape[1]))
    if case == "a view":
        grad = torch.randn(2 * w.numel())[w.numel():].view_as(w).copy_(grad)
    reduce_dtype = torch.float64 if case == "another dtype" else torch.float32
    flat.add(0, grad, reduce_dtype, shard)
    full = flat.take(reduce_dtype, off_device=False)
    assert full is not None and full.dtype == reduce_dtype
    assert full.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
    assert torch.equal(full[: w.numel()], grad.reshape(-1).to(reduce_dtype))
    assert not full[w.numel():].any()
