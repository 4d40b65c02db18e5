"""The planner's choice for a pretrained base that stays frozen (LoRA, QLoRA): read where it lies, or staged to swap.

[Note: in place or staged]
With ``offload.params: nvme``, the frozen groups a checkpoint loads are read from the checkpoint's own files
(``offload.frozen_in_place: true``, [Note: frozen shards in place] in zinf/offload/in_place.py) or copied to the swap
files at loading and read from there (``false``). Either way each step reads the same bytes (the base, forward and
backward); the choice is only which drive serves them, against one copy of the base at loading and its room in swap:

    the checkpoint on the swap's drive             in place: a copy would be read back from the same drive
    the swap without room for the base             in place
    a drive's read speed unknown                   in place (the default)
    the checkpoint's drive reads >= 0.9 x swap's   in place: as fast, no copy and no swap
    else                                           staged: a slower drive (a network mount, a disk) read twice a step
                                                   costs more than copying the base once

Speeds are sequential O_DIRECT reads through zinf's AsyncIO: the swap's as ``zinf info --nvme`` measures it (the
planner's machine), the checkpoint's from its largest safetensors file, read only. A 4-bit checkpoint saved with
double quantization is staged whatever this says (its scales are decoded at loading).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from zinf.offload.disk_speed import measure_read
from zinf.plan.model import PlanError

__all__ = ["FrozenBase", "choose_frozen_base", "decide", "STAGE_BELOW"]

STAGE_BELOW = 0.9  # staged only where the checkpoint's drive reads below this share of the swap's speed


@dataclass(frozen=True)
class FrozenBase:
    checkpoint: str
    base_bytes: int
    in_place: bool
    why: str
    checkpoint_read_bw: float | None  # bytes/s, None: not measured
    swap_read_bw: float | None

    def describe(self) -> str:
        how = "read in place (offload.frozen_in_place: true)" if self.in_place else \
            "staged to swap at loading (offload.frozen_in_place: false)"
        return f"{self.checkpoint} ({self.base_bytes / 1e9:.2f} GB): {how}; {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(base_bytes: int, same_drive: bool, swap_free: int, checkpoint_bw: float | None,
           swap_bw: float | None) -> tuple[bool, str]:
    """(read in place, why): the rule of [Note: in place or staged]."""
    if same_drive:
        return True, "the checkpoint lies on the swap's drive: a copy would be read back from the same drive"
    if swap_free < base_bytes:
        return True, (f"the swap has {swap_free / 1e9:.1f} GB free, a copy of the base needs {base_bytes / 1e9:.1f} GB")
    if not checkpoint_bw or not swap_bw:
        return True, "a drive's read speed is unknown (run `zinf info --nvme` on the swap directory)"
    speeds = f"the checkpoint's drive reads {checkpoint_bw / 1e9:.2f} GB/s, the swap's {swap_bw / 1e9:.2f} GB/s"
    if checkpoint_bw >= STAGE_BELOW * swap_bw:
        return True, f"{speeds}: as fast, so no copy and no swap for the base"
    return False, (f"{speeds}: the base is read twice a step, so it is copied to the faster drive once at loading "
                   f"({base_bytes / 1e9:.1f} GB of swap)")


def _checkpoint_files(checkpoint: str) -> list[Path]:
    directory = Path(checkpoint)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise PlanError(f"zinf plan: --checkpoint {checkpoint!r} holds no *.safetensors files; give the directory "
                        "save_pretrained wrote (the base a LoRA or QLoRA run loads).")
    return files


def choose_frozen_base(checkpoint: str, nvme_paths: Sequence[str], read_bw: dict[str, float],
                       free: dict[str, int]) -> FrozenBase:
    """The choice for ``checkpoint``'s base with swap at ``nvme_paths`` (their measured read speeds and free bytes,
    as the planner's machine holds them)."""
    if not nvme_paths:
        raise PlanError("zinf plan: --checkpoint chooses how a frozen base is read from NVMe; give the swap "
                        "directory with --nvme too.")
    files = _checkpoint_files(checkpoint)
    base = sum(f.stat().st_size for f in files)
    drive = os.stat(checkpoint).st_dev
    same = any(os.stat(p).st_dev == drive for p in nvme_paths)
    swap_bw = sum(read_bw[p] for p in nvme_paths) if all(read_bw.get(p) for p in nvme_paths) else None
    checkpoint_bw = None if same else measure_read(max(files, key=lambda f: f.stat().st_size))
    in_place, why = decide(base, same, sum(free.get(p, 0) for p in nvme_paths), checkpoint_bw, swap_bw)
    return FrozenBase(checkpoint, base, in_place, why, checkpoint_bw, swap_bw)
