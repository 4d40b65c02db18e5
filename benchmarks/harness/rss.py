"""A process's own memory and I/O counters from /proc, a thread that samples its resident set size, and a zinf
engine's own host-memory figures to set beside them."""

from __future__ import annotations

import gc
import threading
import time

__all__ = ["proc_field", "RssSampler", "GrowthMarks", "engine_figures"]


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


class GrowthMarks:
    """The process's RSS growth over a base taken now (the high-water mark reset), sampled every 5 ms, with marks:
    ``mark(what, **extra)`` records the time, the current growth and the sampled peak growth so far."""

    def __init__(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = proc_field("VmRSS:")
        self.rss = RssSampler(period=0.005)
        self.marks: list[dict] = []

    def mark(self, what: str, **extra: object) -> None:
        self.marks.append({"what": what, "t": time.perf_counter(), "rss": proc_field("VmRSS:") - self.base,
                           "peak": self.rss.peak - self.base, **extra})

    def stop(self) -> int:
        """Stop sampling; the kernel's high-water mark's growth over the base."""
        self.rss.stop()
        return proc_field("VmHWM:") - self.base


def engine_figures(engine: object | None) -> dict:
    """A zinf engine's host bytes now (``resident_bytes()``'s CPU tier) and the most it held during its last step
    (``StepReport.peak_host_bytes``); None for both without an engine (DDP)."""
    if engine is None or not hasattr(engine, "resident_bytes"):
        return {"engine_host": None, "engine_peak_host": None}
    return {"engine_host": sum(engine.resident_bytes().get("cpu", {}).values()),
            "engine_peak_host": engine.last_report.peak_host_bytes}
