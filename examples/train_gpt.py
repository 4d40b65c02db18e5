"""Train a GPT with zinf from a plain PyTorch loop, on a synthetic language it generates, with the optimizer
states offloaded to NVMe (a temporary directory unless you name one), and show that it learns.

    torchrun --nproc_per_node 2 examples/train_gpt.py                     # CPU (gloo) or one GPU per rank (NCCL)
    python examples/train_gpt.py                                          # one process
    python examples/train_gpt.py --config examples/configs/gpt_small.yaml train.steps=50 zinf.precision=bf16
    python examples/train_gpt.py zinf.offload.params=nvme zinf.offload.nvme_paths=[/mnt/nvme0] train.out_dir=run1

The data is a fixed random Markov chain over the vocabulary (examples/synthetic_language.py), different
on every rank and every step: a model that has learnt it reaches the chain's entropy ("floor"), far below
the ln(vocab) of guessing ("chance"). At the end rank 0 prints a summary and writes the loss curve
(loss.png), the per-step losses (losses.csv) and a zinf checkpoint into ``train.out_dir``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import csv
import dataclasses
import logging
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import zinf
from zinf.cli import report_errors
from zinf.config import PRECISIONS
from zinf.offload.disk_speed import measure_path, save_speed
from zinf.report import disk_utilisation, io_hidden_share

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, GPTConfig  # noqa: E402
from job_config import JobConfig, load_job_config  # noqa: E402
from loss_plot import plot_loss  # noqa: E402
from synthetic_language import MarkovLanguage  # noqa: E402

try:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
except ImportError:  # tqdm comes with the lightning extra; without it, a line every 10% of the steps
    tqdm = None

PARAMS_ON_NVME_SHARE = 0.25  # offload.params: auto puts a rank's parameter shards on NVMe above this share of its memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "gpt_small.yaml"))
    parser.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist, e.g. zinf.precision=bf16 train.steps=50")
    args = parser.parse_args()
    # every setting is checked before the process group starts and before anything is written
    return report_errors(lambda: train(load_job_config(args.config, args.overrides)), "train_gpt.py", args.verbose)


def train(cfg: JobConfig) -> int:
    out_dir = writable_out_dir(cfg.train.out_dir)  # every rank writes its part of the checkpoint there
    if "RANK" in os.environ:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    # zinf's messages carry their own "zinf:" prefix; other ranks only warn, and say which rank they are
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s")
    logging.getLogger("zinf.placement").addFilter(quick_progress_lines)

    model_cfg = cfg.model  # a GPTConfig, checked
    language = MarkovLanguage(model_cfg.vocab, branching=cfg.data.branching, seed=cfg.data.seed)
    zdict = copy.deepcopy(cfg.zinf)
    nvme_dir = place_offload(zdict, model_cfg, world)
    zcfg = zinf.ZeroConfig.from_dict(zdict)

    torch.manual_seed(0)
    with zinf.Init(zcfg):  # no rank ever holds the whole model
        model = GPT(model_cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.train.lr)
    engine = zinf.initialize(model, optimizer, zcfg)
    steps = int(cfg.train.steps)
    warmup = max(1, int(steps * cfg.train.warmup))  # linear warm-up, then cosine down to a tenth
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, steps - warmup))))))
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    tokens_per_step = world * cfg.train.batch_per_rank * model_cfg.block
    say(rank, f"GPT with {numel / 1e6:.1f}M parameters on {world} rank(s), {zcfg.precision}, device {engine.device}; "
              f"offload: params {zcfg.offload.params}, optimizer {zcfg.offload.optimizer}"
              + (f" (NVMe: {', '.join(zcfg.offload.nvme_paths)})" if zcfg.offload.nvme_paths else ""))
    say(rank, f"data: a random Markov chain over {language.vocab} tokens, {language.branching} successors each; "
              f"{steps} steps of {tokens_per_step} tokens")

    losses, step_seconds, io_shares, reports = [], [], [], []
    totals_s: dict[str, float] = {}
    totals_n: dict[str, int] = {}
    bar = Progress(rank, steps)
    start = time.perf_counter()
    with (logging_redirect_tqdm() if tqdm is not None and rank == 0 else contextlib.nullcontext()):
        for step in range(steps):
            t0 = time.perf_counter()
            idx, targets = language.batch(cfg.train.batch_per_rank, model_cfg.block, step, rank)
            loss = engine(idx.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
            schedule.step()
            losses.append(loss.item())
            step_seconds.append(time.perf_counter() - t0)
            report = engine.report()
            io_shares.append(report.io_hidden_share)
            reports.append(report)
            add_up(totals_s, totals_n, [report])
            recent_s, recent_n = add_up({}, {}, reports[-10:])
            bar.update(step, losses, tokens_per_step * len(step_seconds[-10:]) / sum(step_seconds[-10:]),
                       io_hidden_share(recent_s, recent_n))
    train_s = time.perf_counter() - start
    bar.close()

    ckpt_dir = os.path.join(out_dir, "checkpoint")
    t0 = time.perf_counter()
    engine.save_checkpoint(ckpt_dir, client_state={"config": dataclasses.asdict(cfg)})
    save_s = time.perf_counter() - t0
    # two collectives, on every rank in the same order: the global batch's loss per step; every rank's bytes
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    io_bytes = totals_n.get("nvme_read_bytes", 0) + totals_n.get("nvme_written_bytes", 0)
    per_rank = [(engine.report().bytes, io_bytes)]
    if dist.is_initialized():
        dist.all_reduce(mean_losses)
        mean_losses /= world
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (engine.report().bytes, io_bytes))
    engine.close()  # removes the swap files
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        write_outputs(out_dir, mean_losses.tolist(), losses, step_seconds, io_shares, tokens_per_step, language)
        say(rank, summary(mean_losses.tolist(), language, steps, tokens_per_step, train_s, save_s, per_rank,
                          io_hidden_share(totals_s, totals_n), disk_utilisation(totals_s), out_dir, ckpt_dir,
                          zcfg.offload.nvme_paths, nvme_dir, engine.device))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def writable_out_dir(out_dir: str) -> str:
    """``train.out_dir`` as an absolute path, created and checked writable before training: a directory that
    cannot hold the results is refused in a second, not at save time after the whole run."""
    path = os.path.abspath(out_dir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise zinf.ConfigError(f"train.out_dir={out_dir!r} is not a directory this process can write "
                               f"({exc.strerror or exc}). Pass a writable directory, e.g. train.out_dir=run1 "
                               "(created when missing).") from None
    return path


def place_offload(zdict: dict, model_cfg: GPTConfig, world: int) -> str | None:
    """Resolve this example's ``offload.params: auto`` and give NVMe offload a temporary directory when the config
    names none; returns that directory (removed at the end) or None."""
    offload = zdict.setdefault("offload", {})
    if offload.get("params", "device") == "auto":
        # parameter shards on NVMe only when they would take a real share of the device's memory: below that,
        # NVMe reads in every forward and backward would cost time and save memory nobody needs
        with torch.device("meta"):
            numel = sum(p.numel() for p in dict.fromkeys(GPT(model_cfg).parameters()))
        shard_bytes = numel * PRECISIONS[zdict.get("precision", "fp32")].itemsize / world
        offload["params"] = "nvme" if shard_bytes > PARAMS_ON_NVME_SHARE * memory_per_rank_bytes() else "device"
    if "nvme" in (offload.get("params"), offload.get("optimizer")) and not offload.get("nvme_paths"):
        nvme_dir = tempfile.mkdtemp(prefix="zinf_nvme_", dir=os.environ.get("ZINF_NVME_DIR"))  # one per rank
        atexit.register(shutil.rmtree, nvme_dir, ignore_errors=True)  # after the engine's own clean-up (LIFO)
        offload["nvme_paths"] = [nvme_dir]
        measure_disk(nvme_dir, offload.get("aio_bytes_per_s", 0))
        return nvme_dir
    return None


def measure_disk(path: str, bytes_per_s: int) -> None:
    """What ``zinf info --nvme PATH`` does, on 64 MiB (under a cap, what the cap moves in a second, at least 4 MiB):
    the step reports then say how busy the disk was (nvme_floor)."""
    size = min(64 << 20, max(4 << 20, bytes_per_s)) if bytes_per_s else 64 << 20
    try:
        write_gbs, read_gbs, mixed_gbs, direct = measure_path(path, size, bytes_per_s)
    except (OSError, ValueError):
        return  # no measurement: the summary says nothing of the disk
    save_speed(path, write_gbs, read_gbs, direct, mixed_gbs=mixed_gbs, bytes_per_s=bytes_per_s)


def memory_per_rank_bytes() -> int:
    """A GPU's memory, or on CPU the host's memory shared by the ranks on this machine."""
    if torch.cuda.is_available() and not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def quick_progress_lines(record: logging.LogRecord) -> bool:
    """Drop zinf's "initial state of i/n groups written to NVMe" lines of a start-up that takes under 2 s,
    all but the last; a slow start-up (a large model) keeps its progress lines."""
    if record.msg.startswith("zinf offload: initial state of") and len(record.args) == 4:
        done, total, _, seconds = record.args
        return done == total or seconds >= 2.0
    return True


def add_up(seconds: dict[str, float], counts: dict[str, int], reports: list[zinf.StepReport]) -> tuple[dict, dict]:
    """Sum the reports' timings and counts into ``seconds`` and ``counts`` (io_hidden_share of several steps)."""
    for report in reports:
        for key, value in report.seconds.items():
            seconds[key] = seconds.get(key, 0.0) + value
        for key, value in report.counts.items():
            counts[key] = counts.get(key, 0) + value
    return seconds, counts


def say(rank: int, text: str) -> None:
    if rank == 0:
        (tqdm.write if tqdm is not None else print)(text)


class Progress:
    """Rank 0's progress bar: loss, tokens/s and the share of the NVMe I/O wait hidden, over the last 10 steps."""

    def __init__(self, rank: int, steps: int) -> None:
        self.rank, self.steps = rank, steps
        self.bar = None
        if rank == 0 and tqdm is not None:
            tty = sys.stderr.isatty()
            self.bar = tqdm(total=steps, desc="train", unit="step", mininterval=0.5 if tty else 10.0, dynamic_ncols=True)

    def update(self, step: int, losses: list[float], tokens_per_s: float, hidden: float | None) -> None:
        if self.rank != 0:
            return
        recent = losses[-10:]
        fields = {"loss": f"{sum(recent) / len(recent):.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
        if hidden is not None:
            fields["io hidden"] = f"{hidden:.0%}"
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif (step + 1) % max(1, self.steps // 10) == 0 or step + 1 == self.steps:
            print(f"step {step + 1}/{self.steps} " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_outputs(out_dir: str, mean_losses: list[float], rank0_losses: list[float], step_seconds: list[float],
                  io_shares: list[float | None], tokens_per_step: int, language: MarkovLanguage) -> None:
    with open(os.path.join(out_dir, "losses.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "rank0_loss", "seconds", "tokens_per_s", "io_hidden_share"])
        for i, (loss, loss0, s, share) in enumerate(zip(mean_losses, rank0_losses, step_seconds, io_shares)):
            w.writerow([i + 1, f"{loss:.6f}", f"{loss0:.6f}", f"{s:.4f}", f"{tokens_per_step / s:.1f}",
                        "" if share is None else f"{share:.4f}"])
    plot_loss(os.path.join(out_dir, "loss.png"), mean_losses, chance=language.chance, floor=language.floor)


def summary(losses: list[float], language: MarkovLanguage, steps: int, tokens_per_step: int, train_s: float,
            save_s: float, per_rank: list[tuple[dict[str, dict[str, int]], int]], hidden: float | None,
            busy: float | None, out_dir: str, ckpt_dir: str, nvme_paths: list[str], temporary: str | None,
            device: torch.device) -> str:
    tail = losses[-min(10, len(losses)):]
    start, end = losses[0], sum(tail) / len(tail)
    learned = (f"{language.chance - end:.2f} below chance" if end < min(start, language.chance)
               else "not below chance yet (try more train.steps or a higher train.lr)")
    by_tier: dict[str, dict[str, int]] = {}
    for rank_bytes, _ in per_rank:
        for tier, kinds in rank_bytes.items():
            for kind, n in kinds.items():
                by_tier.setdefault(tier, {})[kind] = by_tier.get(tier, {}).get(kind, 0) + n
    tiers = []
    for tier in ("device", "cpu", "nvme"):
        kinds = by_tier.get(tier, {})
        parts = ", ".join(f"{kind} {mib(n)}" for kind, n in sorted(kinds.items()) if n)
        if tier == "device" and not kinds and device.type == "cpu":
            parts = "the device is the CPU here: see cpu"
        tiers.append(f"{tier} {mib(sum(kinds.values()))}" + (f" ({parts})" if parts else ""))
    lines = [
        "",
        f"loss   {start:.3f} at step 1 -> {end:.3f} over the last {len(tail)} steps: {learned} "
        f"(chance ln({language.vocab}) = {language.chance:.3f}, best possible {language.floor:.3f})",
        f"time   {train_s:.1f} s for {steps} steps, {steps * tokens_per_step / train_s:,.0f} tokens/s; checkpoint "
        f"saved in {save_s:.1f} s",
        "bytes  resident at the end, all ranks: " + "; ".join(tiers),
    ]
    on_nvme = sum(by_tier.get("nvme", {}).values())
    if on_nvme:
        where = f"temporary {temporary}, removed at exit" if temporary else ", ".join(nvme_paths)
        share = f"; {hidden:.0%} of the I/O hidden behind compute" if hidden is not None else ""
        share += f", the disk busy {busy:.0%} of the time" if busy is not None else ""
        lines.append(f"NVMe   {mib(on_nvme)} lived on NVMe (rank 0's swap files in {where}); "
                     f"{sum(io for _, io in per_rank) / 2**30:.2f} GiB read and written{share}")
    lines += [f"curve  {os.path.join(out_dir, 'loss.png')} (per-step losses: {os.path.join(out_dir, 'losses.csv')})",
              f"ckpt   {ckpt_dir} (zinf consolidate {ckpt_dir} model.pt makes a state_dict)"]
    return "\n".join(lines)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
