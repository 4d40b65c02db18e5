"""Turning a model's parameters into flat groups, one per owning module, and finding who needs what.

Used by ``zinf.Init`` while a model is built (each module is partitioned once its own ``__init__``
has finished) and by the engine for an already-built model or to reconcile groups after
construction-time edits (a tied weight replaced a parameter, a parameter was added later).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from zinf.fetch.comm import Comm
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import group_of, groups_of, register_group, unregister

__all__ = ["partition_module_params", "partition_model", "module_groups"]

log = logging.getLogger(__name__)


def _direct_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]


def partition_module_params(
    module: nn.Module, name: str, comm: Comm, compute_dtype: torch.dtype, device: torch.device,
    only: set[int] | None = None, storage_dtype: torch.dtype | None = None,
) -> FlatParamGroup | None:
    """Group the direct parameters of ``module`` that no group holds yet (or the ids in ``only``)."""
    picked: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for n, p in _direct_params(module):
        if id(p) in seen or group_of(p) is not None or (only is not None and id(p) not in only):
            continue
        seen.add(id(p))
        picked.append((f"{name}.{n}" if name else n, p))
    if not picked:
        return None
    group = FlatParamGroup(
        name=name or type(module).__name__, params=[p for _, p in picked], names=[n for n, _ in picked],
        comm=comm, compute_dtype=compute_dtype, device=device, storage_dtype=storage_dtype,
    )
    return register_group(group)


def partition_model(model: nn.Module, comm: Comm, compute_dtype: torch.dtype, device: torch.device,
                    storage_dtype: torch.dtype | None = None) -> list[FlatParamGroup]:
    """Make every parameter of ``model`` belong to exactly one valid group; return the groups in model order.

    Groups made under ``zinf.Init`` are kept when all their parameters are still in the model and
    their layout matches (world size, dtypes, device). Otherwise their live parameters are gathered
    and regrouped; parameters no group holds are grouped by their first owning module.
    """
    owner: dict[int, tuple[str, nn.Module]] = {}
    live: dict[int, nn.Parameter] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for _, p in _direct_params(module):
            if id(p) not in owner:
                owner[id(p)] = (mname, module)
                live[id(p)] = p

    for g in groups_of(live.values()):
        compatible = (g.comm.world == comm.world and g.compute_dtype == compute_dtype and g.device == device
                      and g.storage_dtype == (storage_dtype or compute_dtype))
        if compatible and all(p is not None and id(p) in live for p in g.params):
            continue
        _dissolve(g, keep=lambda p: id(p) in live)

    by_owner: dict[int, set[int]] = {}
    for pid, p in live.items():
        if group_of(p) is None:
            by_owner.setdefault(id(owner[pid][1]), set()).add(pid)
    for mname, module in model.named_modules():
        ids = by_owner.get(id(module))
        if ids:
            partition_module_params(module, mname, comm, compute_dtype, device, only=ids, storage_dtype=storage_dtype)
    return groups_of(live.values())


def _dissolve(group: FlatParamGroup, keep: Callable[[nn.Parameter], bool]) -> None:
    """Give the kept parameters of ``group`` their full fp32 values back (to be regrouped); drop the group."""
    full = group.gather_master_full()
    for p, slot in zip(group.params, group.slots):
        if p is None:
            continue
        unregister(p)
        if keep(p):
            p.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    log.debug("regrouped the parameters of %s", group.name)


def module_groups(model: nn.Module) -> dict[nn.Module, list[FlatParamGroup]]:
    """For each module, the groups holding its direct parameters (its own and shared ones)."""
    return {m: groups_of(p for _, p in _direct_params(m)) for m in model.modules()}
