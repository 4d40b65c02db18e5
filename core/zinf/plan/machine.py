"""What the planner knows about the machine: capacities per tier and bandwidths measured on the spot.

:class:`Machine` holds the figures; :func:`measure_machine` measures them (tests and callers may build a
``Machine`` by hand instead). The measurements are short:

- disk read and write through zinf's own AsyncIO (O_DIRECT, 1 MiB blocks, 32 in flight, the engine's
  defaults), 256 MiB per path, cached in ``~/.cache/zinf/disk_bandwidth.json`` by path and device
  (``remeasure=True`` measures again);
- host memory bandwidth: a copy of 256 MiB between two host tensors (bytes read + written per second);
- compute: a matrix product in each precision on the compute device, at the model's shape when known;
- with CUDA, host-to-device copies from pinned memory;
- all-gather bandwidth: measured when a process group is up, otherwise estimated (and said so): on one
  machine with gloo, from host memory bandwidth; with NCCL, not measured (give ``allgather_gbps``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from zinf.host_room import available_ram

__all__ = ["Machine", "measure_machine", "available_ram", "nvme_free_bytes", "GLOO_FRACTION_OF_HOST_BW"]

# gloo on one machine moves a gathered byte through the loopback/shared-memory transport: copies into and out of
# socket buffers, about a quarter of a plain memcpy's rate (bytes read + written); an estimate, not measured
GLOO_FRACTION_OF_HOST_BW = 0.25
# the fixed cost of one gloo collective between processes of one machine (both ranks' Python, the engine's round
# agreement, the transport); fitted to the two-rank GPT run of docs/planner.md
GLOO_LATENCY_S = 1.5e-3
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zinf" / "disk_bandwidth.json"


@dataclass(kw_only=True)
class Machine:
    """Capacities (bytes) and bandwidths (bytes per second) of one machine, as the planner uses them.

    ``device``: "cuda" or "cpu" (CPU compute: the "device" tier is host memory). ``device_bytes``: CUDA
    memory of one GPU, or the host's available RAM on CPU. ``flops``: matrix-product FLOP/s per precision on the
    compute device. ``host_bw``: bytes read + written per second by a big host copy. ``disk_read_bw`` /
    ``disk_write_bw``: per NVMe path; paths on one file system share it. ``device_bw``: device memory copy
    rate (host_bw on CPU). ``h2d_bw``: pinned host-to-device copies (None on CPU). ``allgather_bw``: bytes a rank
    receives per second in an all-gather (None: world 1, or unknown), ``allgather_source`` says how it was found.
    ``cores``: CPU cores the ranks on this machine share; ``threads``: the threads the CPU measurements ran with
    (each rank is assumed to run as many). ``collective_latency``: seconds of fixed cost per collective.
    """

    device: str
    device_name: str
    device_bytes: int
    host_bytes: int
    cores: int
    flops: dict[str, float]
    host_bw: float
    device_bw: float
    nvme_free_bytes: dict[str, int] = field(default_factory=dict)
    disk_read_bw: dict[str, float] = field(default_factory=dict)
    disk_write_bw: dict[str, float] = field(default_factory=dict)
    disk_mixed_bw: dict[str, float] = field(default_factory=dict)  # reads + writes at once, bytes/s together
    h2d_bw: float | None = None
    allgather_bw: float | None = None
    allgather_source: str = "not needed (world 1)"
    threads: int = 1
    collective_latency: float = GLOO_LATENCY_S
    notes: list[str] = field(default_factory=list)

    def cpu_share(self, ranks: int) -> float:
        """The share of the measured CPU compute rate each of ``ranks`` ranks on this machine gets."""
        return min(1.0, self.cores / (max(1, ranks) * max(1, self.threads)))

    def flops_for(self, precision: str) -> float:
        if precision in self.flops:
            return self.flops[precision]
        low = [v for k, v in self.flops.items() if k in ("bf16", "fp16")]
        return low[0] if precision in ("bf16", "fp16") and low else self.flops["fp32"]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "machine description") -> "Machine":
        """A machine as ``to_dict`` (or the "machine" entry of ``zinf plan --json``) wrote it; each field is checked
        (``source`` names where it came from in the errors)."""
        from dataclasses import fields

        from zinf.plan.model import PlanError

        if not isinstance(data, dict):
            raise PlanError(f"zinf plan: {source} must be a JSON object (the \"machine\" entry of 'zinf plan --json'), "
                            f"found {type(data).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"zinf plan: {source} has unknown keys {unknown}; expected {sorted(known)}.")
        try:
            machine = cls(**data)
        except TypeError as exc:
            raise PlanError(f"zinf plan: {source} is incomplete ({exc}).") from None
        for name, value, kind in _field_kinds(machine):
            problem = _field_problem(value, kind)
            if problem:
                raise PlanError(f"zinf plan: {source}: field {name!r} = {value!r} is not allowed; expected {problem}.")
        counts = {name: int(getattr(machine, name)) for name in ("device_bytes", "host_bytes", "cores", "threads")}
        return replace(machine, **counts, nvme_free_bytes={p: int(v) for p, v in machine.nvme_free_bytes.items()})

    @classmethod
    def load(cls, path: str) -> "Machine":
        """A JSON file holding a machine, or a whole ``zinf plan --json`` output (its "machine" entry)."""
        from zinf.plan.model import PlanError

        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"zinf plan: --machine {path!r} does not exist; give a JSON file written by "
                            "'zinf plan --json' (its \"machine\" entry).") from None
        except ValueError as exc:
            raise PlanError(f"zinf plan: --machine {path!r} is not JSON ({exc}).") from None
        return cls.from_dict(data.get("machine", data) if isinstance(data, dict) else data, f"--machine {path!r}")


def _field_kinds(m: Machine) -> list[tuple[str, object, str]]:
    """Each field of ``m`` with what it must hold: "speed" (a finite number > 0), "bytes" (a whole number >= 0),
    "count" (a whole number >= 1), "seconds" (a finite number >= 0), "text"; "?" allows None, "{}" a dict of them by
    name, "[]" a list of them."""
    return [("device", m.device, "device"), ("device_name", m.device_name, "text"), ("device_bytes", m.device_bytes, "bytes"),
            ("host_bytes", m.host_bytes, "bytes"), ("cores", m.cores, "count"), ("flops", m.flops, "{speed}+"),
            ("host_bw", m.host_bw, "speed"), ("device_bw", m.device_bw, "speed"),
            ("nvme_free_bytes", m.nvme_free_bytes, "{bytes}"), ("disk_read_bw", m.disk_read_bw, "{speed}"),
            ("disk_write_bw", m.disk_write_bw, "{speed}"), ("disk_mixed_bw", m.disk_mixed_bw, "{speed}"),
            ("h2d_bw", m.h2d_bw, "speed?"), ("allgather_bw", m.allgather_bw, "speed?"),
            ("allgather_source", m.allgather_source, "text"), ("threads", m.threads, "count"),
            ("collective_latency", m.collective_latency, "seconds"), ("notes", m.notes, "[text]")]


_EXPECTED = {"speed": "a finite number > 0 (per second)", "bytes": "a whole number of bytes >= 0",
             "count": "a whole number >= 1", "seconds": "a finite number of seconds >= 0", "text": "a string",
             "device": "'cpu' or 'cuda'"}


def _field_problem(value: object, kind: str) -> str | None:
    """What ``value`` should be instead, or None when it is a ``kind`` (see ``_field_kinds``)."""
    if kind.endswith("?"):
        return None if value is None else _field_problem(value, kind[:-1])
    if kind.startswith("{"):
        inner, nonempty = kind[1:kind.index("}")], kind.endswith("+")
        what = f"a JSON object{' (not empty)' if nonempty else ''} of {_EXPECTED[inner]} by name"
        if not isinstance(value, dict) or (nonempty and not value):
            return what
        bad = any(not isinstance(k, str) or _field_problem(v, inner) for k, v in value.items())
        return what if bad else None
    if kind.startswith("["):
        inner = kind[1:-1]
        ok = isinstance(value, list) and all(_field_problem(v, inner) is None for v in value)
        return None if ok else f"a JSON list of {_EXPECTED[inner]}"
    if kind in ("text", "device"):
        ok = isinstance(value, str) and (kind == "text" or value in ("cpu", "cuda"))
        return None if ok else _EXPECTED[kind]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return _EXPECTED[kind]
    if kind in ("bytes", "count") and value != int(value):
        return _EXPECTED[kind]
    low_ok = value > 0 if kind == "speed" else value >= (1 if kind == "count" else 0)
    return None if low_ok else _EXPECTED[kind]


def _device_key(path: str) -> str:
    return f"{os.path.realpath(path)}@{os.stat(path).st_dev}"


def nvme_free_bytes(paths: Sequence[str]) -> dict[str, int]:
    """Free bytes at each path; a path that does not exist is a clear error (create it first)."""
    from zinf.plan.model import PlanError

    out = {}
    for p in paths:
        if not os.path.isdir(p):
            raise PlanError(f"zinf plan: --nvme {p!r} does not exist or is not a directory; create it (mkdir -p {p}) "
                            "or give the directory on the NVMe drive where offload files should go.")
        out[p] = shutil.disk_usage(p).free
    return out


def _load_cache() -> dict:
    try:
        return json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(data: dict) -> None:
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        _CACHE.write_text(json.dumps(data, indent=1, sort_keys=True))
    except OSError:  # a read-only home: measure again next time
        pass


def measure_disk(path: str, nbytes: int = 256 << 20) -> tuple[float, float, float]:
    """Read, write and mixed bytes/s at ``path``, measured as ``zinf info --nvme`` measures them
    (:func:`zinf.offload.disk_speed.measure_path`: the offload engine reads and writes at once; some drives serve
    both faster than either alone, some slower)."""
    from zinf.offload.disk_speed import measure_path

    write_gbs, read_gbs, mixed_gbs, _ = measure_path(path, nbytes)
    return read_gbs * 1e9, write_gbs * 1e9, mixed_gbs * 1e9


def measure_host_bw(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes read + written per second by a host copy of ``nbytes``: the median of ``reps``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = sorted(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * nbytes / times[reps // 2]


def measure_flops(device: torch.device, precision: str, shape: tuple[int, int, int], windows: int = 5,
                  budget_seconds: float = 2.0) -> float:
    """FLOP/s of ``(m, k) @ (k, n)`` in ``precision`` on ``device``: the median of ``windows`` windows, the whole
    measurement bounded by about ``budget_seconds`` whatever the machine (a shared machine's load moves). A first,
    product of one row grows (x4) until one product takes about a fifth of a window: a dtype the CPU computes without
    native units (bf16 at a fraction of a GFLOP/s) is measured on fewer rows, never for minutes."""
    from zinf.config import PRECISIONS

    m, k, n = matmul_shape_used(device, shape)
    dtype = PRECISIONS[precision]
    window = budget_seconds / (windows + 2)
    b = torch.randn(k, n, device=device).to(dtype)
    rows = 1
    while True:  # grow the rows (x4) until one product takes a tenth of a window, or the model's shape is reached
        a = torch.randn(rows, k, device=device).to(dtype)
        took = _timed(lambda: (torch.mm(a, b), _sync(device)))
        if rows >= m or took >= window / 5:
            break
        rows = min(m, rows * 4)
    return sorted(_flops_window(a, b, window) for _ in range(windows))[windows // 2]


def matmul_shape_used(device: torch.device, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    m, k, n = shape
    if device.type == "cpu":  # keep one product under ~8 GFLOP, so that this takes a second, not a minute
        m = max(64, min(m, int(8e9 // (2 * k * n))))
    return m, k, n


def _flops_window(a: torch.Tensor, b: torch.Tensor, min_seconds: float) -> float:
    (m, k), n = a.shape, b.shape[1]
    device = a.device
    count, start = 0, time.perf_counter()
    every = 1 if device.type == "cpu" else 8
    while True:
        torch.mm(a, b)
        count += 1
        if count % every == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return 2 * m * k * n * count / elapsed


def _measure_cuda_copy(nbytes: int = 256 << 20) -> tuple[float, float]:  # pragma: no cover - CUDA only
    dev = torch.device("cuda")
    host = torch.ones(nbytes // 4, pin_memory=True)
    d = torch.empty(nbytes // 4, device=dev)
    d2 = torch.empty_like(d)
    d.copy_(host)
    _sync(dev)
    h2d = nbytes / min(_timed(lambda: (d.copy_(host, non_blocking=True), _sync(dev))) for _ in range(3))
    dev_bw = 2 * nbytes / min(_timed(lambda: (d2.copy_(d), _sync(dev))) for _ in range(3))
    return h2d, dev_bw


def _measure_allgather() -> float:
    """Bytes received per second by this rank in an all-gather of 64 MiB over the process group that is up."""
    from zinf.runtime.collectives import all_gather_now
    from zinf.runtime.comm import Comm, default_device

    dev = default_device()
    comm = Comm.current(device=dev)
    world = comm.world
    shard = torch.ones((64 << 20) // 4 // world, device=dev)
    full = torch.empty(shard.numel() * world, device=dev)
    all_gather_now(comm, full, shard)
    _sync(dev)
    t = min(_timed(lambda: (all_gather_now(comm, full, shard), _sync(dev))) for _ in range(3))
    return shard.numel() * 4 * (world - 1) / t


def _measure_latency() -> float:
    """Seconds of one small all-reduce over the process group that is up (the fixed cost of a collective)."""
    import torch.distributed as dist

    from zinf.runtime.comm import default_device

    x = torch.ones(1, device=default_device())
    dist.all_reduce(x)
    count, start = 0, time.perf_counter()
    while count < 20:
        dist.all_reduce(x)
        count += 1
    _sync(x.device)
    return (time.perf_counter() - start) / count


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - CUDA only
        torch.cuda.synchronize(device)


def measure_machine(nvme_paths: Sequence[str] = (), precisions: Sequence[str] = ("fp32",), world: int = 1,
                    matmul_shape: tuple[int, int, int] = (2048, 2048, 2048), remeasure: bool = False,
                    disk_bytes: int = 256 << 20, allgather_gbps: float | None = None) -> Machine:
    """Measure this machine (a few seconds; the disk figures come from the cache unless ``remeasure``)."""
    import torch.distributed as dist

    notes: list[str] = []
    free = nvme_free_bytes(nvme_paths)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    host_bytes = available_ram()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    host_bw = measure_host_bw()
    flops = {p: measure_flops(device, p, matmul_shape) for p in dict.fromkeys(precisions)}
    m, k, n = matmul_shape_used(device, matmul_shape)
    notes.append(f"compute: torch.mm {m}x{k} @ {k}x{n} on {device.type}, {torch.get_num_threads()} threads")
    h2d = None
    if cuda:  # pragma: no cover - CUDA only
        free_dev, total_dev = torch.cuda.mem_get_info()
        device_bytes, name = int(total_dev), torch.cuda.get_device_name()
        h2d, device_bw = _measure_cuda_copy()
    else:
        device_bytes, name, device_bw = host_bytes, f"CPU ({cores} cores; the device tier is host memory)", host_bw
    read_bw: dict[str, float] = {}
    write_bw: dict[str, float] = {}
    mixed_bw: dict[str, float] = {}
    cache = _load_cache()
    for p in nvme_paths:
        key = _device_key(p)
        if key in cache and "mixed" in cache[key] and not remeasure:
            read_bw[p], write_bw[p], mixed_bw[p] = cache[key]["read"], cache[key]["write"], cache[key]["mixed"]
            notes.append(f"disk {p}: cached in {_CACHE} (measured {cache[key].get('when', '?')}; --remeasure to redo)")
            continue
        read_bw[p], write_bw[p], mixed_bw[p] = measure_disk(p, disk_bytes)
        cache[key] = {"read": read_bw[p], "write": write_bw[p], "mixed": mixed_bw[p], "when": time.strftime("%Y-%m-%d %H:%M")}
        notes.append(f"disk {p}: measured now ({disk_bytes >> 20} MiB through zinf AsyncIO)")
    if nvme_paths:
        _save_cache(cache)
    allgather_bw, source, latency = None, "not needed (world 1)", GLOO_LATENCY_S if not cuda else 5e-5
    if allgather_gbps is not None:
        allgather_bw, source = allgather_gbps * 1e9, "given (--allgather-gbps)"
    elif world > 1 and dist.is_available() and dist.is_initialized():
        allgather_bw, latency = _measure_allgather(), _measure_latency()
        source = f"measured on the {dist.get_backend()} process group that is up"
    elif world > 1 and not cuda:
        allgather_bw = host_bw * GLOO_FRACTION_OF_HOST_BW
        source = (f"estimated: gloo on one machine at {GLOO_FRACTION_OF_HOST_BW:g} x host memory bandwidth, "
                  f"{GLOO_LATENCY_S * 1e3:g} ms per collective (no process group up to measure)")
    elif world > 1:  # pragma: no cover - CUDA only
        source = "unknown: no process group up to measure; give --allgather-gbps"
    return Machine(device=device.type, device_name=name, device_bytes=device_bytes, host_bytes=host_bytes, cores=cores,
                   flops=flops, host_bw=host_bw, device_bw=device_bw, nvme_free_bytes=free, disk_read_bw=read_bw,
                   disk_write_bw=write_bw, disk_mixed_bw=mixed_bw, h2d_bw=h2d, allgather_bw=allgather_bw, allgather_source=source,
                   threads=torch.get_num_threads(), collective_latency=latency, notes=notes)
