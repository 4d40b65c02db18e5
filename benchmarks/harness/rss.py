"""A process's own memory and I/O counters from /proc, and a thread that samples its resident set size."""

from __future__ import annotations

import threading

__all__ = ["proc_field", "RssSampler"]


def proc_field(field: str, path: str = "/proc/self/status") -> int:
    """A counter of a /proc file (``"VmRSS:"``, ``"VmHWM:"`` in /proc/self/status, ``"read_bytes:"`` in
    /proc/self/io), in bytes where the file gives kB; 0 when it is missing."""
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                value = line.split(":")[1].split()
                return int(value[0]) * (1024 if len(value) > 1 and value[1] == "kB" else 1)
    return 0


class RssSampler:
    """The process's resident set size every ``period`` seconds on a thread; ``peak`` is the largest sample."""

    def __init__(self, period: float = 0.2) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_field("VmRSS:"))
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
