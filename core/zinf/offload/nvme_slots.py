"""The slot of one group's shard in a pool buffer of the NVMe parameter store, and its states (see [Note: NVMe
parameter slots] in zinf/offload/nvme_param_store.py).
"""

from __future__ import annotations

import enum

import torch

from zinf.runtime.streams import BufferFence

__all__ = ["Slot", "SlotState"]


class SlotState(enum.Enum):
    """Who uses an NVMe slot's buffer and what it holds; see [Note: NVMe parameter slots] in
    zinf/offload/nvme_param_store.py. Apart from the state, a write of the buffer to its file (``Slot.write``) may
    be in flight in FILLED, IN_USE, KEPT and CONSUMED (it only reads the buffer, as a gather's copy does)."""

    READING = "reading"  # the file is being read into it (read-ahead, or a demand read); not gathered yet
    FILLED = "filled"  # holds the shard, not gathered since it was filled (read, or staged and committed)
    IN_USE = "in_use"  # handed to a gather: fetch() .. done()
    KEPT = "kept"  # gathered, and kept for the next gather (the backward's)
    CONSUMED = "consumed"  # gathered and not kept: released once its write (if any) has finished
    STAGED = "staged"  # the optimizer is writing the updated shard into it: writer() .. commit()


_HANDED = (SlotState.FILLED, SlotState.KEPT, SlotState.CONSUMED, SlotState.IN_USE)


class Slot:
    """One group's shard in a pool buffer of the NVMe store: its state, the I/O in flight on the buffer and
    the fence of the buffer's last copy to the device. The store does the I/O and the pool; every change of
    a slot is one of the verbs below. See [Note: NVMe parameter slots] in zinf/offload/nvme_param_store.py."""

    __slots__ = ("buf", "state", "read", "write", "used", "unchecked", "_copied")

    def __init__(self, buf: torch.Tensor, state: SlotState, read: int | None = None) -> None:
        assert (state is SlotState.READING) == (read is not None)
        self.buf = buf
        self.state = state
        self.read = read  # the read of the file into ``buf`` in flight (READING)
        self.write: int | None = None  # a write of ``buf`` to the file is in flight
        self.used = 0  # when its last gather finished (the store's counter); 0: not gathered since it was filled
        # a frozen shard whose checksum a gather takes as it copies the bytes ([Note: one pass per byte] in
        # zinf/offload/in_place.py): True from its read until a check passed
        self.unchecked = False
        self._copied: BufferFence | None = None  # the last copy of ``buf`` to the device (a gather's source)

    @classmethod
    def reading(cls, buf: torch.Tensor, handle: int) -> "Slot":
        """A buffer the file is being read into (``handle``)."""
        return cls(buf, SlotState.READING, handle)

    @classmethod
    def staging(cls, buf: torch.Tensor) -> "Slot":
        """A new buffer for the optimizer to write an updated shard into."""
        return cls(buf, SlotState.STAGED)

    @property
    def idle(self) -> bool:
        """Neither a gather nor the optimizer has it: it may be evicted, flushed or staged."""
        return self.state is not SlotState.IN_USE and self.state is not SlotState.STAGED

    @property
    def staged(self) -> bool:
        return self.state is SlotState.STAGED

    def read_done(self, unchecked: bool = False) -> None:
        """Its read has been waited for: READING -> FILLED (the store verifies the trailer next). ``unchecked``: the
        bytes' checksum is left to the gather that copies them."""
        assert self.state is SlotState.READING, f"read_done from {self.state}"
        self.state, self.read, self.unchecked = SlotState.FILLED, None, unchecked

    def checked(self) -> None:
        """The checksum of the bytes it holds matched."""
        self.unchecked = False

    def hand_to_gather(self, copied: BufferFence) -> None:
        """A gather copies the buffer to the device (``copied``: that copy's fence) -> IN_USE. The previous copy's
        fence is replaced: copies run in order on the copy_in stream, so the new fence covers the old one too.
        From IN_USE only when a gather is started again after one that failed before its ``done``."""
        assert self.state in _HANDED, f"hand_to_gather from {self.state}"
        self.state, self._copied = SlotState.IN_USE, copied

    def give_back(self, clock: int, keep: bool) -> None:
        """Its gather finished at ``clock``: IN_USE -> KEPT (``keep``: gathered again soon) or CONSUMED."""
        assert self.state is SlotState.IN_USE, f"give_back from {self.state}"
        self.state, self.used = (SlotState.KEPT if keep else SlotState.CONSUMED), clock

    def let_go(self) -> None:
        """What it was kept for will not come (the backward does not gather it again): KEPT -> CONSUMED."""
        assert self.state is SlotState.KEPT, f"let_go from {self.state}"
        self.state = SlotState.CONSUMED

    def stage(self) -> None:
        """The optimizer writes the updated shard into the buffer (an idle slot whose I/O the store finished)
        -> STAGED, as newly filled. Waits for the last device copy to have read the buffer."""
        assert self.idle and self.read is None and self.write is None, f"stage from {self.state}"
        self._wait_copied()
        self.state, self.used, self.unchecked = SlotState.STAGED, 0, False

    def commit(self) -> None:
        """The staged shard is complete: STAGED -> FILLED (the store starts its write next)."""
        assert self.state is SlotState.STAGED and self.write is None, f"commit from {self.state}"
        self.state = SlotState.FILLED

    def start_write(self, handle: int) -> None:
        """A write of the buffer to the file is in flight (``handle``); the buffer is only read by it."""
        assert self.write is None and self.state is not SlotState.READING and self.state is not SlotState.STAGED
        self.write = handle

    def write_done(self) -> None:
        """Its write has been waited for."""
        assert self.write is not None
        self.write = None

    def release(self) -> torch.Tensor:
        """The buffer, to go back to the pool: the slot is idle and its I/O finished. Waits for the last
        device copy to have read it (the pool hands it to the next read at once)."""
        assert self.idle and self.read is None and self.write is None, f"release from {self.state}"
        self._wait_copied()
        return self.buf

    def _wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def __repr__(self) -> str:
        io = " reading" if self.read is not None else " writing" if self.write is not None else ""
        return f"Slot({self.state.name}{io}, used={self.used})"
