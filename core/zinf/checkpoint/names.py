"""The names a state dict uses for a module's tensors: every name of each parameter (tied weights under all of
theirs, as ``state_dict()``), and the persistent buffers only (a non-persistent buffer is never saved or loaded)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["param_names", "persistent_buffers"]


def param_names(module: nn.Module) -> dict[int, list[str]]:
    """For each parameter (by id), all its names in ``module``, in ``named_parameters`` order."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def persistent_buffers(module: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds, by name (found without calling it: a front end may refuse it on a
    partitioned model)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mname, m in module.named_modules(remove_duplicate=False):
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set or (remove_duplicate and id(b) in seen):
                continue
            seen.add(id(b))
            out[f"{mname}.{bname}" if mname else bname] = b
    return out
