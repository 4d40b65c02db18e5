"""``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a model a zinf engine trains.

[Note: torch's clip on a zinf model]
A managed parameter's gradient lives in its group's gradient shard, so its ``p.grad`` is None after
``engine.backward``: torch's own function would find no gradient, return 0 and clip nothing, and the run would
silently train differently from DDP. The first engine built routes torch's function (``torch.nn.utils`` re-exports
the one defined in ``torch.nn.utils.clip_grad``; both names, and the deprecated ``clip_grad_norm`` that calls it, are
routed) through :func:`clip_grad_norm_` here, once per process:

- parameters of no live engine (built and not closed): torch's own function, unchanged (with no live engine the
  arguments are handed over as given);
- exactly the trainable parameters of one live engine, in any order, with any of its frozen parameters and any
  other tensor without a gradient (which torch would skip): ``engine.clip_grad_norm_(max_norm)``, the global
  norm over every rank's shards (zinf/update/clip.py), returned as torch returns it;
- a strict subset of an engine's trainable parameters, several engines' parameters, an engine's parameters with
  other tensors that have gradients, or a norm other than 2: an ``UnsupportedModelError`` naming the fix.

The routing replaces the module attributes: a name bound to torch's function before the first engine is built
(``from torch.nn.utils import clip_grad_norm_`` at the top of a script) still calls torch's own.

Each parameter is looked up in the group registry (zinf/param/registry.py), and its group in this module's table
of the live engines' groups, which holds the engines weakly.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.nn.utils.clip_grad
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import group_of

__all__ = ["track", "clip_grad_norm_"]


class ClippedEngine(Protocol):
    closed: bool
    params: list[nn.Parameter]
    groups: list[FlatParamGroup]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def grad_norm(self) -> torch.Tensor: ...


_engines: "weakref.WeakSet[ClippedEngine]" = weakref.WeakSet()
# id of a group -> the engine training it; an entry goes with its engine, which holds the group until then
_engine_of_group: "weakref.WeakValueDictionary[int, ClippedEngine]" = weakref.WeakValueDictionary()
_original: Callable[..., torch.Tensor] | None = None

_FIX = ("pass all of model.parameters(), or call engine.clip_grad_norm_(max_norm) (Lightning: "
        "self.clip_gradients(optimizer, gradient_clip_val=max_norm); Accelerate: accelerator.clip_grad_norm_)")


def track(engine: ClippedEngine) -> None:
    """Route torch's ``clip_grad_norm_`` of ``engine``'s parameters to it until it is closed ([Note: torch's clip
    on a zinf model])."""
    global _original
    if _original is None:
        _original = torch.nn.utils.clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    _engines.add(engine)
    for g in engine.groups:
        _engine_of_group[id(g)] = engine


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, routed to the engine that trains ``parameters`` ([Note: torch's clip on a zinf
    model] in zinf/update/torch_clip.py); torch's own for tensors of no live engine."""
    assert _original is not None
    if not any(not e.closed for e in _engines):
        return _original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_for(given)
    if engine is None:  # a generator stays one, for torch's warning about an empty one
        again: Any = (p for p in given) if isinstance(parameters, types.GeneratorType) else given
        return _original(again, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise UnsupportedModelError(
            f"zinf: torch.nn.utils.clip_grad_norm_(norm_type={norm_type}) on a zinf model: only the 2-norm is "
            f"computed over the ranks' gradient shards. Use norm_type=2.")
    with torch.no_grad():
        if error_if_nonfinite:
            total = engine.grad_norm()
            if not torch.isfinite(total):  # torch's check and words, before anything is clipped
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so "
                    "it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                    "anyway, set `error_if_nonfinite=False`")
        return engine.clip_grad_norm_(float(max_norm))


def _engine_for(given: list[torch.Tensor]) -> ClippedEngine | None:
    """The live engine whose trainable parameters ``given`` holds, all of them; None for tensors of no live engine."""
    found: dict[int, ClippedEngine] = {}
    mine: set[int] = set()  # the given trainable parameters of an engine
    others = False  # a tensor of no live engine with a gradient
    for p in given:
        g = group_of(p)
        e = _engine_of_group.get(id(g)) if g is not None else None
        if e is None or e.closed:
            others = others or p.grad is not None
            continue
        found[id(e)] = e
        if p.requires_grad:
            mine.add(id(p))
    if not found:
        return None
    if len(found) > 1:
        raise UnsupportedModelError(
            f"zinf: torch.nn.utils.clip_grad_norm_ was given the parameters of {len(found)} zinf engines; each "
            f"engine clips the global norm of its own model. Clip each model on its own: {_FIX}.")
    if not mine:  # only frozen parameters, which have no gradient: torch clips nothing
        return None
    (engine,) = found.values()
    trainable = {id(p) for p in engine.params if p.requires_grad}
    if mine != trainable or others:
        what = f"{len(mine)} of its {len(trainable)} trainable parameters"
        raise UnsupportedModelError(
            f"zinf: torch.nn.utils.clip_grad_norm_ was given {what}"
            f"{' and tensors of no zinf engine that have gradients' if others else ''}; a zinf engine clips the "
            f"global norm of its whole model (every rank holds a slice of each gradient): {_FIX}.")
    return engine
