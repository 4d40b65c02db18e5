"""An editable build whose C++ changed since it was built is refused with the fix, not called with stale signatures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from zinf.native import loader

CPP = Path(__file__).resolve().parents[3] / "cpp"


def test_the_built_extension_carries_the_fingerprint_of_these_sources() -> None:
    native = pytest.importorskip("zinf._native")
    assert native.source_fingerprint == loader.source_fingerprint(CPP)
    assert loader.stale_build(native.source_fingerprint, CPP) is None


def test_a_changed_source_makes_the_build_stale_and_names_the_rebuild(tmp_path: Path) -> None:
    cpp = tmp_path / "cpp"
    shutil.copytree(CPP, cpp)
    built = loader.source_fingerprint(cpp)
    assert loader.stale_build(built, cpp) is None
    with open(cpp / "pool" / "pool.h", "a") as f:
        f.write("// edited\n")
    why = loader.stale_build(built, cpp)
    assert why is not None and "pip install -e ." in why and str(cpp) in why
    edited = loader.source_fingerprint(cpp)
    (cpp / "torch_linked" / "buffer_cache.cpp").write_text("// built apart, at first use: not part of the build\n")
    assert loader.source_fingerprint(cpp) == edited


def test_an_installed_wheel_without_sources_is_not_checked(tmp_path: Path) -> None:
    assert loader.stale_build("anything", tmp_path / "cpp") is None
