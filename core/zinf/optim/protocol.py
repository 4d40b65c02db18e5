"""What the engine asks of an optimizer over shards, whichever one the placement built.

``ShardedOptimizer`` (the user's torch optimizer on device-tier masters) and ``OffloadedAdam`` (zinf's
CPU-Adam on masters and moments in host memory or on NVMe) both take the gradient shards with their pending
factors (unscale, clip; zinf/param/grad_shard.py), step, write each group's new parameter shard to its
store and leave every gradient shard zeroed. The engine holds one of them and never asks which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["ShardOptimizer"]


class ShardOptimizer(Protocol):
    def step(self) -> None:
        """Step every group (possibly in the background); afterwards the gradient shards are zeroed."""
        ...

    def wait(self) -> None:
        """Block until a step in flight is done; raise its error (and on every later call)."""
        ...

    def follow(self, order: Sequence["FlatParamGroup"]) -> None:
        """From the next step on, step the groups in ``order`` first, in that order (the next forward's: see
        [Note: stepped in the next forward's order] in zinf/optim/offloaded.py); the others after them."""
        ...

    def before_backward(self) -> None:
        """A backward starts: gradients are about to land in shards a background step may still read."""
        ...

    def after_backward(self) -> None:
        """A backward ended: finish the gradient writes it left in flight."""
        ...

    def on_grad_complete(self, group: "FlatParamGroup") -> None:
        """``group``'s gradient shard is complete in the backward (the reducer tells, on the training thread)."""
        ...

    def drop_gradients(self) -> None:
        """The gradients are dropped without a step (a skipped step, ``zero_grad``): undo what was begun from them."""
        ...

    def quiesce(self) -> None:
        """Wait for the step in flight and give back what was read ahead: the state's home alone holds it."""
        ...

    def close(self) -> None:
        """Quiesce, then let go of any worker thread (the engine is closed)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    # [Note: portable optimizer state]
    # What a sharded checkpoint stores, the same for every optimizer and placement so that it loads on another
    # world size or placement: per group, each state tensor as one flat vector over the group's shard (fp32, or
    # bf16 where the optimizer keeps it so: ``state_dtype``)
    # (``group_state``: zeros where a parameter has no state), and per parameter its scalars (``state_meta``:
    # ``{"step": n}`` for Adam; ``None`` where the optimizer never stepped it), which every rank holds alike.
    def state_meta(self) -> dict[str, Any]:
        """``{"param_groups": [hyper-parameters], "scalars": [per group: [per parameter: dict | None]]}``."""
        ...

    def state_keys(self, group: "FlatParamGroup") -> list[str]:
        """The names of the state tensors ``group_state(group)`` returns (the same on every rank)."""
        ...

    def group_state(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        """This rank's state of ``group``: name -> tensor of ``group.shard_numel`` elements."""
        ...

    def state_dtype(self, group: "FlatParamGroup", key: str) -> torch.dtype:
        """The dtype a checkpoint keeps ``group``'s state ``key`` in: fp32, or the narrower dtype the optimizer keeps
        it in where that holds its values exactly (bf16 moments); read back widened to fp32."""
        ...

    def check_state(self, meta: dict[str, Any], keys: list[list[str]]) -> None:
        """Raise ``ValueError`` (naming the fix) when a checkpoint's ``state_meta`` and its state keys per group
        cannot load into this optimizer; called before anything is loaded."""
        ...

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        """Restore hyper-parameters and per-parameter scalars (before ``load_group_state``)."""
        ...

    def load_group_state(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        """Restore ``group``'s state tensors, as ``group_state`` returned them (of this world's shard size)."""
        ...

    def finish_load(self) -> None:
        """Every group's state has been given: apply what was collected."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """Optimizer-state bytes kept outside the groups, per tier and kind."""
        ...
