"""A line plot written as a PNG with nothing but the standard library (zlib + struct): axes, tick labels in a
tiny bitmap font, one curve and optional horizontal reference lines. Enough for a loss curve; no matplotlib.

    from png_plot import line_plot
    line_plot("loss.png", losses, hlines=[(5.55, "chance", RED)], x_label="step", y_label="loss")
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

__all__ = ["Canvas", "encode_png", "line_plot", "nice_ticks", "BLUE", "RED", "GREEN", "GRAY", "BLACK", "WHITE"]

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRAY: Color = (225, 225, 225)
BLUE: Color = (31, 119, 180)
RED: Color = (214, 39, 40)
GREEN: Color = (44, 160, 44)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3x5 glyphs, rows top to bottom; characters without a glyph are drawn as blanks
_FONT: dict[str, tuple[str, ...]] = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"), "-": ("000", "000", "111", "000", "000"),
    "(": ("010", "100", "100", "100", "010"), ")": ("010", "001", "001", "001", "010"),
    "a": ("000", "011", "101", "101", "011"), "b": ("100", "100", "111", "101", "111"),
    "c": ("000", "111", "100", "100", "111"), "d": ("001", "001", "111", "101", "111"),
    "e": ("111", "101", "111", "100", "111"), "f": ("011", "010", "111", "010", "010"),
    "g": ("111", "101", "111", "001", "110"), "h": ("100", "100", "111", "101", "101"),
    "i": ("010", "000", "010", "010", "010"), "k": ("100", "101", "110", "101", "101"),
    "l": ("110", "010", "010", "010", "111"), "m": ("000", "111", "111", "101", "101"),
    "n": ("000", "110", "101", "101", "101"), "o": ("000", "111", "101", "101", "111"),
    "p": ("111", "101", "111", "100", "100"), "r": ("000", "101", "110", "100", "100"),
    "s": ("011", "100", "010", "001", "110"), "t": ("010", "111", "010", "010", "011"),
    "u": ("000", "101", "101", "101", "111"), "v": ("000", "101", "101", "101", "010"),
    "w": ("000", "101", "101", "111", "111"), "x": ("000", "101", "010", "010", "101"),
    "y": ("101", "101", "111", "001", "110"), "z": ("000", "111", "001", "010", "111"),
}


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` pixels from ``rgb`` (rows top to bottom, 3 bytes a pixel)."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"encode_png: expected {width}x{height}x3 = {width * height * 3} bytes, found {len(rgb)}")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, deflate, no interlace
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    """An RGB raster with the few drawing verbs a line plot needs; ``(0, 0)`` is the top-left pixel."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])  # type: ignore[return-value]

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """The rectangle from (x0, y0) to (x1, y1), both included."""
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1, dash: int = 0) -> None:
        """Bresenham, ``width`` pixels thick; ``dash`` > 0 draws dashes and gaps of that many pixels."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        lo, hi = -((width - 1) // 2), width // 2
        while True:
            if not dash or (n // dash) % 2 == 0:
                for ox in range(lo, hi + 1):
                    for oy in range(lo, hi + 1):
                        self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            n += 1
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 2) -> None:
        """``s`` in the 3x5 font with its top-left corner at (x, y); 4 * scale pixels a character."""
        for k, ch in enumerate(s.lower()):
            for row, bits in enumerate(_FONT.get(ch, ())):
                for col, bit in enumerate(bits):
                    if bit == "1":
                        for ox in range(scale):
                            for oy in range(scale):
                                self.set(x + (4 * k + col) * scale + ox, y + row * scale + oy, color)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return max(0, 4 * len(s) - 1) * scale

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """About ``target`` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{v:.{decimals}f}"


def line_plot(path: str, ys: Sequence[float], *, xs: Sequence[float] | None = None,
              hlines: Sequence[tuple[float, str, Color]] = (), label: str = "loss", x_label: str = "step",
              width: int = 720, height: int = 440, color: Color = BLUE) -> None:
    """Write ``ys`` (against ``xs``, default 1..n) as a line plot to ``path``, with dashed horizontal lines at
    ``hlines`` = [(y, label, color)] and a legend. Non-finite values break the curve."""
    xs = list(xs) if xs is not None else list(range(1, len(ys) + 1))
    if len(xs) != len(ys):
        raise ValueError(f"line_plot: {len(xs)} x values for {len(ys)} y values")
    finite = [y for y in ys if math.isfinite(y)] + [y for y, _, _ in hlines if math.isfinite(y)]
    y_lo, y_hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = (0.0 if y_lo >= 0 and y_lo - pad < 0 else y_lo - pad), y_hi + pad
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    left, right, top, bottom = 64, 16, 16, 44
    pw, ph = width - left - right, height - top - bottom
    c = Canvas(width, height)

    def px(x: float) -> int:
        return left + round((x - x_lo) / (x_hi - x_lo) * (pw - 1))

    def py(y: float) -> int:
        return top + round((y_hi - y) / (y_hi - y_lo) * (ph - 1))

    yt = nice_ticks(y_lo, y_hi)
    for v in yt:
        c.line(left, py(v), left + pw - 1, py(v), GRAY)
        s = _label(v, yt[1] - yt[0] if len(yt) > 1 else 1.0)
        c.text(left - 8 - Canvas.text_width(s), py(v) - 5, s)
    xt = nice_ticks(x_lo, x_hi, 6)
    for v in xt:
        c.line(px(v), top + ph - 1, px(v), top + ph + 4, BLACK)
        s = _label(v, xt[1] - xt[0] if len(xt) > 1 else 1.0)
        c.text(px(v) - Canvas.text_width(s) // 2, top + ph + 8, s)
    c.text(left + pw - Canvas.text_width(x_label), height - 12, x_label)
    c.line(left, top, left, top + ph - 1, BLACK)
    c.line(left, top + ph - 1, left + pw - 1, top + ph - 1, BLACK)

    for y, _, col in hlines:
        if math.isfinite(y):
            c.line(left + 1, py(y), left + pw - 1, py(y), col, width=2, dash=6)
    prev: tuple[int, int] | None = None
    for x, y in zip(xs, ys):
        point = (px(x), py(y)) if math.isfinite(y) else None
        if point is not None:
            if prev is not None:
                c.line(*prev, *point, color, width=2)
            else:
                c.line(*point, *point, color, width=2)
        prev = point

    entries = [(label, color, 0)] + [(name, col, 6) for _, name, col in hlines]
    lx = left + pw - 8 - max(Canvas.text_width(name) for name, _, _ in entries) - 30
    c.fill(lx - 6, top + 2, left + pw - 2, top + 10 + 16 * len(entries) - 4, WHITE)  # the legend over the lines
    for i, (name, col, dash) in enumerate(entries):
        ly = top + 10 + 16 * i
        c.line(lx, ly, lx + 22, ly, col, width=2, dash=dash and 4)
        c.text(lx + 30, ly - 5, name)
    with open(path, "wb") as f:
        f.write(c.png())
