"""What the engine asks of an optimizer over shards, whichever one the placement built.

``ShardedOptimizer`` (the user's torch optimizer on device-tier masters) and ``OffloadedAdam`` (zinf's
CPU-Adam on masters and moments in host memory or on NVMe) both take the gradient shards with their pending
factors (unscale, clip; zinf/param/grad_shard.py), step, write each group's new parameter shard to its
store and leave every gradient shard zeroed. The engine holds one of them and never asks which.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ShardOptimizer"]


class ShardOptimizer(Protocol):
    def step(self) -> None:
        """Step every group (possibly in the background); afterwards the gradient shards are zeroed."""
        ...

    def wait(self) -> None:
        """Block until a step in flight is done; raise its error (and on every later call)."""
        ...

    def before_backward(self) -> None:
        """A backward starts: gradients are about to land in shards a background step may still read."""
        ...

    def after_backward(self) -> None:
        """A backward ended: finish the gradient writes it left in flight."""
        ...

    def settle(self) -> None:
        """Wait for the step in flight and give back what was read ahead: the state's home alone holds it."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """Optimizer-state bytes kept outside the groups, per tier and kind."""
        ...
