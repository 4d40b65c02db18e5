"""Each rank holds about 1/world of the model after construction under zinf.Init: measured, not assumed.

Two measurements per rank: the bytes of every live tensor storage in the process (found by walking
the garbage collector's objects) right after construction, and the peak resident set size during
construction (Linux VmHWM, reset through /proc/self/clear_refs just before building).
"""

from __future__ import annotations

import gc

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig

pytestmark = pytest.mark.distributed

BIG = GPTConfig(vocab=8192, block=64, n_embd=512, n_head=8, n_layer=8)
PREFETCH_BYTES = 8 * 2**20


def live_tensor_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - some objects refuse isinstance/storage inspection
            continue
    return sum(seen.values())


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _worker(rank: int, world: int, use_zinf: bool = True) -> dict[str, int]:
    torch.manual_seed(0)
    with zinf.Init():  # warm-up: fault in the code pages of every op construction uses
        GPT(GPTConfig())
    before = live_tensor_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS counter
        rss_before = _vm("VmRSS:")
    except OSError:
        rss_before = -1
    with zinf.Init(enabled=use_zinf):
        model = GPT(BIG)
    peak_rss = _vm("VmHWM:") - rss_before if rss_before >= 0 else -1
    after = live_tensor_bytes()
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    if not use_zinf:
        return {"resident": after - before, "model": model_bytes, "peak_rss": peak_rss}
    # the window bounds what is gathered: no room of host memory beside it ([Note: keeping in the host's room])
    config = zinf.ZeroConfig.from_dict({"overlap": {"prefetch_bytes": PREFETCH_BYTES, "host_keep": "off"}})
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    largest_group = max(g.padded_numel for g in engine.groups) * 4
    idx = torch.randint(0, BIG.vocab, (2, BIG.block + 1))
    for _ in range(2):  # one recording step, one replayed (prefetching) step
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
    return {"peak_gathered": engine.report().peak_gathered_bytes, "prefetched": engine.report().counts["prefetched_gathers"],"resident": after - before, "model": model_bytes, "largest_group": largest_group,
            "peak_rss": peak_rss, "shard_bytes": sum(g.shard.untyped_storage().nbytes() for g in engine.groups)}


@pytest.fixture(autouse=True)
def _plain_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc raises its mmap threshold after large frees and then keeps freed blocks in the heap, which
    # RSS would count; a fixed threshold makes RSS follow live memory (the spawned ranks inherit it)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_resident_parameters_are_one_over_world(world: int) -> None:
    for rank, m in enumerate(run_distributed(_worker, world)):
        share = m["model"] / world
        # shards + per-group padding (< world elements per group) + 1-element placeholders
        assert m["resident"] <= share * 1.02 + 64 * 1024, f"rank {rank}: {m['resident']} live bytes vs 1/{world} = {share:.0f}"
        assert m["resident"] >= share * 0.98, f"rank {rank}: {m['resident']} bytes is less than its share {share:.0f}?"
        if m["peak_rss"] >= 0:  # construction never held the whole model, only a share plus the largest module
            bound = share + 2 * m["largest_group"] + 16 * 2**20
            assert m["peak_rss"] < bound, f"rank {rank}: peak RSS grew {m['peak_rss']} during construction (bound {bound:.0f})"
        # training gathers one module (plus the tied embedding it shares) and at most the prefetch budget ahead
        assert m["prefetched"] > 0
        gathered_bound = 2 * m["largest_group"] + PREFETCH_BYTES + 4 * 2**20
        assert m["peak_gathered"] <= gathered_bound, f"rank {rank}: {m['peak_gathered']} bytes gathered at once"
