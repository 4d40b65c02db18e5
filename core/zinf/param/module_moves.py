"""``model.to(device)``, ``.cpu()``, ``.float()`` and the rest of ``nn.Module._apply`` on a partitioned model.

[Note: moving a partitioned model]
A partitioned parameter's ``.data`` is a placeholder: one NaN element seen through zero strides at the
parameter's full shape (zinf/param/flat_group.py). ``_apply`` hands every parameter to a function such as
``t.to(device)``, and a copy of the placeholder is a dense tensor of the full shape: the whole model, on every
rank. Scripts written for DDP do this before training starts (transformers' ``Trainer`` moves the model to
``args.device``, which is ``cpu:0`` under a launcher, and torch copies a ``cpu`` tensor to ``cpu:0``); the copies
are replaced at the first gather, too late for peak memory, and a copy of a persistent group's gathered
parameter would no longer be the buffer the engine updates. zinf decides where each shard lives, so ``_apply``
leaves zinf's parameters alone when the function would keep their device and dtype (the call is a no-op for
them, as it is for a parameter already in place), and refuses one that would move or cast them, naming the
setting that does it instead. Buffers and parameters zinf does not hold are converted as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.registry import group_of

__all__ = ["install"]

_original: Callable[..., Any] | None = None


def install() -> None:
    """Route ``nn.Module._apply`` through :func:`_apply` (once per process)."""
    global _original
    if _original is None:
        _original = nn.Module._apply
        nn.Module._apply = _apply  # type: ignore[method-assign]


def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    assert _original is not None
    held = [(name, p) for name, p in self._parameters.items() if p is not None and group_of(p) is not None]
    if not held:
        return _original(self, fn, recurse)
    for name, p in held:
        _check_in_place(self, name, p, fn)
    for name, _ in held:  # torch's _apply skips a None parameter; the order of the dict is kept
        dict.__setitem__(self._parameters, name, None)
    try:
        return _original(self, fn, recurse)
    finally:
        for name, p in held:
            dict.__setitem__(self._parameters, name, p)


def _check_in_place(module: nn.Module, name: str, p: nn.Parameter, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise unless ``fn`` keeps ``p``'s device and dtype (tried on an empty tensor like it)."""
    probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
    if probe.device == p.device and probe.dtype == p.dtype:
        return
    what = type(module).__name__ + "." + name
    if probe.dtype != p.dtype:
        raise UnsupportedModelError(
            f"zinf: a {p.dtype} -> {probe.dtype} cast of a partitioned model ({what}): its shards keep the dtype "
            f"they were built with. Set the precision in the zinf config (precision: bf16 or fp16, param_storage) "
            f"instead of casting the model, or cast it before it is partitioned.")
    raise UnsupportedModelError(
        f"zinf: moving a partitioned model to {probe.device} ({what} is on {p.device}): zinf places its shards "
        f"itself. Remove the .to()/.cuda() call, or build the model under zinf.Init (or zinf launch) on the device "
        f"you want.")
