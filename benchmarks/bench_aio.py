"""Sequential file I/O benchmark: zinf AsyncIO vs fio vs torch.save/load vs numpy tofile/fromfile.

Setup (once): `apt-get install -y fio` (the fio column is skipped when fio is missing).

    python benchmarks/bench_aio.py [--size-gib 2] [--dir /tmp] [--block-size 1M] [--queue-depth 32]

zinf and fio both use O_DIRECT with the same block size and queue depth (fio: io_uring engine).
Before every read the page cache is dropped (`echo 3 > /proc/sys/vm/drop_caches`) when allowed;
the header says whether it was. Buffered writers (torch.save, numpy) are timed including os.fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from zinf import native


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def parse_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s.rstrip("KMG")) * mult)


def zinf_io(buf: torch.Tensor, path: Path, write: bool, block: int, qd: int, threads: int, backend: str) -> float:
    with native.AsyncIO(block_size=block, queue_depth=qd, num_threads=threads, backend=backend) as aio:
        if not write:
            drop_caches()
        t0 = time.perf_counter()
        h = aio.submit_write(buf, path) if write else aio.submit_read(buf, path)
        aio.wait(h)
        if write:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return time.perf_counter() - t0


def fio(path: Path, write: bool, nbytes: int, block: int, qd: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    if not write:
        drop_caches()
    cmd = ["fio", "--name=zinf", f"--filename={path}", f"--rw={'write' if write else 'read'}", f"--bs={block}",
           f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", f"--size={nbytes}", "--numjobs=1",
           "--output-format=json"] + (["--end_fsync=1"] if write else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["write" if write else "read"]
    return nbytes / job["bw_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--block-size", default="1M")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    nbytes = int(args.size_gib * (1 << 30)) // 4096 * 4096
    block, qd = parse_bytes(args.block_size), args.queue_depth
    d = Path(args.dir)
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(d)], capture_output=True, text=True).stdout.strip()
    can_drop = drop_caches()
    print(f"file {nbytes / 2**30:.2f} GiB in {d} ({fs}), block {block}, queue depth {qd}, threads {args.threads}, "
          f"page cache dropped before reads: {can_drop}, zinf io backend: {native.info().io_backend}")
    pool = native.PinnedBufferPool(nbytes)
    buf = pool.acquire(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    path = d / "zinf_bench_aio.bin"
    results: dict[str, dict[str, float | None]] = {}

    def best(fn: object) -> float | None:
        ts = [fn() for _ in range(args.reps)]  # type: ignore[operator]
        return None if any(t is None for t in ts) else min(ts)  # type: ignore[type-var]

    backends = ["io_uring", "threads"] if native.info().io_backend == "io_uring" else ["threads"]
    for b in backends:
        results[f"zinf AsyncIO ({b}, O_DIRECT)"] = {
            "write": best(lambda: zinf_io(buf, path, True, block, qd, args.threads, b)),
            "read": best(lambda: zinf_io(buf, path, False, block, qd, args.threads, b)),
        }
    results["fio (io_uring, O_DIRECT)"] = {"write": best(lambda: fio(path, True, nbytes, block, qd)),
                                           "read": best(lambda: fio(path, False, nbytes, block, qd))}
    path.unlink(missing_ok=True)

    def torch_save() -> float:
        t0 = time.perf_counter()
        torch.save(buf, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t0

    def torch_load() -> float:
        drop_caches()
        t0 = time.perf_counter()
        torch.load(path)
        return time.perf_counter() - t0

    results["torch.save / torch.load"] = {"write": best(torch_save), "read": best(torch_load)}
    path.unlink(missing_ok=True)
    arr = buf.numpy()

    def np_write() -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def np_read() -> float:
        drop_caches()
        t0 = time.perf_counter()
        np.fromfile(path, dtype=np.uint8)
        return time.perf_counter() - t0

    results["numpy tofile / fromfile"] = {"write": best(np_write), "read": best(np_read)}
    path.unlink(missing_ok=True)

    fio_r = results["fio (io_uring, O_DIRECT)"]
    print("\n| method | write GB/s | read GB/s | write vs fio | read vs fio |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        cells = []
        for k in ("write", "read"):
            cells.append(f"{nbytes / r[k] / 1e9:.2f}" if r[k] else "n/a")
        ratios = []
        for k in ("write", "read"):
            ratios.append(f"{fio_r[k] / r[k] * 100:.0f}%" if r[k] and fio_r[k] else "n/a")
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
