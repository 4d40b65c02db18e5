"""The drives' speed as ``zinf info --nvme PATH`` measured it, kept beside the swap files, for the step report.

``zinf info --nvme PATH`` writes ``PATH/zinf-disk-speed.json`` (sequential O_DIRECT write, read, and reads and
writes at once, GB/s, through zinf's AsyncIO with the offload settings). An engine whose ``offload.nvme_paths`` all
have one reports, per step, ``nvme_floor``: the seconds the step's NVMe bytes take at those speeds, beside the waits it
measured, so a run can say how close it is to the disk. The offload engine reads and writes at once, so the floor is
the longest of the reads at the read speed, the writes at the write speed and all bytes at the mixed speed (a drive
may serve both together faster than either alone, or slower); a file measured before the mixed speed was (no
``mixed_gbs``) gives reads and writes one after the other. The rank's files are striped over its paths, so their
speeds add up. Without a measurement for every path there is no floor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DiskSpeed", "SPEED_FILE", "load_speed", "save_speed"]

SPEED_FILE = "zinf-disk-speed.json"


@dataclass(frozen=True)
class DiskSpeed:
    read_bytes_per_s: float
    write_bytes_per_s: float
    mixed_bytes_per_s: float = 0.0  # reads and writes at once, together; 0: not measured

    def floor_s(self, read_bytes: int, written_bytes: int) -> float:
        """Seconds ``read_bytes`` and ``written_bytes`` take at these speeds, moved at once where the mixed speed
        was measured, else one after the other."""
        reads, writes = read_bytes / self.read_bytes_per_s, written_bytes / self.write_bytes_per_s
        if self.mixed_bytes_per_s <= 0:
            return reads + writes
        return max(reads, writes, (read_bytes + written_bytes) / self.mixed_bytes_per_s)


def save_speed(path: str, write_gbs: float, read_gbs: float, direct: bool, mixed_gbs: float = 0.0) -> None:
    with open(os.path.join(path, SPEED_FILE), "w") as f:
        json.dump({"write_gbs": write_gbs, "read_gbs": read_gbs, "mixed_gbs": mixed_gbs, "direct": direct}, f)


def load_speed(paths: Sequence[str]) -> DiskSpeed | None:
    """The summed speed of ``paths``, or None when one of them was never measured (or not with O_DIRECT)."""
    read = write = mixed = 0.0
    every_mixed = True
    for path in paths:
        try:
            with open(os.path.join(path, SPEED_FILE)) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        if not found.get("direct") or found.get("read_gbs", 0) <= 0 or found.get("write_gbs", 0) <= 0:
            return None
        read, write = read + found["read_gbs"] * 1e9, write + found["write_gbs"] * 1e9
        mixed += found.get("mixed_gbs", 0.0) * 1e9
        every_mixed = every_mixed and found.get("mixed_gbs", 0.0) > 0
    return DiskSpeed(read, write, mixed if every_mixed else 0.0) if paths else None
