"""The placements the planner compares: where parameter shards, optimizer states and gradient shards live, and
their names on the command line (``params/optimizer[/grads]``).
"""

from __future__ import annotations

from dataclasses import dataclass

from zinf.config_sections import TIERS
from zinf.plan.model import PlanError

__all__ = ["PlanPlacement", "ALL_PLACEMENTS", "parse_placement"]


@dataclass(frozen=True)
class PlanPlacement:
    """Where parameter shards, optimizer states (fp32 master + two Adam moments) and gradient shards live."""

    params: str
    optimizer: str
    grads: str

    @property
    def name(self) -> str:
        auto = {"device": "device", "cpu": "cpu", "nvme": "nvme"}[self.optimizer]
        return f"{self.params}/{self.optimizer}" + ("" if self.grads == auto else f"/{self.grads}")

    @property
    def num_offloads(self) -> int:
        """How far state moves off the device: 1 per kind on CPU, 2 on NVMe (ties prefer the smaller)."""
        return sum({"device": 0, "cpu": 1, "nvme": 2}[t] for t in (self.params, self.optimizer, self.grads))

    def offload_config(self) -> dict[str, str]:
        auto = self.grads == self.optimizer
        return {"params": self.params, "optimizer": self.optimizer, "grads": "auto" if auto else self.grads}


def _all() -> tuple[PlanPlacement, ...]:
    out = []
    for p in TIERS:
        for o in TIERS:
            out.append(PlanPlacement(p, o, o))
            if o == "nvme":
                out.append(PlanPlacement(p, o, "cpu"))
    return tuple(out)


ALL_PLACEMENTS = _all()


def parse_placement(text: str) -> PlanPlacement:
    """``"params/optimizer[/grads]"``, e.g. ``"device/cpu"``, ``"nvme/nvme"``, ``"nvme/nvme/cpu"``."""
    parts = text.strip().split("/")
    if len(parts) == 2:
        parts.append(parts[1])
    names = [p.name for p in ALL_PLACEMENTS]
    if len(parts) == 3:
        for p in ALL_PLACEMENTS:
            if (p.params, p.optimizer, p.grads) == tuple(parts):
                return p
    raise PlanError(f"zinf plan: unknown placement {text!r}; expected params/optimizer[/grads] with tiers "
                    f"{list(TIERS)} (gradients on 'cpu' or 'nvme' only with the optimizer on NVMe), one of {names}.")
