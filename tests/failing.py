"""An autograd identity whose backward raises while armed: a backward that fails part way, after the layers above it
gave their gradients (tests of what a backward that raised leaves behind)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Fail(RuntimeError):
    pass


class FailingBackward(torch.autograd.Function):
    """``FailingBackward.apply(x)``: ``x``, whose backward raises :class:`Fail` inside ``armed()``."""

    on = False

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if FailingBackward.on:
            raise Fail("in a backward, after the layers above gave their gradients")
        return grad


@contextlib.contextmanager
def armed() -> Iterator[None]:
    FailingBackward.on = True
    try:
        yield
    finally:
        FailingBackward.on = False


class ThreeLinear(torch.nn.Module):
    """Three linear layers, the backward failing between the first and the second while ``armed()``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(FailingBackward.apply(self.a(x)))).square().mean()
