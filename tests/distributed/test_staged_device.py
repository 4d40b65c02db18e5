"""The device path on CPU: ``ZINF_STAGED_DEVICE=1`` makes the compute device a memory apart from the host's (see
[Note: staged device] in zinf/device_memory.py), so shards, gradients and updates cross between them through
host staging buffers and copies, as on a GPU; the CPU-Adam refuses device memory as it would a CUDA tensor.

Every recipe trains through that path on 1 and 2 gloo ranks against plain PyTorch:
- 16-bit parameter shards (``param_storage`` bf16/fp16, fp32 compute) on the device with the optimizer on the CPU
  and on NVMe, and on the CPU and NVMe tiers: within 1e-6 relative loss of ``mixed_reference`` (the fp32 masters
  rounded to the storage dtype after every step), as tests/distributed/test_param_storage.py holds them unstaged;
- bf16 compute (``precision: bf16``) with the parameters on the device, optimizer on CPU and NVMe: within 5e-3 of
  the fp32 reference (the bf16 tolerance of tests/distributed/test_precision.py);
- fp32 with clipping and 2 micro-batches, parameters on the device, optimizer on the CPU: within 1e-6 (1 rank) and
  1e-5 (2 ranks) of the fp32 reference (test_offload_parity.py's tolerances).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import build, make_optimizer
from training import Recipe, mixed_reference, reference, zinf_worker
from zinf.device_memory import STAGED_DEVICE_ENV

pytestmark = pytest.mark.distributed

STEPS = 4


def _recipes(nvme: str) -> dict[str, Recipe]:
    def offload(params: str, optimizer: str) -> dict[str, Any]:
        return {"params": params, "optimizer": optimizer, "nvme_paths": [nvme], "sub_group_numel": 4096,
                "pinned_pool_bytes": 4 << 20}

    out = {}
    for storage in ("bf16", "fp16"):
        for params, opt in (("device", "cpu"), ("device", "nvme"), ("cpu", "cpu"), ("nvme", "nvme")):
            out[f"{params}/{opt} {storage} storage"] = Recipe(
                kind="gpt", steps=STEPS, zinf={"param_storage": storage, "offload": offload(params, opt)})
    for opt in ("cpu", "nvme"):
        out[f"device/{opt} bf16"] = Recipe(kind="gpt", steps=STEPS, zinf={"precision": "bf16",
                                                                          "offload": offload("device", opt)})
    out["device/cpu fp32 clip accum=2"] = Recipe(kind="gpt", steps=STEPS, clip=0.5, accum=2,
                                                 zinf={"offload": offload("device", "cpu")})
    return out


def _staged(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, list[float]]:
    os.environ[STAGED_DEVICE_ENV] = "1"  # this rank's process only
    return {name: zinf_worker(rank, world, r)["losses"] for name, r in recipes.items()}


def _rel(ref: list[float], got: list[float]) -> float:
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


@pytest.mark.parametrize("world", [1, 2])
def test_staged_device_matches_pytorch(world: int, tmp_path: Path) -> None:
    recipes = _recipes(str(tmp_path))
    got = run_distributed(_staged, world, recipes)[0]
    failures = []
    for name, recipe in recipes.items():
        if "storage" in name:
            rel, tol = _rel(mixed_reference(recipe, world)[0], got[name]), 1e-6
        elif "bf16" in name:
            rel, tol = _rel(reference(Recipe(kind="gpt", steps=STEPS))[0], got[name]), 5e-3
        else:
            ref = reference(Recipe(kind="gpt", steps=STEPS, clip=0.5, accum=2))[0]
            rel, tol = _rel(ref, got[name]), 1e-6 if world == 1 else 1e-5
        if not rel <= tol:
            failures.append(f"{name}: {rel:.2e} from PyTorch (tolerance {tol:.0e})")
    assert not failures, "\n".join(failures)


def _device_memory(rank: int, world: int) -> dict[str, Any]:
    os.environ[STAGED_DEVICE_ENV] = "1"
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"param_storage": "bf16", "offload": {"params": "device", "optimizer": "cpu"}})
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    group = engine.groups[0]
    out: dict[str, Any] = {"device_shard": engine.placement.store.read(group)}
    try:
        zinf.native.adam_step(torch.zeros(group.shard_numel), torch.zeros(group.shard_numel),
                              torch.zeros(group.shard_numel), torch.zeros(group.shard_numel),
                              zinf.native.AdamHyper(), step=1, param_out=out["device_shard"])
        out["error"] = ""
    except ValueError as exc:
        out["error"] = str(exc)
    out["tiers"] = engine.resident_bytes()
    engine.close()
    del out["device_shard"]
    return out


def test_cpu_adam_refuses_device_memory() -> None:
    """The fault the staged setting exists to catch: a device shard handed to the CPU-Adam as its output."""
    out = run_distributed(_device_memory, 1)[0]
    assert "param_out" in out["error"] and STAGED_DEVICE_ENV in out["error"], out["error"]
    assert out["tiers"]["device"]["param_shards"] > 0 and "param_shards" not in out["tiers"].get("cpu", {})
