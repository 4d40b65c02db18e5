"""A user's torch optimizer, pointed at this rank's fp32 master shards instead of the full parameters.

Each parameter in the optimizer's param groups is replaced by a shard parameter: a view of the part
of its group's fp32 master that this rank holds (possibly empty), whose ``.grad`` is the matching
view of the fp32 gradient shard. The optimizer object itself is kept (so LR schedulers and
frameworks holding it keep working) and its hyper-parameters per param group are untouched. This is
exact for optimizers whose update is element-wise (Adam, AdamW, SGD, Adagrad, RMSprop, ...).

As in PyTorch, a parameter is stepped only when it has a gradient: a frozen parameter never (it gets
no gradient view, so no gradient shard memory and, with torch's optimizers, no state), and one that
no rank produced a gradient for since the last step (a skipped branch) not in that step (see
[Note: stepped parameters] in zinf/param/grad_flat.py). A parameter of a frozen group, which keeps no
master (see [Note: frozen groups] there), is replaced by a placeholder of its shard's size (one element,
expanded) that is never stepped.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import FlatParamGroup
from zinf.param.registry import group_of
from zinf.report import tier_of

__all__ = ["ShardedOptimizer", "NOT_ELEMENTWISE"]

# optimizers whose update couples elements of a tensor: a shard alone cannot reproduce them
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
# optimizers whose multi-tensor step gives the single-tensor loop's bits (see [Note: foreach on CPU])
_SAME_BITS_WITH_FOREACH = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@contextlib.contextmanager
def _foreach_on_cpu(optimizer: torch.optim.Optimizer, groups: Sequence[FlatParamGroup]) -> Iterator[None]:
    """[Note: foreach on CPU] With ``foreach`` left unset, torch steps CPU tensors one at a time in Python (its
    multi-tensor path is its default on CUDA only); a shard optimizer holds one view per parameter, so that loop
    costs more than the arithmetic on small shards. For the step, torch's Adam, AdamW and SGD param groups that
    leave both ``foreach`` and ``fused`` unset take the multi-tensor path, which computes the same operations in the
    same order (the same bits as the single-tensor loop: ``tests/unit/test_sharded_optimizer.py``; other optimizers
    keep their loop, not compared); the setting is put back after the step, so the optimizer's state_dict and the
    user's view of it do not change (the time saved: docs/benchmarks.md, "Measurements behind the defaults").
    ``fused=True``, where the user asks for it, is kept as asked (faster, but rounded differently)."""
    flipped = []
    if groups and groups[0].device.type == "cpu" and type(optimizer) in _SAME_BITS_WITH_FOREACH:
        flipped = [pg for pg in optimizer.param_groups if "foreach" in pg and pg["foreach"] is None
                   and not pg.get("fused") and not pg.get("differentiable")]
    for pg in flipped:
        pg["foreach"] = True
    try:
        yield
    finally:
        for pg in flipped:
            pg["foreach"] = None


class ShardedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence[FlatParamGroup]) -> None:
        name = type(optimizer).__name__
        if name in NOT_ELEMENTWISE:
            raise UnsupportedModelError(
                f"zinf: optimizer {name} couples the elements of a parameter, so it cannot step on 1/world shards. "
                "Use an element-wise optimizer (Adam, AdamW, SGD, Adagrad, RMSprop, ...)."
            )
        if any(optimizer.state.values()):
            raise UnsupportedModelError(
                "zinf: the optimizer has already taken steps (its state is not empty). Build it on the model's "
                "parameters and hand it to the engine before the first step; restore state with engine.load_state_dict."
            )
        self.optimizer = optimizer
        self.groups = list(groups)
        self.shard_params: list[nn.Parameter] = []
        self.full_params: list[nn.Parameter] = []
        self._grads: list[tuple[FlatParamGroup, int, torch.Tensor | None]] = []
        for pg in optimizer.param_groups:
            replaced = []
            for p in pg["params"]:
                group = group_of(p)
                if group is None:
                    raise UnsupportedModelError(
                        "zinf: the optimizer holds a parameter that is not part of the model given to the engine "
                        f"(shape {tuple(p.shape)}). Build the optimizer from model.parameters() of that model."
                    )
                index = group.index_of(p)
                a, b = group.layout.local_range(index)
                if group.shard_only:
                    placeholder = torch.zeros(1, dtype=torch.float32, device=group.device).expand(b - a)
                    shard = nn.Parameter(placeholder, requires_grad=False)
                else:
                    assert group.master is not None, f"{group.name}: a device-tier optimizer needs the master in the group"
                    shard = nn.Parameter(group.master[a:b], requires_grad=p.requires_grad)
                self._grads.append((group, index, group.grad.tensor()[a:b] if p.requires_grad else None))
                replaced.append(shard)
                self.shard_params.append(shard)
                self.full_params.append(p)
            pg["params"] = replaced

    def step(self) -> None:
        for g in self.groups:  # unscale / clip, one multiply each, before torch reads the gradients
            g.grad.apply_pending()
        # set every time: a zero_grad(set_to_none=True) in user code must not detach the shards
        for s, (group, index, grad) in zip(self.shard_params, self._grads):
            s.grad = grad if grad is not None and bool(group.grad_in.used[index]) else None
        with _foreach_on_cpu(self.optimizer, self.groups):
            self.optimizer.step()
        for g in self.groups:
            if not g.shard_only:
                g.master_shard.refresh_shard()  # the storage-dtype shard follows the fp32 master
                g.zero_grad()

    def wait(self) -> None:
        return None

    def follow(self, order: Sequence[FlatParamGroup]) -> None:
        return None  # stepped on the training thread, before the next forward starts: the order changes nothing

    def before_backward(self) -> None:
        return None

    def after_backward(self) -> None:
        return None

    def on_grad_complete(self, group: FlatParamGroup) -> None:
        return None

    def drop_gradients(self) -> None:
        return None

    def quiesce(self) -> None:
        return None

    def close(self) -> None:
        return None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    # -- portable state (see [Note: portable optimizer state] in zinf/optim/protocol.py) ----------------
    def _members(self, group: FlatParamGroup) -> list[tuple[int, nn.Parameter]]:
        """(slot index, shard parameter) of every optimizer parameter in ``group``."""
        return [(group.index_of(full), shard) for shard, full in zip(self.shard_params, self.full_params)
                if group_of(full) is group]

    def state_meta(self) -> dict[str, Any]:
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        scalars = []
        for g in self.groups:
            per_param: list[dict[str, Any] | None] = [None] * len(g.slots)
            for index, shard in self._members(g):
                state = self.optimizer.state.get(shard)
                if state:
                    per_param[index] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                                        for k, v in state.items()
                                        if not _is_elementwise(v, shard)}
            scalars.append(per_param)
        return {"param_groups": hyper, "scalars": scalars}

    def state_keys(self, group: FlatParamGroup) -> list[str]:
        keys: dict[str, None] = {}
        for _, shard in self._members(group):
            for k, v in self.optimizer.state.get(shard, {}).items():
                if _is_elementwise(v, shard):
                    keys[k] = None
        return list(keys)

    def group_state(self, group: FlatParamGroup) -> dict[str, torch.Tensor]:
        out = {k: torch.zeros(group.shard_numel, dtype=torch.float32) for k in self.state_keys(group)}
        for index, shard in self._members(group):
            a, b = group.layout.local_range(index)
            for k, v in self.optimizer.state.get(shard, {}).items():
                if k in out and b > a:
                    out[k][a:b] = v.detach().reshape(-1).to("cpu", torch.float32)
        return out

    def state_dtype(self, group: FlatParamGroup, key: str) -> torch.dtype:
        return torch.float32

    def check_state(self, meta: dict[str, Any], keys: list[list[str]]) -> None:
        saved = meta["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"zinf: the checkpoint's optimizer has {len(saved)} parameter groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups.")

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        self.check_state(meta, [])
        saved = meta["param_groups"]
        self._loading: dict[int, dict[str, Any]] = {}
        self._loading_hyper = saved
        for g, scalars in zip(self.groups, meta["scalars"]):
            for index, shard in self._members(g):
                if scalars[index] is not None:  # {}: state that is all per-element (SGD's momentum buffer)
                    self._loading[id(shard)] = dict(scalars[index])

    def load_group_state(self, group: FlatParamGroup, states: dict[str, torch.Tensor]) -> None:
        for index, shard in self._members(group):
            if id(shard) in self._loading:
                a, b = group.layout.local_range(index)
                self._loading[id(shard)].update({k: v[a:b].clone().view(shard.shape) for k, v in states.items()})

    def finish_load(self) -> None:
        """Hand the collected state to the torch optimizer's own ``load_state_dict`` (which casts each value as it
        does for its own checkpoints: ``step`` stays a host float tensor, moments follow the parameter)."""
        ids = {id(p): i for i, p in enumerate(p for pg in self.optimizer.param_groups for p in pg["params"])}
        state = {ids[pid]: {k: torch.tensor(float(v)) if k == "step" and not isinstance(v, torch.Tensor) else v
                            for k, v in values.items()}
                 for pid, values in self._loading.items()}
        groups, start = [], 0
        for pg, hyper in zip(self.optimizer.param_groups, self._loading_hyper):
            groups.append({**hyper, "params": list(range(start, start + len(pg["params"])))})
            start += len(pg["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        del self._loading, self._loading_hyper

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    kinds = out.setdefault(tier_of(v), {})
                    kinds["optimizer_state"] = kinds.get("optimizer_state", 0) + v.untyped_storage().nbytes()
        return out


def _is_elementwise(value: Any, shard: torch.Tensor) -> bool:
    """Whether an optimizer state value is per element of its parameter (a moment) rather than a scalar (a step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape
