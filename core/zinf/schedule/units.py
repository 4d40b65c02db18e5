"""Which modules the hooks gather as one unit when the engine is built: the configured ``unit_modules`` and,
with ``unit_policy="blocks"``, the model's repeated blocks.

[Note: blocks as units]
Gathering module by module gives the smallest working memory, and costs a gather, a round (with several
ranks, see [Note: rounds] in zinf/schedule/rounds.py) and the hooks' Python work for every module: a
transformer block is six to ten modules, two of them LayerNorms of a few hundred elements. FSDP2 users
wrap each block (``fully_shard(block)``), DeepSpeed users set a persistence threshold; zinf finds the
blocks itself:

- a transformers model names its block classes in ``_no_split_modules`` (``GPT2Block``,
  ``LlamaDecoderLayer``; Accelerate's FSDP auto-wrap reads the same attribute); any module of the model
  (a PEFT wrapper's inner model too) may carry it;
- without that (or when none of the named classes is in the model), the children of an ``nn.ModuleList`` /
  ``nn.Sequential`` that are all of one class, called (not containers) and with parameters in more than one
  module of their subtree (a unit of one leaf module is what module-by-module does anyway), as GPT-style
  stacks hold their blocks.

The outermost match wins (a block's own ModuleList of experts is inside the block's unit, so
mixture-of-experts routing no longer makes the ranks' gathers differ). A block stays module by module
(logged) when it contains a tiled layer (tiling exists to gather a layer a tile at a time), when its
parameters alone exceed ``overlap.max_gathered_bytes``, or, with the parameters on NVMe, when its shards read
at once would need more of the pinned staging pool than the largest single module's (the room the pool keeps
for one gather: a Llama-7B decoder layer is larger than its embedding, so it stays module by module there). A
block inside or around a configured unit is left to the configuration. Gathering a block at once keeps one
block's full parameters in memory instead of one module's, as FSDP2 does: ``unit_policy="modules"`` is the
setting for the smallest footprint.

[Note: units]
A module listed in ``unit_modules`` (or adopted by ``divergence="auto"``) is gathered as one unit: its
pre-hook (and its backward) gathers every group of its subtree at once, so whichever submodules run
inside it (mixture-of-experts routing), every rank issues the same gathers. Modules inside a unit are
left out of the traces: the order inside a unit may change from step to step without invalidating
prefetch. Units chosen when the engine is built (``unit_modules``, and the model's blocks with
``unit_policy="blocks"``: [Note: blocks as units]) carry the only hooks of their subtree
(zinf/schedule/hooks.py): the modules inside have none, so a block costs one pre-hook, one post-hook and one
backward announcement, not one per module. A parameter a module inside uses from outside the unit is gathered
with the unit (``ModuleHooks.on_external`` sees the unit as the running module). With ``divergence="auto"``,
when ranks disagreed on gathers during a forward pass, the ranks compare which modules each called
(:class:`UnitAdoption`); for each module called on some ranks only, its nearest ancestor that every rank called
(the same number of times) becomes a unit, logged, from the next pass on. The root never becomes a unit (that
would gather the whole model): such divergence stays served round by round, which is exact too.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Callable

import torch
from torch import nn

from zinf.config import ZeroConfig
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import groups_of
from zinf.runtime.comm import Comm
from zinf.schedule.pass_state import ModuleState
from zinf.tiling import TiledLinear
from zinf.units import format_bytes

__all__ = ["choose_units", "is_called", "make_unit", "repeated_blocks", "UnitAdoption"]

log = logging.getLogger(__name__)


def _block_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if isinstance(listed, (list, tuple, set)):
            names |= {n for n in listed if isinstance(n, str)}
    return names


def _holders(module: nn.Module) -> int:
    """How many modules of ``module``'s subtree hold parameters of their own."""
    return sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None)


def is_called(module: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict) have no forward of their own and are never called."""
    return type(module).forward is not nn.Module.forward


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (see [Note: blocks as units]), outermost first, in module order."""
    classes = _block_classes(model)
    found = [m for m in model.modules() if m is not model and type(m).__name__ in classes]
    if not found:  # no transformers block classes, or none of them in this model
        for container in model.modules():
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                continue
            kids = list(container.children())
            if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and is_called(kids[0]):
                found += kids
    return [m for m in found if m is not model and _holders(m) > 1]


def choose_units(model: nn.Module, config: ZeroConfig, names: dict[nn.Module, str],
                 stages: Callable[[list[FlatParamGroup]], bool] = lambda groups: True) -> list[nn.Module]:
    """The modules to gather as one unit, outermost first; none is inside another. ``stages(groups)``: whether the
    NVMe staging pool has room to read ``groups`` at once (``Placement.stages_like_one_group``)."""
    chosen: list[nn.Module] = []
    covered: set[int] = set()  # ids of modules inside a chosen unit

    def take(module: nn.Module) -> None:
        chosen.append(module)
        covered.update(id(m) for m in module.modules())

    for module, name in names.items():
        if id(module) not in covered and any(fnmatch.fnmatchcase(name, p) or type(module).__name__ == p
                                             for p in config.unit_modules):
            take(module)
    if config.unit_policy != "blocks":
        return chosen
    configured = set(covered)  # the modules of the configured units
    limit = config.overlap.max_gathered_bytes
    apart: dict[str, list[nn.Module]] = {}  # why blocks are gathered module by module: one log line each

    for block in repeated_blocks(model):
        if id(block) in covered or any(id(m) in configured for m in block.modules()):
            continue
        if any(isinstance(m, TiledLinear) for m in block.modules()):
            apart.setdefault("hold a tiled layer: gathered module by module (tile by tile)", []).append(block)
            continue
        groups = groups_of(block.parameters())
        nbytes = sum(g.nbytes_full for g in groups)
        if limit and nbytes > limit:
            apart.setdefault(f"need more than overlap.max_gathered_bytes ({format_bytes(limit)}) gathered at once: "
                             "gathered module by module", []).append(block)
            continue
        if not stages(groups):
            apart.setdefault("have shards whose reads from NVMe at once need more of the pinned staging pool than the "
                             "largest single module's, the room each gather is sure of (a larger pool does not change "
                             "it): gathered module by module", []).append(block)
            continue
        take(block)
    for why, blocks in apart.items():
        kinds = sorted({type(b).__name__ for b in blocks})
        shown = ", ".join(names[b] for b in blocks[:3]) + (f", ... {names[blocks[-1]]}" if len(blocks) > 3 else "")
        log.info("zinf: %d block(s) (%s: %s) %s", len(blocks), "/".join(kinds), shown, why)
    order = {id(m): i for i, m in enumerate(names)}
    return sorted(chosen, key=lambda m: order[id(m)])


def make_unit(states: dict[nn.Module, ModuleState], module: nn.Module) -> None:
    """Gather ``module`` as one unit from now on (see [Note: units])."""
    states[module].become_unit(groups_of(module.parameters()))
    for sub in module.modules():
        if sub is not module:
            states[sub].enclose()


class UnitAdoption:
    """With ``divergence="auto"``: the forward calls of each module in the running pass, and the units adopted from
    them once the ranks diverged (see [Note: units])."""

    def __init__(self, model: nn.Module, states: dict[nn.Module, ModuleState], comm: Comm) -> None:
        self.model = model
        self.states = states
        self.comm = comm
        self.parent: dict[nn.Module, nn.Module] = {}
        for module in states:
            for child in module.children():
                self.parent.setdefault(child, module)
        self._refused: set[str] = set()  # modules logged as left to rounds (their nearest common caller is the root)

    def new_pass(self) -> None:
        for state in self.states.values():
            state.new_pass()

    def adopt(self) -> bool:
        """The ranks' gathers diverged in this forward pass: make units of what they called differently (collective:
        every rank calls it at the same point). True if any unit was adopted."""
        # on the host: see [Note: host-side agreement] in zinf/runtime/comm.py
        calls = [0] * len(self.states)  # forward calls per module in this pass, by module index
        for state in self.states.values():
            calls[state.index] = state.calls
        counts = torch.tensor(calls, dtype=torch.int64)
        low, high = counts.clone(), counts.clone()
        self.comm.host_all_reduce(low, op="min")
        self.comm.host_all_reduce(high, op="max")
        varies = {m for m, s in self.states.items() if int(low[s.index]) != int(high[s.index])}
        adopted: dict[nn.Module, list[str]] = {}
        for start in varies:
            if not self.states[start].groups and self.states[start].unit is None:
                continue  # neither holds parameters nor gathers a subtree
            module: nn.Module | None = start
            while module is not None and (module in varies or not is_called(module)
                                          or int(high[self.states[module].index]) == 0):
                module = self.parent.get(module)
            if module is None or module is self.model:
                name = self.states[start].name
                if name not in self._refused:
                    self._refused.add(name)
                    log.info("zinf: %s runs on some ranks only and the nearest module every rank calls is the root, "
                             "which is not gathered as one unit: its gathers stay agreed round by round (exact, one "
                             "small exchange each)", name)
                continue
            state = self.states[module]
            if state.unit is None and not state.inside_unit:
                adopted.setdefault(module, []).append(self.states[start].name)
        for module in sorted(adopted, key=lambda m: self.states[m].index):
            if self.states[module].inside_unit:  # an ancestor adopted in this same pass covers it
                continue
            make_unit(self.states, module)
            log.info("zinf: %s (%s) runs different submodules on different ranks (%s); gathering and reducing it "
                     "as one unit from now on (set unit_modules to choose units yourself)",
                     self.states[module].name, type(module).__name__, ", ".join(sorted(adopted[module])[:4]))
        return bool(adopted)
