"""The content check of one sub-group's state records, left to whoever steps them.

[Note: checks in the Adam pass]
The sweep checks each record it reads against its trailer before anything computed from it is used or written
back. The trailer's generation and identity are checked as the reads finish; the data's CRC32C is taken either by a
pass of its own (``check_now``) or by the CPU-Adam pass that steps the sub-group (``check_in_pass``, [Note:
checksums in the Adam pass] in cpp/adam/adam.h), which also returns the CRC32C of what it wrote, so the writes are
stamped without another pass. The pass steps in place in the sweep's pool buffers, so a record refused after it
has changed only those buffers, which are never written back: the stepper writes the parameter shard and the sweep
submits the writes only after the check. The one other thing it touches is a gradient held in host memory, zeroed
as the pass reads it (as the step always does); a refused step has lost it, and the engine trains no further.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Mapping

import torch

if TYPE_CHECKING:
    from zinf.offload.swap import Record, SwapSpace

__all__ = ["RecordCheck", "CheckState"]


class CheckState(enum.Enum):
    PENDING = "pending"  # trailers checked, data not yet
    CHECKED = "checked"  # data checked by a pass of its own: the writes are stamped by theirs
    CHECKED_IN_PASS = "checked in pass"  # data checked by the Adam pass, which also gave the written data's CRCs


class RecordCheck:
    def __init__(self, swap: "SwapSpace", records: Mapping[str, "Record"], bufs: Mapping[str, torch.Tensor],
                 trailer_crcs: Mapping[str, int]) -> None:
        self.swap, self.records, self.bufs = swap, dict(records), dict(bufs)  # the sweep pops its own entries
        self.trailer_crcs = dict(trailer_crcs)  # by record name: the CRC32C its trailer holds
        self.state = CheckState.PENDING
        self._written: dict[str, int] = {}

    def check_now(self) -> None:
        """Checksum every record's data in a pass of its own."""
        assert self.state is CheckState.PENDING, self.state
        for name, crc in self.trailer_crcs.items():
            self.swap.check_content(self.records[name], self.swap.checksum(self.records[name], self.bufs[name]), crc)
        self.state = CheckState.CHECKED

    def check_in_pass(self, read: Mapping[str, int], written: Mapping[str, int]) -> None:
        """The CRC32C the stepping pass took of every record as it read it (``read``: all of them) and of the
        arrays it wrote (``written``)."""
        assert self.state is CheckState.PENDING, self.state
        assert read.keys() == self.trailer_crcs.keys(), (sorted(read), sorted(self.trailer_crcs))
        for name, crc in self.trailer_crcs.items():
            self.swap.check_content(self.records[name], read[name], crc)
        self._written = dict(written)
        self.state = CheckState.CHECKED_IN_PASS

    def write_crc(self, name: str) -> int | None:
        """The CRC32C to stamp ``name``'s write with: None where the write takes its own."""
        if self.state is CheckState.PENDING:  # never stamp unchecked data with a fresh checksum
            raise RuntimeError(f"zinf offload: record {self.records[name].record_id} is being written back before its "
                               "content was checked; the stepper must call check_in_pass or check_now first")
        return self._written.get(name)
