"""Gather buffers whose memory stays mapped from one gather to the next.

[Note: gather buffer cache]
On the CPU every gather allocates its group's full buffer (and, from narrow or 4-bit shards, the buffer the shards
are gathered into), and the reshard frees it; blocks that large are mappings of their own, so each gather's first
touch of its memory faults in fresh, zeroed pages, about ten times the cost of the widening copy itself
(``benchmarks/bench_gather_buffers.py``). A 13B LoRA step gathers about 100 GB a rank that way.

The full buffer cannot simply be kept: autograd saves views of the parameters, and the contract that keeps those
views valid is that a group's full buffer is always the same storage, resized to 0 at the reshard and back at the
next gather ([Note: releasing memory] in zinf/param/layout.py). So the cache sits behind that storage, as its
allocator: ``cpp/torch_linked/buffer_cache.cpp``, a ``c10::Allocator`` that keeps a freed block for the next
allocation of the same size. ``resize(storage, nbytes)`` points the storage at it and resizes; the reshard's
``resize_(0)`` hands the block back to it. The same storage, the same views, memory that stays mapped.

Bounded by construction: the blocks in use and the blocks kept together stay within a quarter more than the most
ever in use at once, plus the largest block, at every moment: a miss makes room for its fresh block before taking it,
and a freed block is kept only where it fits (the least recently freed kept blocks go first to make room). Without
that slack the blocks a step needs next are evicted at its peak, a few misses a step. So gather memory stays within
1.25 times its own high-water mark and one block. Each engine has a cache of its own (``buffer_cache()`` makes one):
its bound follows its own gathers, its step report counts its own bytes kept at the end of the step, hits and misses
(``gather_cache_bytes``, ``gather_cache_hits``, ``gather_cache_misses``: gather memory, within the gathered peak,
not in the engine's resident bytes), and its close gives back its own blocks, not another engine's. A closed cache
keeps nothing; a block it handed out goes back to it (and is freed) whichever engine resizes the storage later.

It is the one part of zinf that links torch: c10's allocator interface is C++, so the file is built against the
installed torch's headers, once per torch version, into ``ZINF_CACHE_DIR`` (default ``~/.cache/zinf``) with the
system C++ compiler (under a second), and called through a plain C interface. Where that cannot be done (no
compiler, not Linux) gathers allocate as torch does and the run is the same, slower; ``zinf info`` says which, and
``ZINF_REQUIRE_NATIVE=1`` makes it an error. ``overlap.gather_cache: off`` turns it off. Where the engine trims the
host heap (CPU compute, parameters offloaded: host memory is what the run is short of), only frozen groups' gathers
use it (``RunContext.gather_cache``): a frozen base's gathers are most of a LoRA step, while a full fine-tune there
would hold up to a quarter more gather memory at its peak, and the cache's blocks between steps.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["BufferCache", "CacheStats", "buffer_cache", "unavailable_reason"]

log = logging.getLogger(__name__)

_SOURCE_NAME = "buffer_cache.cpp"
_LIB_NAME = "libzinf_buffer_cache.so"
_state: dict[str, object] = {}  # the library, loaded once per process: "lib", "path", "error"


@dataclass(frozen=True)
class CacheStats:
    cached_bytes: int  # kept for the next gather, not in use
    live_bytes: int  # in use by gather buffers now
    peak_live_bytes: int  # the most in use at once so far (live + cached stay within 1.25 times it and a block)
    hits: int  # allocations served from kept blocks
    misses: int  # allocations that took fresh memory
    freed: int  # blocks given back to the system (no room to keep them)
    largest_bytes: int  # the largest block so far (the "one block" of the bound)


class BufferCache:
    """One engine's gather buffer cache: its own kept blocks, bound and counts (``buffer_cache()`` makes one)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self._lib = lib
        self.path = path
        self._handle = ctypes.c_void_p()
        lib.zinf_buffer_cache_new(ctypes.byref(self._handle))
        self._taken = (0, 0)

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Resize ``storage`` (a CPU storage) to ``nbytes`` through the cache: from now on its memory comes from the
        cache and goes back to it when it is resized to 0 or freed."""
        if self._lib.zinf_buffer_cache_attach(self._handle, ctypes.c_void_p(storage._cdata)) != 0:
            raise ValueError("zinf: the gather buffer cache was handed a storage that cannot be resized")
        storage.resize_(nbytes)

    def empty(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty(numel, dtype=dtype, device=device)``, its memory from the cache (on the CPU)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        out = torch.empty(0, dtype=dtype)
        self.resize(out.untyped_storage(), numel * out.element_size())
        return out.set_(out.untyped_storage(), 0, (numel,))

    def stats(self) -> CacheStats:
        out = (ctypes.c_uint64 * 7)()
        self._lib.zinf_buffer_cache_stats(self._handle, out)
        return CacheStats(*[int(v) for v in out])

    def take_counts(self) -> dict[str, int]:
        """Hits and misses since the last call and the bytes kept now (a step report's ``gather_cache_hits``,
        ``gather_cache_misses``, ``gather_cache_bytes``)."""
        now = self.stats()
        hits, misses = now.hits - self._taken[0], now.misses - self._taken[1]
        self._taken = (now.hits, now.misses)
        return {"gather_cache_hits": hits, "gather_cache_misses": misses, "gather_cache_bytes": now.cached_bytes}

    def clear(self) -> None:
        """Give every kept block back to the system and start the bound again from the bytes in use now."""
        self._lib.zinf_buffer_cache_clear(self._handle)

    def close(self) -> None:
        """Give every kept block back to the system and keep none from now on (its engine closed): a block still in
        use is freed when its storage lets it go."""
        self._lib.zinf_buffer_cache_close(self._handle)


def _source() -> Path | None:
    here = Path(__file__).resolve().parent
    for candidate in (here / _SOURCE_NAME, here.parents[2] / "cpp" / "torch_linked" / _SOURCE_NAME):
        if candidate.is_file():
            return candidate
    return None


def _cache_dir() -> Path:
    root = os.environ.get("ZINF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zinf")
    return Path(root)


def _build(source: Path) -> Path:
    """The library built from ``source`` against this torch (reused when already built; built once per torch
    version and source, atomically, so ranks starting together do not trip over each other)."""
    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cxx = os.environ.get("CXX", "c++")
    text = source.read_bytes()
    key = hashlib.sha256(text + f"{torch.__version__}|{abi}|{cxx}|{torch_dir}".encode()).hexdigest()[:16]
    out_dir = _cache_dir() / f"torch_linked-{key}"
    lib = out_dir / _LIB_NAME
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.part")
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-I", str(torch_dir / "include"), str(source), "-o", tmp,
           "-L", str(torch_dir / "lib"), "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load() -> tuple[ctypes.CDLL, Path]:
    if not sys.platform.startswith("linux"):
        raise RuntimeError("it is built for Linux only")
    source = _source()
    if source is None:
        raise RuntimeError(f"its source {_SOURCE_NAME} is not installed with zinf")
    path = _build(source)
    return ctypes.CDLL(str(path)), path  # every argument is passed as its ctypes type


def buffer_cache() -> BufferCache | None:
    """A new gather buffer cache (one per engine), the library built and loaded on first use; None where it cannot
    be (``unavailable_reason`` says why; with ``ZINF_REQUIRE_NATIVE=1`` that is an error)."""
    if "error" not in _state:
        try:
            (_state["lib"], _state["path"]), _state["error"] = _load(), None
        except Exception as exc:  # no compiler, no headers, a failed build or load: gathers allocate as torch does
            _state["error"] = f"{type(exc).__name__}: {exc}"
            if os.environ.get("ZINF_REQUIRE_NATIVE", "0") not in ("", "0"):
                raise ImportError(f"ZINF_REQUIRE_NATIVE is set but zinf's gather buffer cache could not be built "
                                  f"({_state['error']}); it needs a C++17 compiler (CXX, else c++)") from exc
            log.warning("zinf: gathers allocate fresh memory each time: the gather buffer cache is unavailable (%s)",
                        _state["error"])
    lib, path = _state.get("lib"), _state.get("path")
    return BufferCache(lib, path) if isinstance(lib, ctypes.CDLL) and isinstance(path, Path) else None


def unavailable_reason() -> str | None:
    """Why ``buffer_cache()`` returned None (None when it was not asked for yet or is available)."""
    error = _state.get("error")
    return error if isinstance(error, str) else None
