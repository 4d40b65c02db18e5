"""The CPU-Adam's AVX2 and scalar kernels never call code built for AVX-512, and the widening's wide registers stay in
its functions for those instruction sets.

The helpers of cpp/adam's shared headers (conversions, the scalar Adam body, the int8 moments) are compiled into
each instruction set's kernel file. As ordinary inline functions, a helper the compiler did not inline is one weak
symbol in every file, and the linker keeps one of the builds, maybe the AVX-512 one, for every kernel to call: a
crash (SIGILL) on a CPU without AVX-512 that a machine with it never shows. Each kernel file names its instruction
set (an inline namespace, ``ZINF_ISA``), so no weak symbol is defined by two of them: checked here on the objects the
build makes (the same files and flags as cpp/CMakeLists.txt, compiled apart). cpp/convert/widen.cpp and
cpp/quant/four_bit.cpp keep each instruction set's loop in a function of its own target instead: their disassembly
shows AVX-512 registers only in ``widen_avx512`` (``decode_avx512``) and AVX registers only there and in
``widen_avx2`` (``decode_avx2``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ADAM = ROOT / "cpp" / "adam"


def _cmake() -> str:
    return (ROOT / "cpp" / "CMakeLists.txt").read_text()


def _common_flags() -> list[str]:
    """The flags cpp/CMakeLists.txt gives every file (ZINF_COMMON_FLAGS)."""
    return re.search(r"set\(ZINF_COMMON_FLAGS ([^)]*)\)", _cmake()).group(1).split()  # type: ignore[union-attr]


def _flags() -> dict[str, list[str]]:
    """Each kernel file's compile flags, as cpp/CMakeLists.txt gives them."""
    text = _cmake()
    common = _common_flags()
    out = {"kernels_scalar.cpp": list(common)}
    for isa in ("avx512", "avx2"):
        opts = re.search(rf"target_compile_options\(zinf_kernels_{isa} PRIVATE \$\{{ZINF_COMMON_FLAGS\}} ([^)]*)\)", text)
        assert opts is not None, isa
        out[f"kernels_{isa}.cpp"] = common + opts.group(1).split()
    return out


def _weak_symbols(obj: Path) -> set[str]:
    text = subprocess.run(["nm", "-C", "--defined-only", str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split(" ", 2)[2] for line in text.splitlines() if line.split(" ")[1:2] and line.split(" ")[1] in "WVu"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_no_helper_is_shared_between_instruction_sets(tmp_path: Path) -> None:
    jobs = {name: subprocess.Popen(["g++", "-std=c++17", "-c", f"-I{ADAM}", *flags, str(ADAM / name), "-o",
                                    str(tmp_path / f"{name}.o")], stderr=subprocess.PIPE, text=True)
            for name, flags in _flags().items()}
    for name, job in jobs.items():
        assert job.wait() == 0, f"{name}: {job.stderr.read() if job.stderr else ''}"
    weak = {name: _weak_symbols(tmp_path / f"{name}.o") for name in jobs}
    wide = weak.pop("kernels_avx512.cpp")
    for name, symbols in weak.items():
        assert not wide & symbols, f"{name} and kernels_avx512.cpp both define {sorted(wide & symbols)}"


def _registers_by_function(obj: Path) -> dict[str, set[str]]:
    """For each function of ``obj``, the kinds of vector register its instructions name ("zmm", "ymm")."""
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(obj)], check=True, capture_output=True,
                          text=True).stdout
    out: dict[str, set[str]] = {}
    name = ""
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
            out[name] = set()
        elif name:
            out[name].update(re.findall(r"%(zmm|ymm)", line))
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("objdump") is None, reason="needs g++ and objdump")
@pytest.mark.parametrize("source,prefix", [("convert/widen.cpp", "widen_"), ("quant/four_bit.cpp", "decode_")])
def test_wide_registers_stay_in_their_own_functions(tmp_path: Path, source: str, prefix: str) -> None:
    obj = tmp_path / "kernels.o"
    subprocess.run(["g++", "-std=c++17", "-fopenmp", "-c", *_common_flags(), str(ROOT / "cpp" / source), "-o", str(obj)],
                   check=True, capture_output=True)
    assert not _weak_symbols(obj) - {"DW.ref.__gxx_personality_v0"}
    found = _registers_by_function(obj)
    assert any(f"{prefix}avx512" in f and "zmm" in regs for f, regs in found.items()), sorted(found)
    for function, regs in found.items():
        if "zmm" in regs:
            assert f"{prefix}avx512" in function, function
        if "ymm" in regs:
            assert f"{prefix}avx512" in function or f"{prefix}avx2" in function, function
