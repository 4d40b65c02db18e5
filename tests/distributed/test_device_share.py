"""The device share of an offloaded optimizer (``offload.optimizer_device_fraction``, [Note: the device share] in
zinf/offload/device_states.py): the first groups' masters and moments stay on the compute device and are stepped
there with the CPU-Adam's math in torch operations, the rest on the CPU or NVMe.

Through the staged device path (``ZINF_STAGED_DEVICE=1``: the CPU stands in for a device apart, and the CPU-Adam
refuses device memory as it would a CUDA tensor) and without it, on 1 and 2 gloo ranks: fp32 with clipping and two
micro-batches within the offload tests' tolerance of plain PyTorch and of the same run with the whole optimizer
offloaded; the engine's bytes put the share's states on the device; a checkpoint of a run with a share resumes
exactly with the same share and goes on within 1e-6 with none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import Recipe, reference, train_global, zinf_worker
from zinf.device_memory import STAGED_DEVICE_ENV

pytestmark = pytest.mark.distributed

STEPS = 4


OPTIMIZERS = ("cpu", "nvme", "nvme+grads")  # the last: the CPU-Adam's gradient shards on NVMe too


def _offload(opt: str, nvme: str, fraction: float) -> dict[str, Any]:
    return {"params": "device", "optimizer": opt.split("+")[0], "nvme_paths": [nvme] if nvme else [],
            "sub_group_numel": 4096, "pinned_pool_bytes": 4 << 20, "optimizer_device_fraction": fraction,
            "grads": "nvme" if opt.endswith("+grads") else "auto"}


def _recipes(nvme: str) -> dict[str, Recipe]:
    return {f"{opt} {fraction}": Recipe(kind="gpt", steps=STEPS, clip=0.5, accum=2,
                                        zinf={"offload": _offload(opt, nvme, fraction)})
            for opt in OPTIMIZERS for fraction in (0.0, 0.5)}


def _train(rank: int, world: int, recipes: dict[str, Recipe], staged: bool) -> dict[str, Any]:
    if staged:
        os.environ[STAGED_DEVICE_ENV] = "1"  # this rank's process only
    out: dict[str, Any] = {name: zinf_worker(rank, world, r)["losses"] for name, r in recipes.items()}
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": _offload("cpu", "", 0.5)})
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    placement = engine.placement
    assert placement.device_states is not None
    out["tiers"] = engine.resident_bytes()
    out["numel"] = {"device": sum(sg.numel for sg in placement.device_states.subgroups),
                    "cpu": sum(sg.numel for sg in placement.subgroups)}
    engine.close()
    return out


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "cpu"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_device_share_trains_like_pytorch(world: int, staged: bool, tmp_path: Path) -> None:
    got = run_distributed(_train, world, _recipes(str(tmp_path)), staged)[0]
    ref = reference(Recipe(kind="gpt", steps=STEPS, clip=0.5, accum=2))[0]
    tol = 1e-6 if world == 1 else 1e-5  # test_offload_parity.py's
    for opt in OPTIMIZERS:
        for other in (ref, got[f"{opt} 0.0"]):
            rel = max(abs(a - b) / abs(a) for a, b in zip(other, got[f"{opt} 0.5"]))
            assert rel <= tol, f"{opt}: {rel:.2e}"
    numel = got["numel"]
    assert numel["device"] > 0 and numel["cpu"] > 0
    assert 0.5 <= numel["device"] / (numel["device"] + numel["cpu"]) < 0.8  # whole groups, the first built
    tiers = got["tiers"]
    assert tiers["device"]["optimizer_state"] == 12 * numel["device"]  # fp32 master and two moments
    # the host's master is the fp32 parameter shard itself where that is host memory ([Note: one fp32 master on the
    # host] in zinf/offload/state_store.py): unstaged on the CPU
    assert tiers["cpu"]["optimizer_state"] == (12 if staged else 8) * numel["cpu"]


def _engine(fraction: float) -> zinf.ZeroInfinityEngine:
    config = zinf.ZeroConfig.from_dict({"gradient_clipping": 1.0, "offload": _offload("cpu", "", fraction)})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = build("gpt")
    return zinf.initialize(model, make_optimizer(model), config)


def _resume(rank: int, world: int, ckpt: str) -> dict[str, list[float]]:
    os.environ[STAGED_DEVICE_ENV] = "1"
    data = batches("gpt", 8, 8)
    first = _engine(0.5)
    train_global(first, data[:4], rank, world)
    first.save_checkpoint(ckpt)
    out = {"straight": train_global(first, data[4:], rank, world)}
    first.close()
    for fraction in (0.5, 0.0):
        again = _engine(fraction)
        again.load_checkpoint(ckpt)
        out[f"resumed {fraction}"] = train_global(again, data[4:], rank, world)
        again.close()
    return out


def test_a_device_share_checkpoint_resumes(tmp_path: Path) -> None:
    r = run_distributed(_resume, 2, str(tmp_path / "ckpt"))[0]
    assert r["resumed 0.5"] == r["straight"], r
    rel = max(abs(a - b) / abs(a) for a, b in zip(r["straight"], r["resumed 0.0"]))
    assert rel < 1e-6, r


def test_a_device_share_needs_the_parameters_on_the_device() -> None:
    with pytest.raises(zinf.ConfigError, match=r"optimizer_device_fraction.*offload.params is 'device'"):
        zinf.ZeroConfig.from_dict({"offload": {"params": "cpu", "optimizer": "cpu", "optimizer_device_fraction": 0.5}})
    with pytest.raises(zinf.ConfigError, match=r"optimizer_device_fraction' = 1.0 .*\[0, 1\)"):
        zinf.ZeroConfig.from_dict({"offload": {"optimizer": "cpu", "optimizer_device_fraction": 1.0}})
