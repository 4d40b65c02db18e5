"""The offloaded CPU-Adam's state in checkpoints: its moments, per-parameter step counts and hyper-parameters,
in its own layout (``state_dict``) and in the portable one (see [Note: portable optimizer state] in
zinf/optim/protocol.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zinf.offload.subgroups import hyper_index

if TYPE_CHECKING:
    from zinf.offload.nvme_state_store import NvmeStateStore
    from zinf.offload.state_store import CpuStateStore, StateStore
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["OffloadedAdamState", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state proper; the stores also hold the fp32 master


class OffloadedAdamState:
    """The checkpoint methods of :class:`zinf.optim.offloaded.OffloadedAdam`, a subclass, which holds the
    attributes below and waits for a step in flight (``wait``)."""

    optimizer: torch.optim.Optimizer
    groups: list["FlatParamGroup"]
    states: "CpuStateStore | NvmeStateStore"
    steps: dict[int, list[int | None]]

    def wait(self) -> None:
        raise NotImplementedError

    def home(self, group: "FlatParamGroup") -> "StateStore":
        raise NotImplementedError

    # -- state for checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.wait()
        moments = [self.home(g).read_states(g) for g in self.groups]
        # the hyper-parameters too, as torch's optimizers do: an LR scheduler restored on its own does not set the
        # optimizer's current lr, so a resumed run would take its first step with the lr the optimizer was built with
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        return {"param_steps": [list(self.steps[id(g)]) for g in self.groups], "param_groups": hyper,
                "exp_avg": [m["exp_avg"] for m in moments], "exp_avg_sq": [m["exp_avg_sq"] for m in moments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait()
        saved = state.get("param_groups")  # absent in checkpoints written before it was saved
        if saved is not None:
            if len(saved) != len(self.optimizer.param_groups):
                raise ValueError(f"zinf: the checkpoint's optimizer has {len(saved)} parameter groups, this optimizer "
                                 f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups.")
            for pg, values in zip(self.optimizer.param_groups, saved):
                pg.update({k: v for k, v in values.items() if k != "params"})
        if "param_steps" in state:
            for g, steps in zip(self.groups, state["param_steps"]):
                self.steps[id(g)] = list(steps)
        else:  # written before steps were counted per parameter: one count per optimizer param group
            hyper = hyper_index(self.optimizer)
            for g in self.groups:
                self.steps[id(g)] = [None if n is None else int(state["steps"][hyper[id(p)]])
                                     for n, p in zip(self.steps[id(g)], g.params)]
        for g, m, v in zip(self.groups, state["exp_avg"], state["exp_avg_sq"]):
            self.home(g).write_states(g, {"exp_avg": m, "exp_avg_sq": v})

    # -- portable state (see [Note: portable optimizer state] in zinf/optim/protocol.py) ----------------
    def state_meta(self) -> dict[str, Any]:
        self.wait()
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        scalars = [[None if not n else {"step": n} for n in self.steps[id(g)]] for g in self.groups]
        return {"param_groups": hyper, "scalars": scalars}

    def state_keys(self, group: "FlatParamGroup") -> list[str]:
        return list(MOMENTS) if any(n is not None for n in self.steps[id(group)]) else []

    def group_state(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        if not self.state_keys(group):
            return {}
        self.wait()
        states = self.home(group).read_states(group)
        return {k: states[k] for k in MOMENTS}  # the master is saved with the parameters

    def state_dtype(self, group: "FlatParamGroup", key: str) -> torch.dtype:
        """bf16 moments as bf16, int8 ones decoded to fp32 (``StateLayout.checkpoint_dtype``)."""
        return self.home(group).layout.checkpoint_dtype(key)

    def check_state(self, meta: dict[str, Any], keys: list[list[str]]) -> None:
        saved = meta["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"zinf: the checkpoint's optimizer has {len(saved)} parameter groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups.")
        extra = sorted({k for scalars in meta["scalars"] for s in scalars if s for k in s} - {"step"})
        if extra:
            raise ValueError(f"zinf: the checkpoint's optimizer state has per-parameter {extra}, which the "
                             "offloaded CPU-Adam does not keep: it was written by another optimizer. Load it with "
                             "that optimizer (offload.optimizer='device').")
        unknown = sorted({k for group_keys in keys for k in group_keys} - set(MOMENTS))
        if unknown:
            raise ValueError(f"zinf: the checkpoint's optimizer state {unknown} is not Adam's; the offloaded CPU-Adam "
                             "cannot continue it. Load it with the optimizer that wrote it (offload.optimizer='device').")

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        self.wait()
        self.check_state(meta, [])
        for pg, values in zip(self.optimizer.param_groups, meta["param_groups"]):
            pg.update({k: v for k, v in values.items() if k != "params"})
        for g, scalars in zip(self.groups, meta["scalars"]):
            self.steps[id(g)] = [None if n is None else int(s["step"]) if s else 0
                                 for n, s in zip(self.steps[id(g)], scalars)]

    def load_group_state(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        if not self.state_keys(group):
            return
        unknown = sorted(set(states) - set(MOMENTS))
        if unknown:
            raise ValueError(f"zinf: the checkpoint's optimizer state {unknown} is not Adam's; the offloaded CPU-Adam "
                             "cannot continue it. Load it with the optimizer that wrote it (offload.optimizer='device').")
        zeros = torch.zeros(group.shard_numel, dtype=torch.float32)
        self.home(group).write_states(group, {k: states.get(k, zeros) for k in MOMENTS})

    def finish_load(self) -> None:
        return None

