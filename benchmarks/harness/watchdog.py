"""Run the ranks of one benchmark run as fresh processes and kill them before the kernel's OOM killer would.

A watchdog samples the resident bytes of every rank's process tree every ``sample_s`` seconds and SIGKILLs
all their process groups when the sum passes ``Limits.rss_gib``, when the machine's MemAvailable drops under
``Limits.min_avail_gib``, when the NVMe directory's disk has under ``Limits.disk_free_gib`` free, or when the
run passes ``Limits.cap_s``. Ranks print ``PHASE <where>`` lines (so a kill says where it happened) and rank 0
one ``RESULT <json>`` line; everything else they print goes to the log file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

__all__ = ["GIB", "Limits", "RunOutcome", "dir_bytes", "free_port", "mem_available", "phase", "run_ranks", "tree_rss"]

GIB = 1 << 30


def phase(text: str) -> None:
    """Called in a rank: tell the watchdog where the run is."""
    print("PHASE " + text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pids: list[int]) -> int:
    """Resident bytes of these processes and all their descendants (from /proc/<pid>/status VmRSS)."""
    seen, todo, total = set(), list(pids), 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def dir_bytes(path: str) -> int:
    """Bytes allocated on disk to the files under ``path`` (sparse files count what they hold)."""
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.stat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass(kw_only=True)
class Limits:
    rss_gib: float = 21.0  # all ranks' process trees together
    min_avail_gib: float = 1.0
    disk_free_gib: float = 3.0  # checked only when the run has an NVMe directory
    cap_s: float = 25 * 60


@dataclass
class RunOutcome:
    """What the watchdog saw of one run."""

    returncodes: list[int | None]
    result: dict | None  # rank 0's RESULT line
    phase: str  # rank 0's last PHASE
    phases: list[str]  # each rank's last PHASE
    killed: str | None  # the reason, when the watchdog killed the run
    peak_rss_bytes: int  # all ranks together
    peak_rss_per_rank_bytes: list[int]
    peak_disk_bytes: int
    wall_s: float
    tails: list[list[str]] = field(default_factory=list)  # each rank's last output lines

    @property
    def ok(self) -> bool:
        return self.killed is None and self.result is not None and all(rc == 0 for rc in self.returncodes)

    def status(self) -> str:
        """``ok``, ``killed (<reason>) during <phase>`` or ``failed (rc [...]) during <phase>: <last lines>``."""
        if self.killed:
            return f"killed ({self.killed}) during {self.phase}"
        if self.ok:
            return "ok"
        bad = next((r for r, rc in enumerate(self.returncodes) if rc != 0), 0)
        return f"failed (rc {self.returncodes}) during {self.phase}: " + " | ".join(self.tails[bad][-3:])

    def error_line(self) -> str:
        """The most telling line of a failed rank's output: its last exception line, else its last line."""
        bad = next((r for r, rc in enumerate(self.returncodes) if rc != 0), 0)
        lines = [ln for ln in self.tails[bad] if ln.strip()] if self.tails else []
        errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and not ln.startswith(" ")]
        return (errors or lines or [self.status()])[-1].strip()


def run_ranks(cmd: list[str], envs: list[dict[str, str]], *, limits: Limits, log_path: str,
              disk_dir: str | None = None, sample_s: float = 0.2, progress_every_s: float = 30.0) -> RunOutcome:
    """Start one process per entry of ``envs`` running ``cmd``, each in a POSIX session of its own, and watch them."""
    procs: list[subprocess.Popen] = []
    phases: dict[int, str] = {}
    tails: dict[int, list[str]] = {}
    result: dict = {}
    start = time.perf_counter()
    log = open(log_path, "w")
    lock = threading.Lock()
    readers = []
    for r, env in enumerate(envs):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        procs.append(p)
        phases[r], tails[r] = "startup", []

        def reader(r: int = r, p: subprocess.Popen = p) -> None:
            for line in p.stdout:
                with lock:
                    log.write(f"[{r} {time.perf_counter() - start:7.1f}s] {line}")
                    log.flush()
                if line.startswith("PHASE "):
                    phases[r] = line[6:].strip()
                elif line.startswith("RESULT "):
                    result.update(json.loads(line[7:]))
                else:
                    tails[r].append(line.rstrip())
                    del tails[r][:-40]

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        readers.append(t)
    try:
        return _watch(procs, phases, tails, result, readers, log, start, limits=limits, disk_dir=disk_dir,
                      sample_s=sample_s, progress_every_s=progress_every_s)
    finally:  # an exception or Ctrl-C in the watchdog leaves no rank behind
        for p in procs:
            if p.poll() is None:
                _kill(p)
        log.close()


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch(procs: list[subprocess.Popen], phases: dict[int, str], tails: dict[int, list[str]], result: dict,
           readers: list[threading.Thread], log, start: float, *, limits: Limits, disk_dir: str | None,
           sample_s: float, progress_every_s: float) -> RunOutcome:
    per_rank = [0] * len(procs)
    peak, peak_disk, killed, last_print, disk_probe = 0, 0, None, start, 0.0
    while any(p.poll() is None for p in procs):
        now_rss = [tree_rss([p.pid]) for p in procs]
        per_rank = [max(a, b) for a, b in zip(per_rank, now_rss)]
        rss = sum(now_rss)
        peak = max(peak, rss)
        now = time.perf_counter()
        reason = None
        if rss > limits.rss_gib * GIB:
            reason = f"RSS {rss / GIB:.1f} GiB > {limits.rss_gib} GiB"
        elif mem_available() < limits.min_avail_gib * GIB:
            reason = f"MemAvailable under {limits.min_avail_gib} GiB (RSS {rss / GIB:.1f} GiB)"
        elif now - start > limits.cap_s:
            reason = f"wall-clock cap {limits.cap_s / 60:.0f} min"
        if disk_dir is not None and now - disk_probe > 1.0:
            disk_probe = now
            peak_disk = max(peak_disk, dir_bytes(disk_dir))
            if shutil.disk_usage(disk_dir).free < limits.disk_free_gib * GIB:
                reason = f"disk free under {limits.disk_free_gib} GiB"
        if reason:
            killed = reason
            for p in procs:
                _kill(p)
            for p in procs:
                p.wait()
            break
        if now - last_print > progress_every_s:
            last_print = now
            print(f"  ... {now - start:6.0f}s {phases[0]:<40} RSS {rss / GIB:6.2f} GiB (peak {peak / GIB:.2f})", flush=True)
        time.sleep(sample_s)
    for t in readers:
        t.join(timeout=5)
    wall = time.perf_counter() - start
    if disk_dir is not None and os.path.isdir(disk_dir):
        peak_disk = max(peak_disk, dir_bytes(disk_dir))
    return RunOutcome(returncodes=[p.returncode for p in procs], result=result or None, phase=phases[0],
                      phases=[phases[r] for r in range(len(procs))], killed=killed,
                      peak_rss_bytes=peak, peak_rss_per_rank_bytes=per_rank, peak_disk_bytes=peak_disk, wall_s=wall,
                      tails=[tails[r] for r in range(len(procs))])
