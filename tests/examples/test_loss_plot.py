"""examples/loss_plot.py: the loss curve is a PNG matplotlib reads back, with the curve falling from near the
chance line towards the best-possible line, in the colours the legend names."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from loss_plot import plot_loss  # noqa: E402


def colour_pixels(rgb: np.ndarray, hex_colour: str) -> np.ndarray:
    """(row, column) of the pixels within a small distance of a matplotlib colour."""
    target = np.array(matplotlib.colors.to_rgb(hex_colour))
    return np.argwhere(np.abs(rgb[..., :3] - target).max(axis=-1) < 0.12)


def test_plot_loss(tmp_path: Path) -> None:
    chance, floor = math.log(256), 1.24
    losses = [5.5 * math.exp(-i / 20) + 1.3 for i in range(100)]
    losses[50] = float("nan")  # a gap, no error
    path = tmp_path / "loss.png"
    plot_loss(str(path), losses, chance=chance, floor=floor)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rgb = matplotlib.image.imread(str(path))
    height, width = rgb.shape[:2]
    assert width > 400 and height > 300
    inside = [p[p[:, 0] < height * 0.85] for p in (colour_pixels(rgb, c) for c in ("tab:blue", "tab:red", "tab:green"))]
    blue, red, green = inside  # the legend's sample lines are below the axes
    assert len(blue) and len(red) and len(green), "the curve and both reference lines are drawn"
    # the curve falls: the left end of the blue curve lies higher (a smaller row) than its right end; the
    # chance line (red) lies above the best-possible line (green)
    left, right = blue[blue[:, 1].argmin()], blue[blue[:, 1].argmax()]
    assert left[0] < right[0] - height * 0.3
    assert np.median(red[:, 0]) < np.median(green[:, 0])


def test_plot_loss_needs_a_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run at least one train.steps"):
        plot_loss(str(tmp_path / "x.png"), [], chance=1.0, floor=0.5)
