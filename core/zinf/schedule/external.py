"""Parameters used outside the module that owns them, found while the forward pass runs.

A torch function mode sees every tensor operation of the forward pass. When one of its arguments
is a zinf parameter whose group is not gathered (a tied weight read by the parent, a child's
weight used by a sibling), the group is gathered on behalf of the innermost running module, held
until that module's forward ends, and remembered as that module's external group so that its
backward (and later forwards) gather it up front. Both watches tell an :class:`ExternalSink` (the engine's
``ModuleHooks``, whose ``on_external`` does the gathering).

[Note: external parameters, paid once]
The mode costs a Python call for every tensor operation of the forward, and what it finds is the same from
step to step once the module order is: it runs while a pass's trace is being recorded (the first step, and
again whenever the order changed or units were adopted). Once the order replays, the forward gathers each
module's known external groups up front, and only parameter lookups are watched (:class:`ParamLookups`:
``module.weight`` goes through the module's parameter dict): a lookup of a parameter whose group is not
gathered gathers it for the running module, as the mode would. What lookups do not see is a parameter kept
elsewhere than its module (a plain list built at construction) and used outside its module for the first
time after the recorded step; ``detect_external_params`` catches such uses in the recorded step only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.registry import group_of

__all__ = ["ExternalParamMode", "ExternalSink", "ParamLookups"]


class ExternalSink(Protocol):
    """What the watches tell of an external use: ``busy`` (non-zero while the engine's own hook code runs, whose
    uses are not the model's) and ``on_external(group)``, called for a use of a parameter whose group is not
    gathered."""

    @property
    def busy(self) -> int: ...

    def on_external(self, group: FlatParamGroup) -> None: ...


class ExternalParamMode(TorchFunctionMode):
    def __init__(self, hooks: ExternalSink) -> None:
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # ``types`` does not list nn.Parameter (its torch function is the disabled default), so every
        # call's arguments are scanned; the engine's own ``p.data = ...`` in hook bodies is not a use
        # inside a compiled region the watch is not traced: see [Note: compiled modules] in zinf/schedule/hooks.py
        if not self.hooks.busy and not torch.compiler.is_compiling():
            self._scan(args)
            if kwargs:
                self._scan(kwargs.values())
        return func(*args, **(kwargs or {}))

    def _scan(self, values: Any) -> None:
        for a in values:
            if isinstance(a, (list, tuple)):
                self._scan(a)
            elif type(a) is Parameter:
                g = group_of(a)
                if g is not None and g.state is not GroupState.GATHERED:
                    self.hooks.on_external(g)


Parameter = nn.Parameter


class _WatchedParameters(dict):
    """A module's parameter dict whose lookups (``Module.__getattr__``) are told to :class:`ParamLookups`."""

    __slots__ = ("_lookups",)

    def __init__(self, items: dict, lookups: "ParamLookups") -> None:
        super().__init__(items)
        self._lookups = lookups

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if self._lookups.armed and value is not None and not torch.compiler.is_compiling():
            self._lookups.seen(value)
        return value

    def __reduce__(self) -> Any:  # a copy or a pickle of the module carries a plain dict
        return (dict, (dict(self),))


class ParamLookups:
    """Watches parameter lookups during a forward whose module order replays (see [Note: external parameters,
    paid once]). ``install`` puts a watched dict on every module that owns parameters; ``remove`` puts the plain
    ones back."""

    def __init__(self, hooks: ExternalSink, model: nn.Module) -> None:
        self.hooks = hooks
        self.armed = False
        self._modules = [m for m in model.modules() if m._parameters]

    def install(self) -> None:
        for m in self._modules:
            if not isinstance(m._parameters, _WatchedParameters):
                m.__dict__["_parameters"] = _WatchedParameters(m._parameters, self)

    def remove(self) -> None:
        for m in self._modules:
            if isinstance(m._parameters, _WatchedParameters):
                m.__dict__["_parameters"] = dict(m._parameters)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    def seen(self, value: Any) -> None:
        if self.hooks.busy or type(value) is not Parameter:
            return
        g = group_of(value)
        if g is not None and g.state is not GroupState.GATHERED:
            self.hooks.on_external(g)
