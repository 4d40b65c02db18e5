"""Functions ``torch.compile`` never traces: dynamo breaks the graph around them and runs them eagerly
([Note: compiled modules] in zinf/schedule/hooks.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, TypeVar

import torch

__all__ = ["not_traced", "eager_stance", "HOOKS_OUTSIDE_GRAPHS"]

# what dynamo prints where it cannot break the graph at a hook (fullgraph=True on a model zinf hooks inside)
HOOKS_OUTSIDE_GRAPHS = ("zinf gathers and releases parameters around every module it hooks, outside the graph; with "
                        "fullgraph=True compile the repeated blocks, not the whole model: "
                        "engine.compile(regional=True, fullgraph=True) or block.compile(fullgraph=True)")

F = TypeVar("F", bound=Callable[..., Any])


def not_traced(fn: F, reason: str) -> F:
    """``torch.compiler.disable(fn)``; ``reason`` is the line dynamo prints where it cannot break the graph there
    (``fullgraph=True``), on a torch that takes one (2.7 on)."""
    try:
        return torch.compiler.disable(fn, reason=reason)  # type: ignore[call-arg]
    except TypeError:
        return torch.compiler.disable(fn)


def eager_stance() -> ContextManager[Any]:
    """Compiled code entered inside runs eagerly (``torch.compiler.set_stance("force_eager")``, torch 2.6 on; on an
    older torch nothing changes)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
