import collections
import re

import pytest

from zinf.offload import swap
from zinf.units import format_bytes, format_bytes_apart


@pytest.mark.parametrize("n,text", [
    (0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"), (96 * 1024, "96.0 KiB"), (257 * 1024 + 100, "257.1 KiB"),
    (1 << 20, "1.00 MiB"), (3 * 2**20 // 2, "1.50 MiB"), (1023 * 2**20, "1023.00 MiB"), (1 << 30, "1.00 GiB"),
    (5 * 2**30 // 2, "2.50 GiB"), (-2048, "-2.0 KiB"),
])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_apart_never_prints_two_different_sizes_the_same() -> None:
    assert format_bytes_apart(3 * 2**20, 60 * 1024) == ("3.00 MiB", "60.0 KiB")
    assert format_bytes_apart(2**30 + 4096, 2**30) == ("1,073,745,920 bytes", "1,073,741,824 bytes")
    assert format_bytes_apart(2048, 2048) == ("2.0 KiB", "2.0 KiB")


def test_swap_space_message_shows_the_difference(tmp_path, monkeypatch) -> None:
    space = swap.SwapSpace([str(tmp_path)], 0, 1, aio=None)
    space.allocate(3 * 2**20)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(swap.shutil, "disk_usage", lambda path: usage(2**20, 2**20 - 65536, 65536))
    with pytest.raises(swap.OffloadSpaceError) as err:
        space.open()
    assert re.search(r"needs 3\.\d\d MiB for rank 0's offloaded state but has 64\.0 KiB free", str(err.value)), err.value
    assert "0.00 GiB" not in str(err.value)
    assert not list(tmp_path.iterdir())
