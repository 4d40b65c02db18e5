"""How an offloaded optimizer's sub-group states are stored (``optimizer_storage``): which arrays, of which dtype and
length, and their conversion to and from the values a checkpoint holds.

- fp32 / bf16: the fp32 master and two moments of the storage's dtype, one element per element; a checkpoint holds
  them as stored.
- int8: the master, two moments of uint8 codes, and two arrays of int8 block exponents (``exp_avg_scale``,
  ``exp_avg_sq_scale``), one per 256 elements of each segment ([Note: int8 moments] in cpp/adam/int8_moments.h).
  Blocks start at every segment's start, since the kernel steps one segment (one parameter's range) per call and a
  block it re-scales must hold nothing another call steps. A checkpoint holds the decoded fp32 values: exact (the
  scales are powers of two, and a decoded block encodes back to the same bytes), and cut by any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from zinf.native import moment_codes
from zinf.offload.subgroups import STATES

if TYPE_CHECKING:
    from zinf.offload.subgroups import SubGroup
    from zinf.offload.swap import Record, SwapSpace

__all__ = ["StateLayout", "SCALES", "allocate_records"]

SCALES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}


@dataclass(eq=False)
class StateLayout:
    moment_dtype: torch.dtype = torch.float32  # float32, bfloat16, or uint8 (int8 codes)
    _first_blocks: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def int8(self) -> bool:
        return self.moment_dtype == torch.uint8

    @property
    def names(self) -> tuple[str, ...]:
        """The arrays each sub-group keeps (records on NVMe)."""
        return STATES + (tuple(SCALES.values()) if self.int8 else ())

    def dtype(self, name: str) -> torch.dtype:
        if name in SCALES:
            return self.moment_dtype
        if name in SCALES.values():
            return torch.int8
        return torch.float32  # the master, a gradient

    def checkpoint_dtype(self, name: str) -> torch.dtype:
        """The dtype ``read_states`` hands out: as stored, but int8 moments decoded to fp32."""
        return torch.float32 if self.int8 else self.dtype(name)

    def first_blocks(self, sg: "SubGroup") -> list[int]:
        """Each segment's first block exponent, and the sub-group's number of blocks last."""
        out = self._first_blocks.get(id(sg))
        if out is None:
            out = [0]
            for lo, hi, _, _ in sg.segments:
                out.append(out[-1] + moment_codes.blocks(hi - lo))
            self._first_blocks[id(sg)] = out
        return out

    def numel(self, sg: "SubGroup", name: str) -> int:
        return self.first_blocks(sg)[-1] if name in SCALES.values() else sg.numel

    def nbytes(self, sg: "SubGroup", name: str) -> int:
        return self.numel(sg, name) * self.dtype(name).itemsize

    def state_bytes(self, subgroups: Sequence["SubGroup"]) -> int:
        """Every array of ``subgroups``: master, moments (and int8 block exponents)."""
        return sum(self.nbytes(sg, name) for sg in subgroups for name in self.names)

    def empty(self, sg: "SubGroup", device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """A sub-group's arrays with zero moments (zero blocks for int8), in host memory or on ``device``."""
        out = {n: torch.zeros(self.numel(sg, n), dtype=self.dtype(n), device=device) for n in self.names}
        for n in SCALES.values():
            if n in out:
                out[n].fill_(moment_codes.ZERO_BLOCK)
        return out

    def segment_scales(self, sg: "SubGroup", states: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """The ``adam_step`` keywords of segment ``k``'s block exponents (none unless int8)."""
        if not self.int8:
            return {}
        first = self.first_blocks(sg)
        return {n: states[n][first[k] : first[k + 1]] for n in SCALES.values()}

    def readable(self, sg: "SubGroup", stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Master and moments of ``sg`` as a checkpoint holds them (int8 moments decoded; gaps 0)."""
        out = {n: stored[n] for n in STATES}
        if not self.int8:
            return out
        first = self.first_blocks(sg)
        for name, scale in SCALES.items():
            values = torch.zeros(sg.numel, dtype=torch.float32)
            for k, (lo, hi, _, _) in enumerate(sg.segments):
                a, b = lo - sg.lo, hi - sg.lo
                values[a:b] = moment_codes.decode(name, stored[name][a:b], stored[scale][first[k] : first[k + 1]])
            out[name] = values
        return out

    def storable(self, sg: "SubGroup", given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What to store for values a checkpoint holds (``given``: some of master and moments, ``sg``'s elements);
        int8 moments encoded, exactly when they were decoded ones."""
        if not self.int8:
            return dict(given)
        out = {n: v for n, v in given.items() if n not in SCALES}
        first = self.first_blocks(sg)
        for name, scale in SCALES.items():
            if name not in given:
                continue
            codes = torch.zeros(sg.numel, dtype=torch.uint8)
            exps = torch.full((first[-1],), moment_codes.ZERO_BLOCK, dtype=torch.int8)
            for k, (lo, hi, _, _) in enumerate(sg.segments):
                a, b = lo - sg.lo, hi - sg.lo
                codes[a:b], exps[first[k] : first[k + 1]] = moment_codes.encode(
                    name, given[name][a:b].float(), seed=0, index_base=sg.group.layout.lo + lo)
            out[name], out[scale] = codes, exps
        return out


def allocate_records(swap: "SwapSpace", subgroups: Sequence["SubGroup"], grads: bool,
                     layout: StateLayout) -> dict[int, dict[str, "Record"]]:
    """Each sub-group's records in the swap files, side by side: master, exp_avg, exp_avg_sq (int8 moments: and
    their block exponents), as ``layout`` stores them, and its fp32 gradient."""
    names = layout.names + (("grad",) if grads else ())
    return {id(sg): {name: swap.allocate(layout.nbytes(sg, name)) for name in names} for sg in subgroups}
