"""examples/png_plot.py: the PNG it writes is a valid PNG (read back here with zlib + struct only), and the
plot draws what it is given where it should be."""

from __future__ import annotations

import math
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from png_plot import BLUE, GREEN, RED, WHITE, Canvas, encode_png, line_plot, nice_ticks  # noqa: E402


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and the RGB bytes of an 8-bit truecolour, non-interlaced PNG; every CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    assert all(raw[y * stride] == 0 for y in range(height)), "only filter type 0 is written"
    return width, height, b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(height))


def test_encode_round_trip() -> None:
    pixels = bytes(range(256)) * 3  # 2 rows of 128 pixels
    assert read_png(encode_png(128, 2, pixels)) == (128, 2, pixels)
    with pytest.raises(ValueError, match="expected 4x4x3 = 48 bytes"):
        encode_png(4, 4, b"\x00" * 47)


def test_canvas_line_and_text() -> None:
    c = Canvas(20, 10)
    c.line(0, 0, 19, 9, RED)
    assert c.get(0, 0) == RED and c.get(19, 9) == RED and c.get(19, 0) == WHITE
    c.line(0, 5, 19, 5, GREEN, dash=3)
    assert [c.get(x, 5) == GREEN for x in range(6)] == [True, True, True, False, False, False]
    c.text(1, 1, "1", BLUE, scale=1)  # the glyph's middle column, five rows
    assert all(c.get(2, 1 + r) == BLUE for r in range(5))
    c.set(100, 100, RED)  # outside: ignored


def test_nice_ticks() -> None:
    assert nice_ticks(0.0, 10.0) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert nice_ticks(1.13, 5.71) == [2.0, 3.0, 4.0, 5.0]
    assert nice_ticks(3.0, 3.0) == [3.0]


def test_line_plot(tmp_path: Path) -> None:
    ys = [5.5 * math.exp(-i / 20) + 1.2 for i in range(100)]
    ys[50] = float("nan")  # breaks the curve, no error
    path = tmp_path / "loss.png"
    line_plot(str(path), ys, hlines=[(5.55, "chance", RED), (1.24, "floor", GREEN)], width=400, height=300)
    width, height, rgb = read_png(path.read_bytes())
    assert (width, height) == (400, 300)
    colours = {rgb[i:i + 3] for i in range(0, len(rgb), 3)}
    assert {bytes(BLUE), bytes(RED), bytes(GREEN), bytes(WHITE), b"\x00\x00\x00"} <= colours
    # the curve falls: its first column of blue pixels lies higher (smaller y) than its last
    blue = [(i // 3 % width, i // 3 // width) for i in range(0, len(rgb), 3) if rgb[i:i + 3] == bytes(BLUE)]
    plot_blue = [(x, y) for x, y in blue if y > 60]  # below the legend
    left, right = min(plot_blue), max(plot_blue)
    assert left[1] < right[1] - 100
    with pytest.raises(ValueError, match="3 x values for 2 y values"):
        line_plot(str(path), [1.0, 2.0], xs=[1, 2, 3])
