"""Raw rows to files (JSON with the machine's description, CSV) and to markdown tables: the side-by-side ratio
table, zinf's time breakdown, and the curves' tables."""

from __future__ import annotations

import csv
import json
import os

RATIO_BASELINES = (("plain", "vs plain"), ("ddp", "vs DDP"), ("fsdp2", "vs FSDP2"))


def best_of(rows: list[dict]) -> list[dict]:
    """Per (model, system, ranks): the pass with the fastest step among those that ran, else the last pass."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["model"], row["system"], row["ranks"])
        old = best.get(key)
        if old is None or (row["status"] == "ok" and (old["status"] != "ok" or row["step_s"] < old["step_s"])) \
                or (row["status"] != "ok" and old["status"] != "ok"):
            best[key] = row
    return list(best.values())


def write_raw(out_dir: str, stem: str, meta: dict, rows: list[dict]) -> tuple[str, str]:
    """``<stem>.json`` ({"meta", "rows"}) and ``<stem>.csv`` (one line a row; lists as JSON text)."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, csv_path = os.path.join(out_dir, stem + ".json"), os.path.join(out_dir, stem + ".csv")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for row in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    return json_path, csv_path


def read_raw(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        data = json.load(f)
    return data["meta"], data["rows"]


def header(meta: dict) -> str:
    v = meta["versions"]
    peak = meta["peak_flops"]
    return (f"machine: {meta['cpu']}; {meta['memory_gib']} GiB" + (f"; GPU {meta['gpu']}" if meta.get("gpu") else "")
            + f"\nfp32 matmul peak (torch.mm {meta['matmul_n']}x{meta['matmul_n']}, best of 5): {peak / 1e9:,.1f} GFLOP/s"
            + f"\nversions: " + ", ".join(f"{k} {val}" for k, val in v.items()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _status(r: dict) -> str:
    """``ok``, ``ok; exit: <error>`` (measured, then a rank died closing), or ``<status> during <phase>: <error>``."""
    if r["status"] == "ok":
        return "ok" + (_cell(f"; exit: {r['exit_error']}")[:160] if r.get("exit_error") else "")
    return _cell(f"{r['status']}" + (f" during {r['where']}" if r.get("where") else "") + f": {r.get('error', '')}")[:160]


def ratio_table(rows: list[dict]) -> str:
    """One line per run; ratios are step-time ratios (this system's step / the baseline's step on the same model:
    below 1.00x this system is faster). DDP and FSDP2 baselines are taken at the same rank count; a compiled run
    (``SYSTEM+compile``) is compared with the compiled baselines."""
    lines = ["| model | params | system | ranks | step s | tokens/s | GFLOP/s | % of peak | peak RSS / rank GiB "
             "| device GiB | NVMe GiB | vs plain | vs DDP | vs FSDP2 | status |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    by = {(r["model"], r["system"], r["ranks"]): r for r in rows}
    for r in rows:
        ok = r["status"] == "ok"
        ratios = []
        for base, _ in RATIO_BASELINES:
            variant = r["system"].partition("@")[0].partition("+")[2]
            b = by.get((r["model"], base + (f"+{variant}" if variant else ""), 1 if base == "plain" else r["ranks"]))
            ratios.append(f"{r['step_s'] / b['step_s']:.2f}x" if ok and b and b["status"] == "ok" else "-")
        status = _status(r)
        lines.append("| " + " | ".join([
            r["model"], f"{r['numel'] / 1e6:.1f}M", r["label"], str(r["ranks"]),
            _num(r.get("step_s"), ".3f"), _num(r.get("tokens_per_s"), ",.0f"),
            _num(r["flops_per_s"] / 1e9 if ok else None, ",.2f"),
            _num(r["peak_share"] * 100 if ok and r.get("peak_share") is not None else None, ".1f"),
            _num(r.get("peak_rss_per_rank_gib"), ".2f"), _num(r.get("device_peak_gib") or None, ".2f"),
            _num(r.get("disk_peak_gib") or None, ".3f"), *ratios, status]) + " |")
    return "\n".join(lines)


BREAKDOWN_COLUMNS = (("compute", "compute"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
                     ("rounds", "rounds"), ("nvme", "NVMe waits"), ("optimizer", "optimizer"),
                     ("optimizer_wait", "optimizer wait"))


def breakdown_table(rows: list[dict]) -> str:
    """zinf's rows: the median StepReport of the measured steps, in ms (waits on the training thread; NVMe waits
    are the training thread's nvme_read + nvme_write), and the share of the NVMe I/O wait that was hidden."""
    lines = ["| model | system | ranks | step ms | " + " | ".join(label for _, label in BREAKDOWN_COLUMNS)
             + " | I/O hidden |", "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in BREAKDOWN_COLUMNS)
             + " | ---: |"]
    for r in rows:
        if not r["system"].startswith("zinf") or r["status"] != "ok":
            continue
        cells = []
        for key, _ in BREAKDOWN_COLUMNS:
            if key == "nvme":
                value = r.get("zinf_nvme_read", 0.0) + r.get("zinf_nvme_write", 0.0) if "zinf_nvme_read" in r \
                    or "zinf_nvme_write" in r else None
            else:
                value = r.get(f"zinf_{key}")
            cells.append(_num(None if value is None else value * 1e3, ".1f"))
        share = r.get("zinf_io_hidden_share")
        lines.append(f"| {r['model']} | {r['label']} | {r['ranks']} | {r['step_s'] * 1e3:.1f} | " + " | ".join(cells)
                     + f" | {_num(None if share is None else share * 100, '.0f')}{'%' if share is not None else ''} |")
    return "\n".join(lines)


def curve_table(rows: list[dict], x_key: str, x_label: str) -> str:
    """The curves' rows: one line per (system, x), with step time, peak RSS per rank and status."""
    lines = [f"| system | {x_label} | params | step s | tokens/s | peak RSS / rank GiB | device GiB | NVMe GiB | status |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in sorted(rows, key=lambda r: (r["system"], r[x_key])):
        ok = r["status"] == "ok"
        status = _status(r)
        lines.append(f"| {r['label']} | {r[x_key]:,} | {r['numel'] / 1e6:,.1f}M | {_num(r.get('step_s'), '.3f')} | "
                     f"{_num(r.get('tokens_per_s'), ',.0f')} | {_num(r.get('peak_rss_per_rank_gib'), '.2f')} | "
                     f"{_num(r.get('device_peak_gib') or None, '.2f')} | {_num(r.get('disk_peak_gib') or None, '.3f')} | "
                     f"{status} |")
    return "\n".join(lines)
