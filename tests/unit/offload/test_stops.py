"""Stopping a run that offloads to NVMe leaves no swap file: SIGTERM, Ctrl-C twice, and (found by the next
run) SIGKILL, during training or during construction (its spill file). Real processes, real files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import processes
import pytest
import torch

import zinf
from zinf.offload import cleanup

TRAIN = """
import sys, time, torch, zinf
from pathlib import Path
from torch import nn
tmp = Path(sys.argv[1])
cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp)],
                                             "pinned_pool_bytes": 16 << 20}})
with zinf.Init(cfg):
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
for step in range(100000):
    engine.backward(engine(torch.randn(32, 256)).square().mean())
    engine.step()
    if step == 1:
        (tmp / "ready").write_text("1")
        if sys.argv[2] == "kill":
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _start(tmp: Path, mode: str) -> subprocess.Popen:
    (tmp / "train.py").write_text(TRAIN)
    proc = subprocess.Popen([sys.executable, str(tmp / "train.py"), str(tmp), mode], stderr=subprocess.PIPE, text=True,
                            preexec_fn=processes.default_sigint)
    deadline = time.monotonic() + 120
    while not (tmp / "ready").exists():
        assert proc.poll() is None or mode == "kill", proc.stderr.read() if proc.stderr else ""
        if mode == "kill" and proc.poll() is not None:
            break
        assert time.monotonic() < deadline, "the training script did not start"
        time.sleep(0.05)
    return proc


def _swap_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("*.swap"))


def test_sigterm_stops_training_and_removes_the_swap_files(tmp_path: Path) -> None:
    proc = _start(tmp_path, "run")
    assert _swap_files(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert _swap_files(tmp_path) == [], err


DEFERRED = """
import os, signal, sys, time
from zinf.offload import cleanup
cleanup.register([])  # installs zinf's SIGTERM handler, as the first swap file does
done = []
try:
    with cleanup.stops_deferred():  # forward
        with cleanup.stops_deferred():  # a nested engine call
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs in here: noted, not raised
            done.append("inner")
        done.append("outer")
    done.append("after")
except SystemExit as stop:
    print(done, stop.code)
try:
    os.kill(os.getpid(), signal.SIGTERM)  # outside the engine: raised at once
    time.sleep(1)
    done.append("not stopped")
except SystemExit as stop:
    print(done, stop.code)
"""


def test_sigterm_inside_the_engine_is_raised_when_its_call_returns(tmp_path: Path) -> None:
    """[Note: clean stops]: a SIGTERM inside forward/backward/step waits for the call's end, not raised half way
    through a state change; outside, it stops at once."""
    (tmp_path / "deferred.py").write_text(DEFERRED)
    proc = processes.run([sys.executable, str(tmp_path / "deferred.py")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["['inner', 'outer'] 143", "['inner', 'outer'] 143"], proc.stdout


@pytest.mark.parametrize("attempt", range(3))
def test_ctrl_c_twice_removes_the_swap_files(tmp_path: Path, attempt: int) -> None:
    proc = _start(tmp_path, "run")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01 * (attempt + 1))  # the second one lands while the first unwinds or the files are removed
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert _swap_files(tmp_path) == [], err


def test_files_of_a_killed_run_are_removed_by_the_next_run(tmp_path: Path, caplog) -> None:
    proc = _start(tmp_path, "kill")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = _swap_files(tmp_path)
    assert len(left) == 1  # SIGKILL leaves them: nothing can run in the process
    (tmp_path / "ready").unlink()
    header = json.loads((tmp_path / left[0]).read_bytes()[:4096].rstrip(b"\0"))
    assert header["pid"] == proc.pid and header["host"] == socket.gethostname()
    with caplog.at_level("WARNING", logger="zinf"):
        kept = cleanup.collect_leftovers([str(tmp_path)])
    assert kept == [] and _swap_files(tmp_path) == []
    assert f"left by pid {proc.pid} on host {socket.gethostname()}, which is gone" in caplog.text


def test_files_of_a_live_run_are_kept_and_named(tmp_path: Path) -> None:
    """Liveness is the owner's lock on the file, not its pid: it holds across PID namespaces and hidden /proc."""
    path = tmp_path / "zinf-r0-of-1-0123abcd.swap"
    header = json.dumps({"magic": "ZINFSWAP", "version": 1, "host": "elsewhere", "pid": 1}).encode()
    path.write_bytes(header.ljust(4096, b"\0"))
    fd = cleanup.hold(str(path))
    try:
        kept = cleanup.collect_leftovers([str(tmp_path)])
        assert [k.path for k in kept] == [str(path)] and "in use by a live run (pid 1 on host elsewhere)" in kept[0].why
    finally:
        os.close(fd)
    assert cleanup.collect_leftovers([str(tmp_path)]) == [] and not path.exists()  # the lock is gone: removed
    other = tmp_path / "zinf-r0-of-1-89abcdef.swap"
    other.write_bytes(b"not a zinf header".ljust(4096, b"\0"))
    assert [k.why for k in cleanup.collect_leftovers([str(tmp_path)])] == ["its header is unreadable"]
    assert other.exists()


BUILD_AND_DIE = """
import os, signal, sys, zinf
from torch import nn
cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [sys.argv[1]]}})
class Dies(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)  # partitioned when its __init__ returns: its shard goes to the spill file
        os.kill(os.getpid(), signal.SIGKILL)
with zinf.Init(cfg):
    Dies()
"""


def test_spill_file_of_a_killed_construction_is_removed_by_the_next_run(tmp_path: Path, caplog) -> None:
    (tmp_path / "build.py").write_text(BUILD_AND_DIE)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "build.py"), str(tmp_path)], stderr=subprocess.PIPE,
                            text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    left = f"zinf-init-{socket.gethostname()}-{proc.pid}-r0.spill"
    assert sorted(p.name for p in tmp_path.glob("*.spill")) == [left]
    assert (tmp_path / left).stat().st_size > 0
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path)],
                                                 "pinned_pool_bytes": 16 << 20}})
    with caplog.at_level("WARNING", logger="zinf"):
        with zinf.Init(cfg):
            model = torch.nn.Linear(8, 8)
    assert not (tmp_path / left).exists()
    assert f"left by pid {proc.pid} on host {socket.gethostname()}, which is gone" in caplog.text
    zinf.initialize(model, torch.optim.AdamW(model.parameters()), cfg).close()
    assert list(tmp_path.glob("*.spill")) == [] and _swap_files(tmp_path) == []


def test_spill_file_of_a_live_run_is_kept(tmp_path: Path) -> None:
    """Held by its owner's lock (another host's run on a shared drive), or named after a pid that runs here."""
    elsewhere = tmp_path / "zinf-init-elsewhere-1-r0.spill"
    elsewhere.write_bytes(b"\0" * 4096)
    here = tmp_path / f"zinf-init-{socket.gethostname()}-{os.getpid()}-r1.spill"
    here.write_bytes(b"\0" * 4096)
    fd = cleanup.hold(str(elsewhere))
    try:
        kept = cleanup.collect_leftovers([str(tmp_path)])
        assert sorted(k.why for k in kept) == sorted([f"in use by a live run (pid {os.getpid()} on host "
                                                      f"{socket.gethostname()})",
                                                      "in use by a live run (pid 1 on host elsewhere)"])
    finally:
        os.close(fd)
    assert [k.path for k in cleanup.collect_leftovers([str(tmp_path)])] == [str(here)] and not elsewhere.exists()
