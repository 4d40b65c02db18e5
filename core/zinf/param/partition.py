"""Turning a model's parameters into flat groups, one per owning module, and finding who needs what.

Used by ``zinf.Init`` while a model is built (each module is partitioned once its own ``__init__``
has finished) and by the engine for an already-built model or to reconcile groups after
construction-time edits (a tied weight replaced a parameter, a parameter was added later).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.runtime.comm import Comm
from zinf.param import module_moves
from zinf.param.flat_group import FlatParamGroup
from zinf.param.eight_bit import QuantizedFormat
from zinf.param.registry import group_of, groups_of, register_group, unregister
from zinf.param.gathered import gather_full_master

__all__ = ["check_model", "partition_module_params", "partition_model", "module_groups", "agree_with_rank0"]

log = logging.getLogger(__name__)
_warned_disagreement = False
_FINGERPRINT_CHUNK = 1 << 18  # elements


def agree_with_rank0(values: Sequence[torch.Tensor], comm: Comm, what: str) -> bool:
    """[Note: initial values agree] Make ``values`` (full tensors every rank holds) equal rank 0's, as DDP does when
    it wraps a model: ranks seeded differently before building the model would otherwise each keep a slice of
    their own model, and train one that no rank ever built. A fingerprint (each tensor's bits read as integers,
    summed in int64: exact and independent of the summation order) is compared across ranks with two all-reduces;
    only on a difference are the values broadcast from rank 0. Returns True when they were. Every rank calls it with
    the same tensors (collective)."""
    global _warned_disagreement
    if comm.world == 1 or not values:
        return False
    prints = torch.stack([_fingerprint(v) for v in values]).to(comm.device)
    low, high = comm.all_reduce(prints.clone(), "min"), comm.all_reduce(prints.clone(), "max")
    if torch.equal(low, high):
        return False
    for v in values:
        comm.broadcast(v, src=0)
    if not _warned_disagreement:
        _warned_disagreement = True
        log.warning("zinf: the ranks built different initial values for %s (seeded differently before the model was "
                    "built?); every rank now uses rank 0's, as DDP does. Seed every rank alike to avoid the broadcast.",
                    what)
    return True


def _fingerprint(v: torch.Tensor) -> torch.Tensor:
    flat = v.detach().reshape(-1)
    if flat.is_floating_point() and flat.element_size() in (2, 4, 8):
        bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    else:
        bits = flat
    # summed a chunk at a time: the int64 copy of a whole tensor would double a large module's memory
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for chunk in bits.split(_FINGERPRINT_CHUNK):
        total += chunk.sum(dtype=torch.int64)
    return total + flat.numel()


def check_model(model: nn.Module) -> None:
    """Refuse parameters zinf cannot partition, naming the fix."""
    for name, p in model.named_parameters():
        if type(p).__name__ in ("Params4bit", "Int8Params"):  # bitsandbytes' packed codes, quantized before zinf
            raise UnsupportedModelError(
                f"zinf: parameter '{name}' was quantized by bitsandbytes ({type(p).__name__}) before zinf saw the model. "
                "Load it with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) under "
                "zinf.Init or `zinf launch`, where zinf stores the base in 4 bits itself (docs/qlora.md).")
        if p.is_sparse or (hasattr(p, "is_meta") and p.is_meta and p.numel() > 0):
            raise UnsupportedModelError(
                f"zinf: parameter '{name}' is sparse or on the meta device; zinf needs dense, materialised "
                "parameters (build the model under zinf.Init instead of on the meta device).")


def _direct_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]


def partition_module_params(
    module: nn.Module, name: str, comm: Comm, compute_dtype: torch.dtype, device: torch.device,
    only: set[int] | None = None, storage_dtype: torch.dtype | None = None, agree: bool = True,
    placeholders: bool = False, quantized: QuantizedFormat | None = None,
) -> FlatParamGroup | None:
    """Group the direct parameters of ``module`` that no group holds yet (or the ids in ``only``). With ``agree``
    their values are first made equal to rank 0's (see [Note: initial values agree]); ``zinf.Init`` turns it off
    while a loader builds placeholders that the checkpoint's values replace, and with ``placeholders`` (their shard
    goes to NVMe at once) the group keeps none of their values (see ``FlatParamGroup``)."""
    picked: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for n, p in _direct_params(module):
        if id(p) in seen or group_of(p) is not None or (only is not None and id(p) not in only):
            continue
        seen.add(id(p))
        picked.append((f"{name}.{n}" if name else n, p))
    if not picked:
        return None
    meta = [n for n, p in picked if p.is_meta]
    if meta:
        raise UnsupportedModelError(
            f"zinf: {meta[0]} is on the meta device, so it has no values to partition. Build the model under "
            "zinf.Init without torch.device('meta') (zinf partitions each module as it is built, so the whole model "
            "never exists in one place), then load weights with zinf.load_pretrained(model, path); transformers' "
            "from_pretrained does both by itself under zinf.Init.")
    if agree:
        agree_with_rank0([p.data for _, p in picked], comm, name or type(module).__name__)
    group = FlatParamGroup(
        name=name or type(module).__name__, params=[p for _, p in picked], names=[n for n, _ in picked],
        rank=comm.rank, world=comm.world, compute_dtype=compute_dtype, device=device, storage_dtype=storage_dtype,
        placeholders=placeholders, quantized=quantized,
    )
    module_moves.install()  # [Note: moving a partitioned model]
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
        compatible = (g.world == comm.world and g.compute_dtype == compute_dtype and g.device == device
                      and (g.quantized is not None or g.storage_dtype == (storage_dtype or compute_dtype)))
        if compatible and all(p is not None and id(p) in live for p in g.params):
            continue
        _dissolve(g, comm, keep=lambda p: id(p) in live)

    by_owner: dict[int, set[int]] = {}
    for pid, p in live.items():
        if group_of(p) is None:
            by_owner.setdefault(id(owner[pid][1]), set()).add(pid)
    for mname, module in model.named_modules():
        ids = by_owner.get(id(module))
        if ids:
            partition_module_params(module, mname, comm, compute_dtype, device, only=ids, storage_dtype=storage_dtype)
    return groups_of(live.values())


def _dissolve(group: FlatParamGroup, comm: Comm, keep: Callable[[nn.Parameter], bool]) -> None:
    """Give the kept parameters of ``group`` their full fp32 values back (to be regrouped); drop the group."""
    full = gather_full_master(comm, group)
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
