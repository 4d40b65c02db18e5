"""The example job's loss curve as a PNG, drawn with matplotlib: the loss per step, the chance line (ln(vocab),
what guessing scores) and the best-possible line (the synthetic language's entropy).

    from loss_plot import plot_loss
    plot_loss("loss.png", losses, chance=5.545, floor=1.242)
"""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["plot_loss"]


def plot_loss(path: str, losses: Sequence[float], *, chance: float, floor: float, title: str | None = None) -> None:
    """Write the curve of ``losses`` (step 1, 2, ...; a NaN leaves a gap) with the two reference lines to ``path``."""
    if not losses:
        raise ValueError("plot_loss: no losses to draw (the job ran 0 steps); run at least one train.steps")
    steps = range(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(8, 5.3))
    ax.plot(steps, list(losses), color="tab:blue", linewidth=1.5, label="training loss (mean over ranks)")
    ax.axhline(chance, color="tab:red", linestyle="--", linewidth=1.6, label=f"chance: ln(vocab) = {chance:.3f}")
    ax.axhline(floor, color="tab:green", linestyle="--", linewidth=1.6, label=f"best possible: entropy = {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.set_xlim(1, max(2, len(losses)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finite = [x for x in losses if math.isfinite(x)]
    ax.set_ylim(0, 1.08 * max([chance, *finite]))
    ax.grid(alpha=0.3)
    # below the axes: a curve that starts at chance would run under a legend drawn inside them
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=9, frameon=False)
    ax.set_title(title or "zinf: GPT on a synthetic Markov language")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
