"""The placements the planner compares: where parameter shards, optimizer states and gradient shards live, and
their names on the command line (``params/optimizer[/grads]``).
"""

from __future__ import annotations

from dataclasses import dataclass

from zinf.config import OPTIMIZER_STORAGES
from zinf.config_sections import TIERS
from zinf.native.moment_codes import blocks
from zinf.plan.model import PlanError

__all__ = ["PlanPlacement", "ALL_PLACEMENTS", "parse_placement"]


@dataclass(frozen=True)
class PlanPlacement:
    """Where parameter shards, optimizer states (fp32 master + two Adam moments) and gradient shards live, and the
    offloaded CPU-Adam's moments' storage (``optimizer_storage``; named ``+bf16``, ``+int8``)."""

    params: str
    optimizer: str
    grads: str
    moments: str = "fp32"

    @property
    def name(self) -> str:
        auto = {"device": "device", "cpu": "cpu", "nvme": "nvme"}[self.optimizer]
        return (f"{self.params}/{self.optimizer}" + ("" if self.grads == auto else f"/{self.grads}")
                + ("" if self.moments == "fp32" else f"+{self.moments}"))

    @property
    def moment_bytes(self) -> int:
        """Bytes of each Adam moment per parameter (int8: and an exponent byte per block, ``moments_nbytes``)."""
        return OPTIMIZER_STORAGES[self.moments].itemsize

    def moment_records(self, numel: int) -> list[int]:
        """The bytes of a sub-group's moment records: the moments (int8: and their block exponents)."""
        return [numel * self.moment_bytes] * 2 + ([blocks(numel)] * 2 if self.moments == "int8" else [])

    def moments_nbytes(self, numel: int) -> int:
        """Both moments' bytes for ``numel`` parameters (int8: with their block exponents)."""
        return sum(self.moment_records(numel))

    @property
    def num_offloads(self) -> int:
        """How far state moves off the device: 1 per kind on CPU, 2 on NVMe (ties prefer the smaller)."""
        return sum({"device": 0, "cpu": 1, "nvme": 2}[t] for t in (self.params, self.optimizer, self.grads))

    def offload_config(self) -> dict[str, str]:
        # with the optimizer on NVMe, "auto" would keep the gradients on the host where they fit: name the tier
        auto = self.grads == self.optimizer and self.optimizer != "nvme"
        return {"params": self.params, "optimizer": self.optimizer, "grads": "auto" if auto else self.grads}


def _all() -> tuple[PlanPlacement, ...]:
    out = []
    for p in TIERS:
        for o in TIERS:
            for moments in OPTIMIZER_STORAGES if o != "device" else ("fp32",):
                out.append(PlanPlacement(p, o, o, moments))
                if o == "nvme":
                    out.append(PlanPlacement(p, o, "cpu", moments))
    return tuple(out)


ALL_PLACEMENTS = _all()


def parse_placement(text: str) -> PlanPlacement:
    """``"params/optimizer[/grads][+bf16]"``, e.g. ``"device/cpu"``, ``"nvme/nvme"``, ``"nvme/nvme/cpu"``,
    ``"cpu/cpu+bf16"``, ``"nvme/nvme+int8"`` (the CPU-Adam's moments in bf16 or int8)."""
    base, _, moments = text.strip().partition("+")
    parts = base.split("/")
    if len(parts) == 2:
        parts.append(parts[1])
    names = [p.name for p in ALL_PLACEMENTS]
    if len(parts) == 3:
        for p in ALL_PLACEMENTS:
            if (p.params, p.optimizer, p.grads, p.moments) == (*parts, moments or "fp32"):
                return p
    raise PlanError(f"zinf plan: unknown placement {text!r}; expected params/optimizer[/grads] with tiers "
                    f"{list(TIERS)} (gradients on 'cpu' or 'nvme' only with the optimizer on NVMe; '+bf16' or '+int8' only "
                    f"with the optimizer offloaded), one of {names}.")
