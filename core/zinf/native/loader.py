"""Loading zinf's C++ extension ``zinf._native``: the only ``import`` of it in zinf.

Every other module of :mod:`zinf.native` takes ``_native`` (the extension module, or None when it
did not load) from here. Set ``ZINF_REQUIRE_NATIVE=1`` to make a missing or broken extension an
``ImportError`` at import time instead of a silent fallback to the pure-Python implementations.

Stubs: the extension itself is typed by ``zinf/_native.pyi`` (it must sit beside the built
``zinf/_native*.so``); each submodule's stub sits beside the Python module that wraps it
(``native/_native_adam.pyi`` beside ``native/adam.py``, and so on).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["NativeInfo", "info", "require", "set_num_threads", "set_simd_level", "source_fingerprint", "stale_build"]

_BUILD_HINT = (
    "build it with `pip install -e .` (editable) or `pip install .` from the zinf repository root "
    "(needs a C++17 compiler, CMake and pybind11; no CUDA or libtorch headers)"
)

_native: ModuleType | None
_load_error: str | None
try:
    from zinf import _native  # type: ignore[attr-defined, no-redef]

    _load_error = None
except Exception as exc:  # ImportError, or an OSError from a broken .so
    _native = None
    _load_error = f"{type(exc).__name__}: {exc}"



def source_fingerprint(cpp_dir: Path) -> str:
    """The fingerprint cpp/CMakeLists.txt builds into the extension: SHA-256 over the lines "<path> <SHA-256>\\n"
    of every .cpp and .h under ``cpp_dir`` but torch_linked/ (built apart, at first use), sorted by path."""
    files = sorted(p.relative_to(cpp_dir).as_posix() for p in cpp_dir.rglob("*") if p.suffix in (".cpp", ".h"))
    lines = "".join(f"{f} {hashlib.sha256((cpp_dir / f).read_bytes()).hexdigest()}\n"
                    for f in files if not f.startswith("torch_linked/"))
    return hashlib.sha256(lines.encode()).hexdigest()


def stale_build(built: str, cpp_dir: Path) -> str | None:
    """Why an extension of fingerprint ``built`` does not match the sources in ``cpp_dir`` (None where it does, or
    where there are no sources: an installed wheel): an editable install whose C++ changed since it was built."""
    if not (cpp_dir / "CMakeLists.txt").is_file() or built == source_fingerprint(cpp_dir):
        return None
    return (f"the extension was built from other C++ sources than those in {cpp_dir} (changed since the build); "
            "rebuild it with `pip install -e .` from the repository root")


_CHECKOUT_CPP = Path(__file__).resolve().parents[3] / "cpp"  # core/zinf/native/loader.py in a source checkout
if _native is not None:
    _load_error = stale_build(getattr(_native, "source_fingerprint", ""), _CHECKOUT_CPP)
    if _load_error is not None:
        _native = None
        logging.getLogger(__name__).warning("zinf: not using the C++ extension: %s", _load_error)

if _native is None and os.environ.get("ZINF_REQUIRE_NATIVE", "0") not in ("", "0"):
    raise ImportError(
        f"ZINF_REQUIRE_NATIVE is set but the zinf C++ extension zinf._native could not be loaded "
        f"({_load_error}); {_BUILD_HINT}"
    )

SIMD_LEVELS = ("avx512", "avx2", "scalar")
_simd_wanted = os.environ.get("ZINF_SIMD")
if _simd_wanted is not None and _simd_wanted not in SIMD_LEVELS:  # the kernels would run at the CPU's best level
    raise ValueError(f"ZINF_SIMD={_simd_wanted!r} is not a SIMD level of zinf's CPU-Adam; set one of {list(SIMD_LEVELS)} "
                     "(at most what this CPU has) or unset it")


@dataclass(frozen=True)
class NativeInfo:
    """What the native build provides on this machine."""

    available: bool
    simd_level: str  # "avx512" | "avx2" | "scalar" | "none" (no extension)
    io_backend: str  # "io_uring" | "threads" | "python-threads" (no extension)
    num_threads: int  # OpenMP threads used by the Adam kernels
    error: str | None  # why the extension did not load


def info() -> NativeInfo:
    """Report what was built and what it will use here."""
    if _native is None:
        return NativeInfo(False, "none", "python-threads", torch.get_num_threads(), _load_error)
    io_backend = "io_uring" if _native.aio.uring_available() else "threads"
    if os.environ.get("ZINF_AIO_BACKEND") == "threads":
        io_backend = "threads"
    return NativeInfo(True, _native.adam.simd_level(), io_backend, _native.adam.num_threads(), None)


def require() -> ModuleType:
    """Return the extension module or raise ImportError saying how to build it."""
    if _native is None:
        raise ImportError(f"the zinf C++ extension zinf._native is not available ({_load_error}); {_BUILD_HINT}")
    return _native


def set_simd_level(level: str) -> None:
    """Force the SIMD level of the Adam kernels and the widening: 'avx512', 'avx2' or 'scalar' (also env ZINF_SIMD)."""
    require().adam.set_simd_level(level)


def set_num_threads(num_threads: int) -> None:
    """Number of OpenMP threads the Adam kernels use (default: OMP_NUM_THREADS or all cores)."""
    require().adam.set_num_threads(num_threads)
