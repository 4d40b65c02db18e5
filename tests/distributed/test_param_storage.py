"""Parameter shards stored in 16 bits with fp32 compute (``param_storage``), on 1 and 2 gloo ranks.

The contract: the run equals plain PyTorch whose fp32 master weights are stepped by the optimizer and whose
parameters, as the forward and backward see them, are those masters rounded to the storage dtype after every
step (tests/training.py ``mixed_reference``, which computes in fp32 on the rounded values). Held at 1e-6
relative loss difference at every step, on every placement of parameters and optimizer states.

Bytes: a parameter shard at rest takes 2 bytes per element in bf16 / fp16 storage against 4 in fp32, on the
device, on the CPU and on NVMe, as the engine reports them (``resident_bytes``); with the parameters on NVMe
the bytes read per step fall to half or less (half the bytes per shard, and more shards stay cached in the same
pinned pool; the optimizer states stay on the CPU, so NVMe reads are parameters only).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, make_optimizer
from training import Recipe, mixed_reference, zinf_worker

pytestmark = pytest.mark.distributed

RTOL = 1e-6
STEPS = 4
TIERS = ("device", "cpu", "nvme")


def _recipes(nvme: str) -> dict[str, Recipe]:
    def recipe(params: str, optimizer: str, storage: str = "bf16", **extra: Any) -> Recipe:
        offload = {"params": params, "optimizer": optimizer, "nvme_paths": [nvme], "sub_group_numel": 4096,
                   "pinned_pool_bytes": 4 << 20}
        return Recipe(kind="gpt", steps=STEPS, zinf={"param_storage": storage, "offload": offload}, **extra)

    out = {f"{p}/{o}": recipe(p, o) for p, o in itertools.product(TIERS, TIERS)}
    out["cpu/cpu fp16 storage"] = recipe("cpu", "cpu", storage="fp16")
    out["nvme/nvme clip accum=2"] = recipe("nvme", "nvme", clip=0.5, accum=2)
    return out


def _run(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, list[float]]:
    return {name: zinf_worker(rank, world, r)["losses"] for name, r in recipes.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_16bit_storage_equals_rounded_masters(world: int, tmp_path: Path) -> None:
    recipes = _recipes(str(tmp_path))
    got = run_distributed(_run, world, recipes)[0]
    refs: dict[tuple, list[float]] = {}
    worst, failures = 0.0, []
    for name, recipe in recipes.items():
        key = (recipe.zinf["param_storage"], recipe.clip, recipe.accum)
        if key not in refs:
            refs[key] = mixed_reference(recipe, world)[0]
        ref = refs[key]
        rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got[name]))
        worst = max(worst, rel)
        if not rel <= RTOL:
            failures.append(f"{name}: max relative loss difference {rel:.3e} (reference {ref}, zinf {got[name]})")
    # the rounding is real: fp32 storage trains to other losses than bf16 storage
    fp32_ref = mixed_reference(Recipe(kind="gpt", steps=STEPS), world)[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(fp32_ref, got["device/device"])) > 10 * RTOL
    print(f"{world} rank(s): {len(recipes)} recipes, largest relative difference to the reference {worst:.3e}")
    assert not failures, "\n".join(failures)


def _bytes(rank: int, world: int, nvme: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 4.8M parameters: a rank's fp32 shards (9.6 MB) are over twice the pinned pool, so parameters are read back
    cfg = GPTConfig(vocab=512, block=32, n_embd=256, n_head=4, n_layer=6)
    for storage in ("precision", "bf16"):
        for params in ("device", "cpu", "nvme"):
            torch.manual_seed(0)
            config = zinf.ZeroConfig.from_dict({"param_storage": storage, "offload": {
                "params": params, "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20,
                # the step in the step: its reads count in it, whatever the timing of a background sweep
                "overlap_optimizer": False}})
            with zinf.Init(config):
                model = GPT(cfg)
            engine = zinf.initialize(model, make_optimizer(model), config)
            g = torch.Generator().manual_seed(rank)
            reads = []
            for _ in range(3):
                idx = torch.randint(0, cfg.vocab, (4, cfg.block + 1), generator=g)
                engine.backward(engine(idx[:, :-1], idx[:, 1:]))
                engine.step()
                reads.append(engine.report().counts.get("nvme_read_bytes", 0))
            resident = engine.resident_bytes()  # the engine's own accounting (report().bytes is the same)
            shard_numel = sum(grp.shard_numel for grp in engine.groups)
            tier = "nvme" if params == "nvme" else "cpu"  # the device tier is host memory here
            out[f"{storage}/{params}"] = {"bytes_per_param": resident[tier]["param_shards"] / shard_numel,
                                          "reads": reads[1:], "resident": resident}
            engine.close()
            dist.barrier()
    return out


@pytest.mark.slow
def test_16bit_storage_halves_the_bytes_at_rest_and_read(tmp_path: Path) -> None:
    results = run_distributed(_bytes, 2, str(tmp_path))
    for rank, r in enumerate(results):
        for params in ("device", "cpu", "nvme"):
            wide, narrow = r[f"precision/{params}"], r[f"bf16/{params}"]
            rel = 0.03 if params == "nvme" else 1e-9  # NVMe records take whole 4 KiB blocks
            assert wide["bytes_per_param"] == pytest.approx(4.0, rel=rel), (rank, params, wide)
            assert narrow["bytes_per_param"] == pytest.approx(2.0, rel=rel), (rank, params, narrow)
        wide_reads, narrow_reads = r["precision/nvme"]["reads"], r["bf16/nvme"]["reads"]
        # fp32 shards are over twice the pool, so every fp32 step reads (8.3 MB per rank per step here); the bf16
        # shards are just over it (2.8-3.4 MB read per step here)
        assert min(wide_reads) > 0, wide_reads
        # half the bytes per shard, and more of the shards stay cached in the same pool: at most half as many read
        assert 2 * sum(narrow_reads) <= sum(wide_reads), \
            f"rank {rank}: NVMe bytes read per step, fp32 {wide_reads} vs bf16 {narrow_reads}"
        print(f"rank {rank}: NVMe bytes read per step fp32 {wide_reads} / bf16 {narrow_reads}")
