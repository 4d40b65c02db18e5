"""Training on the CPU with the parameters offloaded and a host memory budget stated (``offload.max_cpu_bytes``),
the memory of freed gathers and gradients goes back to the system during the step ([Note: heap growth] in
zinf/heap.py): on 2 fresh ranks, each rank's anonymous resident
memory after later steps stays near what it was after the first (which made the Adam states), where with
``trim_heap_bytes: 0`` glibc keeps what the steps freed. Same losses either way; the step report times the
trimming (``heap_trim``)."""

from __future__ import annotations

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL = GPTConfig(vocab=8192, block=64, n_embd=512, n_head=8, n_layer=8)
TRIM = 16 << 20
MIB = 1 << 20


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise KeyError("RssAnon")


def _train(rank: int, world: int, trim: int) -> dict:
    torch.manual_seed(0)
    with zinf.Init():
        model = GPT(MODEL)
    config = zinf.ZeroConfig.from_dict({"trim_heap_bytes": trim, "overlap": {"prefetch_bytes": 8 * MIB},
                                        "offload": {"params": "cpu", "optimizer": "cpu",
                                                    "max_cpu_bytes": 8 << 30}})
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    idx = torch.randint(0, MODEL.vocab, (4, MODEL.block + 1), generator=torch.Generator().manual_seed(rank))
    losses, grew = [], []
    for step in range(4):
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            after_first = _anon()
        grew.append(_anon() - after_first)
    report = engine.report()
    return {"losses": losses, "grew": max(grew), "trims": engine.heap.trims,
            "timed": (report.counts.get("heap_trim", 0), "heap_trim" in report.summary())}


def test_freed_gathers_and_gradients_go_back_to_the_system() -> None:
    trimmed = run_distributed(_train, 2, TRIM, fresh=True)
    kept = run_distributed(_train, 2, 0, fresh=True)
    for rank, (t, k) in enumerate(zip(trimmed, kept)):
        assert t["losses"] == k["losses"], rank
        assert t["trims"] > 0 and k["trims"] == 0, (t["trims"], k["trims"])
        assert t["timed"][0] >= 1 and t["timed"][1] and k["timed"] == (0, False), (t["timed"], k["timed"])
        # what a step frees between two trims, a gathered unit and its gradient may stay in the heap
        assert t["grew"] <= 4 * TRIM, f"rank {rank}: RSS grew {t['grew'] / MIB:.0f} MiB after the first step"
        assert t["grew"] < k["grew"] / 2, (
            f"rank {rank}: trimmed {t['grew'] / MIB:.0f} MiB, kept {k['grew'] / MIB:.0f} MiB: if glibc no longer keeps "
            "freed memory, the trimming is not needed")
