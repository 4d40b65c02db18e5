"""A write that fails removes its target file only where that write created it: a file that already held other
records (a swap file, whose other records are still live) is left as it was. The failure is provoked with a file
size limit (RLIMIT_FSIZE) in a child process, so a write past it fails with EFBIG on every backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import processes
from zinf import native

LIMIT = 64 * 1024  # the child's file size limit

_CHILD = r"""
import errno, json, os, resource, signal, sys
import torch
from zinf import native

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
where, limit, backends = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def aligned(nbytes):
    raw = torch.full((nbytes + 4096,), 7, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start : start + nbytes]


def outcome(aio, buf, path, offset):
    try:
        aio.wait(aio.submit_write(buf, path, offset))
        return {"failed": False}
    except native.AIOError as exc:
        return {"failed": True, "errno": exc.errno, "unlinked": exc.unlinked}


out = {}
for backend in backends:
    aio = native.PythonAsyncIO() if backend == "python" else native.AsyncIO(backend=backend, block_size=16384)
    kept = os.path.join(where, backend + "-kept.bin")
    with open(kept, "wb") as f:
        f.write(bytes(range(256)) * 32)  # 8 KiB of other records, under the limit
    fresh = os.path.join(where, backend + "-fresh.bin")
    out[backend] = {"existing": outcome(aio, aligned(4096), kept, limit),  # wholly past the limit
                    "created": outcome(aio, aligned(2 * limit), fresh, 0)}  # crosses it
    aio.close()
print(json.dumps(out))
"""


def _backends() -> list[str]:
    out = ["python"]
    if native.info().available:
        out.append("threads")
        if native.require().aio.uring_available():
            out.append("io_uring")
    return out


def test_a_failed_write_removes_only_a_file_it_created(tmp_path: Path) -> None:
    backends = _backends()
    r = processes.run([sys.executable, "-c", _CHILD, str(tmp_path), str(LIMIT), *backends], capture_output=True,
                      text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for backend in backends:
        existing, created = results[backend]["existing"], results[backend]["created"]
        assert existing["failed"] and created["failed"], (backend, results[backend])
        kept = tmp_path / f"{backend}-kept.bin"
        assert kept.exists(), f"{backend}: a failed write removed a file that held other records"
        assert kept.read_bytes() == bytes(range(256)) * 32, backend
        assert not existing["unlinked"], backend
        assert created["unlinked"], backend
        assert not (tmp_path / f"{backend}-fresh.bin").exists(), f"{backend}: a failed write left the file it created"
