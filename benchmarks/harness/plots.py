"""PNG plots made from the raw rows (so they can be redrawn from the JSON without rerunning): the side-by-side
bars, step time and memory as the model grows, step time as the ranks go 1, 2, 4."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAILED_MARK = dict(marker="x", markersize=10, markeredgewidth=2, linestyle="none")


def _color(j: int) -> tuple:
    """The j-th system's colour: matplotlib's ten default colours, then their light shades (tab20 holds both), so
    that eleven or more systems never share one."""
    return plt.cm.tab20((2 * j) % 20 + (j // 10) % 2)


def _by_system(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["system"], []).append(r)
    return out


def side_by_side(rows: list[dict], path: str, title: str) -> None:
    """Grouped bars per model: tokens/s and peak RSS per rank of each system; a run that did not finish has no
    bar and its status written where the bar would be."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    labels = {r["system"]: r["label"] + (f" x{r['ranks']}" if r["ranks"] > 1 else "") for r in rows}
    by = {(r["model"], r["system"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(models) + 8), 5.5))
    width = 0.8 / max(1, len(systems))
    for ax, key, ylabel in ((axes[0], "tokens_per_s", "tokens / s (higher is better)"),
                            (axes[1], "peak_rss_per_rank_gib", "peak host RSS per rank (GiB)")):
        for j, system in enumerate(systems):
            xs, ys = [], []
            for i, model in enumerate(models):
                r = by.get((model, system))
                x = i - 0.4 + width * (j + 0.5)
                if r is None:
                    continue
                if r["status"] == "ok" or (key == "peak_rss_per_rank_gib" and r.get(key)):
                    xs.append(x)
                    ys.append(r[key])
                else:
                    ax.text(x, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=7)
            ax.bar(xs, ys, width=width, label=labels[system], color=_color(j))
        ax.set_xticks(range(len(models)), models)
        ax.set_xlabel("model")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=min(4, max(1, len(names))))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * ((len(names) + 3) // 4), 1, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def size_curve(rows: list[dict], path: str, title: str, limit_gib: float | None, ranks: int = 1) -> None:
    """Step time and peak RSS per rank against the parameter count, one line per system, log-log; an x marks
    the first size a system did not train (at the memory it had reached when it failed or was killed)."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5.5))
    for j, (system, rs) in enumerate(_by_system(rows).items()):
        rs = sorted(rs, key=lambda r: r["numel"])
        color = _color(j)
        ok = [r for r in rs if r["status"] == "ok"]
        bad = [r for r in rs if r["status"] not in ("ok", "skipped")]
        label = rs[0]["label"] + (f" x{rs[0]['ranks']}" if rs[0]["ranks"] > 1 else "")
        ax_t.plot([r["numel"] for r in ok], [r["step_s"] for r in ok], "o-", color=color, label=label)
        ax_m.plot([r["numel"] for r in ok], [r["peak_rss_per_rank_gib"] for r in ok], "o-", color=color, label=label)
        if bad:
            ax_m.plot([bad[0]["numel"]], [bad[0].get("peak_rss_per_rank_gib") or 0.01], color=color, **FAILED_MARK)
            if ok:
                ax_t.plot([bad[0]["numel"]], [ok[-1]["step_s"]], color=color, **FAILED_MARK)
    if limit_gib:  # the watchdog bounds the sum over a run's ranks: per rank that is the limit over the ranks
        ax_m.axhline(limit_gib, color="gray", linestyle="--", linewidth=1, label=f"watchdog limit, 1 process ({limit_gib} GiB)")
        if ranks > 1:
            ax_m.axhline(limit_gib / ranks, color="gray", linestyle=":", linewidth=1,
                         label=f"watchdog limit / {ranks} ranks ({limit_gib / ranks:.1f} GiB)")
    for ax, ylabel in ((ax_t, "step time (s, median after warm-up)"), (ax_m, "peak host RSS per rank (GiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(ylabel)
        ax.grid(which="both", alpha=0.3)
    ax_m.plot([], [], color="black", label="did not train (failed or killed)", **FAILED_MARK)
    ax_m.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def ranks_curve(rows: list[dict], path: str, title: str) -> None:
    """Step time against the number of ranks (same global batch), one line per system; plain PyTorch, one
    process, as a horizontal reference."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    rank_counts = sorted({r["ranks"] for r in rows})
    for j, (system, rs) in enumerate(_by_system(rows).items()):
        ok = sorted((r for r in rs if r["status"] == "ok"), key=lambda r: r["ranks"])
        if system == "plain":
            for r in ok:
                ax.axhline(r["step_s"], color="black", linestyle=":", label=f"{r['label']}: {r['step_s']:.3f} s")
            continue
        ax.plot([r["ranks"] for r in ok], [r["step_s"] for r in ok], "o-", color=_color(j),
                label=rs[0]["label"] + ("" if ok else f" ({rs[0]['status']}: no run finished)"))
    ax.set_xticks(rank_counts, [str(n) for n in rank_counts])
    ax.set_xlabel("ranks (processes; same global batch)")
    ax.set_ylabel("step time (s, median after warm-up)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
