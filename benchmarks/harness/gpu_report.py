"""benchmarks/gpu_check.py's results as goals met or missed, and as the markdown summary next to the raw JSON."""

from __future__ import annotations

from harness import tables

# (goal, zinf system, baseline system, the most the step-time ratio may be)
RATIO_GOALS = (("zinf in memory at most FSDP2's step", "zinf-mem", "fsdp2", 1.0),
               ("zinf in memory at most 1.05x plain PyTorch's step", "zinf-mem", "plain", 1.05),
               ("zinf with the optimizer on CPU at most 0.8x FSDP2 CPUOffloadPolicy's step", "zinf-optcpu",
                "fsdp2-offload", 0.8),
               ("zinf with three quarters of the optimizer on the device at most 2.0x its in-memory step",
                "zinf-optcpu-share", "zinf-mem", 2.0),
               ("compiled zinf at least 1.1x faster than eager zinf", "zinf-mem+compile", "zinf-mem", 1 / 1.1),
               ("compiled zinf at most compiled FSDP2's step", "zinf-mem+compile", "fsdp2+compile", 1.0))
MFU_GOAL = 0.40  # zinf in memory, bf16, the side by side's model
NVME_GOAL = 1.3  # the NVMe step over the time its bytes take at the measured disk bandwidth
BREAKDOWN = (("compute", "compute"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
             ("optimizer", "optimizer"), ("optimizer_wait", "optimizer wait"), ("nvme_read", "NVMe read wait"),
             ("nvme_write", "NVMe write wait"))


def flops(value: float) -> str:
    return f"{value / 1e12:,.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:,.1f} GFLOP/s"


def nbytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:.0f} B"


def _ok_rows(results: dict) -> dict[str, dict]:
    rows = results["parts"].get("side_by_side", {}).get("rows", [])
    return {r["system"]: r for r in rows if r["status"] == "ok"}


def _missing(results: dict, system: str) -> str:
    """Why a system has no measured row: it did not start, or its status and error."""
    rows = results["parts"].get("side_by_side", {}).get("rows", [])
    row = next((r for r in rows if r["system"] == system), None)
    return f"{system} did not run" if row is None else f"{system} {row['status']}: {row.get('error', '')}"[:200]


def breakdown(row: dict) -> str:
    """zinf's median StepReport of a row, in ms: where its step went."""
    parts = [f"{label} {row[f'zinf_{key}'] * 1e3:.0f}" for key, label in BREAKDOWN
             if row.get(f"zinf_{key}") is not None and row[f"zinf_{key}"] * 1e3 >= 0.5]
    return "zinf ms: " + ", ".join(parts) if parts else ""


NVME_ROWS = (("zinf-nvme", "NVMe step against its disk bound"),
             ("zinf-nvme-gradcpu", "NVMe step (gradients on the host) against its disk bound"))


def nvme_bound(results: dict, system: str = "zinf-nvme") -> dict | None:
    """The NVMe step against its disk bound: the bytes its median StepReport moved (nvme_read_bytes,
    nvme_written_bytes) at the bandwidth ``zinf info --nvme`` measured, as the step report's floor takes them
    (zinf/offload/disk_speed.py: at once where the mixed speed was measured)."""
    from zinf.offload.disk_speed import DiskSpeed

    row, disk = _ok_rows(results).get(system), results["parts"].get("nvme", {})
    if row is None or "read_gbs" not in disk:
        return None
    read_b, written_b = row.get("zinf_nvme_read_bytes", 0.0), row.get("zinf_nvme_written_bytes", 0.0)
    speed = DiskSpeed(disk["read_gbs"] * 1e9, disk["write_gbs"] * 1e9, disk.get("mixed_gbs", 0.0) * 1e9)
    bound_s = speed.floor_s(read_b, written_b)
    return {"read_bytes": read_b, "written_bytes": written_b, "bound_s": bound_s, "step_s": row["step_s"],
            "ratio": row["step_s"] / bound_s if bound_s > 0 else None, "io_hidden_share": row.get("zinf_io_hidden_share")}


def goals(results: dict) -> list[dict]:
    """Each goal of the check: met, missed or not measured, with the figures it was judged on."""
    parts, rows = results["parts"], _ok_rows(results)
    out = []

    def add(goal: str, target: str, met: bool | None, measured: str, figures: str = "") -> None:
        out.append({"goal": goal, "target": target, "result": "not measured" if met is None else
                    "met" if met else "missed", "measured": measured, "figures": figures})

    tests = parts.get("tests")
    add("tests/gpu all passing", "every test passes", None if tests is None or tests["status"] == "skipped"
        else tests["status"] == "passed", tests["note"] if tests else "not run")
    for goal, zinf, base, most in RATIO_GOALS:
        z, b = rows.get(zinf), rows.get(base)
        if z is None or b is None:
            add(goal, f"<= {most:.2f}x", None, "; ".join(_missing(results, s) for s, r in ((zinf, z), (base, b))
                                                         if r is None))
            continue
        ratio = z["step_s"] / b["step_s"]
        add(goal, f"<= {most:.2f}x", ratio <= most, f"{ratio:.2f}x ({z['step_s']:.3f} s against {b['step_s']:.3f} s)",
            breakdown(z))
    z = rows.get("zinf-mem")
    if z is None or z.get("peak_share") is None:
        add("bf16 MFU of zinf in memory", f">= {MFU_GOAL:.0%}", None, _missing(results, "zinf-mem"))
    else:
        add("bf16 MFU of zinf in memory", f">= {MFU_GOAL:.0%}", z["peak_share"] >= MFU_GOAL,
            f"{z['peak_share']:.1%} ({z['tokens_per_s']:,.0f} tokens/s)", breakdown(z))
    for system, goal in NVME_ROWS:
        nb = nvme_bound(results, system)
        if nb is None or nb["ratio"] is None:
            add(goal, f"<= {NVME_GOAL:.1f}x", None,
                _missing(results, system) if system not in rows else
                "no disk bandwidth (part 4)" if nb is None else "the NVMe row moved no bytes")
            continue
        hidden = nb["io_hidden_share"]
        add(goal, f"<= {NVME_GOAL:.1f}x", nb["ratio"] <= NVME_GOAL,
            f"{nb['ratio']:.2f}x ({nb['step_s']:.2f} s against {nb['bound_s']:.3f} s for "
            f"{nbytes(nb['read_bytes'])} read + {nbytes(nb['written_bytes'])} written)",
            breakdown(rows[system]) + (f"; I/O hidden {hidden:.0%}" if hidden is not None else ""))
    ranks = parts.get("ranks")
    add("two ranks on one device match plain PyTorch", "fp32 losses within 2e-5", None if ranks is None else
        ranks["status"] == "passed", ranks["note"] if ranks else "not run")
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def markdown(results: dict) -> str:
    m, parts = results["meta"], results["parts"]
    smoke = ("**Smoke run: on the CPU with tiny models.** The figures show that every step runs, not how fast zinf "
             "is; what needs a GPU is reported as skipped.\n\n" if m["smoke"] else "")
    machine = [["date (UTC)", m["date"]], ["GPU", m.get("gpu", "none") + (f", {m['gpu_memory_gib']} GiB"
                                                                        if m.get("gpu_memory_gib") else "")],
               ["driver", m.get("driver", "-")], ["CUDA (torch's build)", m.get("cuda", "-")],
               ["torch", m["versions"]["torch"]], ["Python", m["versions"]["python"]],
               ["zinf commit", m["versions"].get("zinf_commit", "?")], ["CPU", m["cpu"]],
               ["memory", f"{m['memory_gib']} GiB"],
               ["bf16 matmul peak", f"{flops(m['peak_flops'])} (torch.mm {m['matmul_n']}x{m['matmul_n']}, "
                                    f"{m['device']}, best of 5)"],
               ["command", f"`{m['command']}`"], ["wall", f"{m.get('wall_s', 0):.0f} s of a {m['budget_s']:.0f} s budget"]]
    text = [f"# zinf GPU check: {m['date']}, {m.get('gpu') or 'CPU'}", smoke + _table(["", ""], machine),
            "## Goals", _table(["goal", "target", "measured", "result", "figures"],
                               [[g["goal"], g["target"], g["measured"], g["result"], g["figures"]]
                                for g in results["goals"]]),
            "## Parts", _table(["part", "status", "s (limit)", "note"],
                               [[p["title"], p["status"], f"{p['elapsed_s']:.0f} ({p['limit_s']:.0f})", p["note"]]
                                for p in parts.values()])]
    if "tests" in parts:
        text += ["## 1. tests/gpu", "`python -m pytest tests/gpu` (the whole log: pytest.log)",
                 _table(["test", "outcome", "message"], [[c["test"], c["outcome"], c["message"]]
                                                         for c in parts["tests"].get("cases", [])])]
    if parts.get("host", {}).get("profile"):
        text += ["## 2. host overhead", _profile_md(parts["host"])]
    if parts.get("side_by_side", {}).get("rows"):
        rows = parts["side_by_side"]["rows"]
        text += [f"## 3. side by side, {m['precision']}",
                 f"global batch {rows[0]['global_batch']} sequences of {rows[0]['block']}; % of peak: of the bf16 "
                 "matmul peak above (MFU); device GiB: torch.cuda.max_memory_allocated; RSS: the watchdog's peak",
                 tables.ratio_table(rows), "zinf's median StepReport (ms):", tables.breakdown_table(rows)]
    if "nvme" in parts:
        text += ["## 4. zinf info --nvme", "```\n" + "\n".join(parts["nvme"].get("info", [])) + "\n```"]
        for system, _ in NVME_ROWS:
            nb = nvme_bound(results, system)
            if nb:
                text.append(f"{system}: step {nb['step_s']:.2f} s; its bytes at those speeds: {nb['bound_s']:.3f} s "
                            f"({nbytes(nb['read_bytes'])} read, {nbytes(nb['written_bytes'])} written a step)")
    if parts.get("ranks", {}).get("rows"):
        p = parts["ranks"]
        text += ["## 5. two ranks on one device (gloo), fp32, against plain PyTorch",
                 _table(["system", "ranks", "status", "losses", "max relative difference"],
                        [[r["label"], r["ranks"], r["status"] if r["status"] == "ok" else f"{r['status']}: "
                          f"{r.get('error', '')}"[:200], ", ".join(f"{x:.6f}" for x in r.get("losses", [])),
                          f"{p['compared'][r['system']]['max_rel_loss_diff']:.2e}" if r["system"] in p["compared"]
                          else "-"] for r in p["rows"]])]
    return "\n\n".join(text) + "\n"


def _profile_md(host: dict) -> str:
    p = host["profile"]
    busy = "-" if p["device_busy_share"] is None else f"{p['device_busy_ms']:.1f} ms ({p['device_busy_share']:.0%})"
    verdict = "-" if p["launch_bound"] is None else "yes" if p["launch_bound"] else "no"
    text = [f"torch.profiler over {p['steps']} steps of {p['system']} on {p['model']} ({p['precision']}, global batch "
            f"{p['global_batch']}, {p['device']})",
            _table(["step ms", "device busy", "launches a step", "host us a launch", "host self ms a step",
                    "launch-bound (device busy < 70%)"],
                   [[f"{p['step_ms_mean']:.1f}", busy, "-" if p["launches_per_step"] is None else
                     f"{p['launches_per_step']:.0f}", "-" if p["host_us_per_launch"] is None else
                     f"{p['host_us_per_launch']:.1f}", f"{p['host_self_ms_per_step']:.1f}", verdict]]),
            "host self time by operator (ms a step):",
            _table(["op", "calls a step", "self ms a step"],
                   [[o["op"], f"{o['count_per_step']:.0f}", f"{o['self_host_ms_per_step']:.2f}"]
                    for o in p["top_host_ops"]]),
            "zinf's labelled regions (host ms a step, inclusive):",
            _table(["region", "calls a step", "ms a step"],
                   [[k, f"{v['count_per_step']:.0f}", f"{v['host_ms_per_step']:.2f}"]
                    for k, v in p["zinf_regions"].items()])]
    if "bench" in host:
        text.append(f"`{host['bench']['command']}` (last lines):\n\n```\n{host['bench']['output_tail']}\n```")
    return "\n\n".join(text)
