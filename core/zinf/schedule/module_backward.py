"""Telling the hooks where one module's backward starts (the first gradient of its outputs arrives) and where it is
done (the gradients of its inputs exist: see [Note: frozen groups in backward] in zinf/schedule/hooks.py)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zinf.schedule.tensors import tensors_in

__all__ = ["after_module_backward", "announce_backward"]


def announce_backward(on_start: Callable[[nn.Module], None], module: nn.Module, output: Any) -> None:
    """Call ``on_start(module)`` once, when the first gradient of ``module``'s ``output`` arrives in the backward."""
    tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not tensors:
        return
    fired = [False]

    def hook(grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            on_start(module)

    for t in tensors:
        t.register_hook(hook)


class _ModuleBackwardDone(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``on_done(module)``."""

    @staticmethod
    def forward(ctx: Any, on_done: Callable[[nn.Module], None], module: nn.Module,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_done, ctx.module = on_done, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.on_done(ctx.module)
        return (None, None, *grads)


def after_module_backward(on_done: Callable[[nn.Module], None], module: nn.Module, args: tuple) -> tuple | None:
    """``args`` with the tensors that need a gradient passed through an identity whose backward calls
    ``on_done(module)`` once the module's backward has produced their gradients (None: none needs a gradient)."""
    picked = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not picked:
        return None
    out = list(args)
    for i, t in zip(picked, _ModuleBackwardDone.apply(on_done, module, *(args[i] for i in picked))):
        out[i] = t
    return tuple(out)
