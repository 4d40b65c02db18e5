"""Every offload placement and training option, on 1 and 2 gloo ranks, against references computed in the
same run on the same CPU, so the test holds on any instruction set (AVX-512, AVX2, scalar).

What each comparison claims, and where it holds:

- fp32 recipes against plain single-process PyTorch (tests/training.py ``reference``): on one rank, with
  the optimizer states on the device tier (torch's own AdamW steps the fp32 masters), the losses are
  bit-identical (0.0 difference, the exact contract). With the optimizer on CPU or NVMe, zinf's C++
  CPU-Adam steps them: its AVX-512 kernel rounds as torch's AdamW does, its AVX2 and scalar kernels can
  differ in the last bit (seen on an AVX2 machine: 1.0e-7 with gradient accumulation), so within 1e-6.
  On two ranks the gradient is a sum of two halves taken in another order, so within 1e-5 relative (as
  tests/distributed/test_parity.py). Within one world size, every placement of one (clip, accumulation,
  optimizer implementation) family gives bit-identical losses: the tier a parameter, gradient or
  optimizer state lives on, and whether the step runs in the background, change no number. These hold
  on any CPU, because both sides run on the same one; no number recorded on another machine is used.
- bf16 and fp16 recipes against plain PyTorch following the 16-bit contract (``mixed_reference``: fp32
  masters, compute on a copy rounded to 16 bits, fp32 gradient sums, fp16 loss scaling that skips
  overflowing steps): the same steps must be skipped, and the losses must agree within
  ``torch.finfo(dtype).eps / 32`` relative at every step (bf16: 2.4e-4, fp16: 3.1e-5). Why that bound:
  zinf's C++ CPU-Adam and torch's AdamW round the fp32 master differently in the last bit (FMA order,
  SIMD width), which moves a few of the 16-bit parameters by one unit in the last place (eps relative);
  each such move shifts the loss by a small fraction of that. A wrong gradient, a missed unscale or a
  lost update moves it by orders of magnitude more. Measured on an AVX2 machine (2026-11-24): see the
  ``print`` of this test with ``-s``.

Recipes (6 steps each, the small GPT of tests/models.py, ``sub_group_numel`` 4096 so that the NVMe
optimizer pipeline sees several sub-groups): parameters device/CPU/NVMe x optimizer states
device/CPU/NVMe; gradients on NVMe and on CPU with the NVMe optimizer; ``overlap_optimizer`` on and
off; gradient clipping; gradient accumulation 2; fp16 with dynamic loss scaling (near the overflow
edge, so steps are both skipped with the scale backed off and taken with the scale grown) and clipping;
bf16. All recipes of one world size run in one spawned group of processes.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_distributed
from training import Recipe, mixed_reference, reference, zinf_worker

pytestmark = pytest.mark.distributed

STEPS = 6
FP32_RTOL_RANKS = 1e-5  # two ranks sum the two halves of the gradient in another order than one process
FP32_RTOL_CPU_ADAM = 1e-6  # the C++ CPU-Adam's AVX2 / scalar kernels against torch's AdamW, one rank
TIERS = ("device", "cpu", "nvme")
# fp16 with a scale near the overflow edge that doubles after every 2 good steps: in 6 steps some steps
# overflow (skipped, scale halved) and some grow the scale
FP16 = {"precision": "fp16", "loss_scale": {"initial_scale": 2.0**18, "growth_interval": 2}}
BF16 = {"precision": "bf16"}


def _offload(params: str, optimizer: str, nvme: str, **extra: Any) -> dict[str, Any]:
    return {"offload": {"params": params, "optimizer": optimizer, "nvme_paths": [nvme + "/a", nvme + "/b"],
                        "sub_group_numel": 4096, "pinned_pool_bytes": 4 << 20, **extra}}


def _recipes(nvme: str) -> dict[str, Recipe]:
    def recipe(params: str, optimizer: str, clip: float = 0.0, accum: int = 1, extra: dict | None = None,
               **offload: Any) -> Recipe:
        return Recipe(kind="gpt", steps=STEPS, clip=clip, accum=accum,
                      zinf={**_offload(params, optimizer, nvme, **offload), **(extra or {})})

    out = {f"{p}/{o}": recipe(p, o) for p, o in itertools.product(TIERS, TIERS)}
    out.update({
        "cpu/nvme grads=nvme": recipe("cpu", "nvme", grads="nvme"),
        "cpu/nvme grads=cpu": recipe("cpu", "nvme", grads="cpu"),
        "nvme/nvme grads=cpu": recipe("nvme", "nvme", grads="cpu"),
        "cpu/cpu overlap=on": recipe("cpu", "cpu", overlap_optimizer=True),
        "cpu/cpu overlap=off": recipe("cpu", "cpu", overlap_optimizer=False),
        "nvme/nvme overlap=on": recipe("nvme", "nvme", overlap_optimizer=True),
        "nvme/nvme overlap=off": recipe("nvme", "nvme", overlap_optimizer=False),
        "device/device clip": recipe("device", "device", clip=0.5),
        "cpu/cpu clip": recipe("cpu", "cpu", clip=0.5),
        "nvme/nvme clip": recipe("nvme", "nvme", clip=0.5),
        "device/device accum=2": recipe("device", "device", accum=2),
        "cpu/cpu accum=2 clip": recipe("cpu", "cpu", clip=0.5, accum=2),
        "nvme/nvme accum=2": recipe("nvme", "nvme", accum=2),
        "device/device fp16 clip": recipe("device", "device", clip=0.5, extra=FP16),
        "cpu/cpu fp16 clip": recipe("cpu", "cpu", clip=0.5, extra=FP16),
        "nvme/nvme fp16 clip accum=2": recipe("nvme", "nvme", clip=0.5, accum=2, extra=FP16),
        "device/device bf16": recipe("device", "device", extra=BF16),
        "cpu/cpu bf16": recipe("cpu", "cpu", extra=BF16),
        "nvme/nvme bf16 clip": recipe("nvme", "nvme", clip=0.5, extra=BF16),
    })
    return out


def _run(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, r in recipes.items():
        result = zinf_worker(rank, world, r)
        out[name] = {"losses": result["losses"], "skipped": result["skipped"]}
    return out


def _family(recipe: Recipe) -> tuple[str, float, int]:
    """Recipes that one reference run stands for: precision, clipping, accumulation."""
    return recipe.zinf.get("precision", "fp32"), recipe.clip, recipe.accum


def _optimizer(recipe: Recipe) -> str:
    """Which implementation steps the fp32 masters: torch's optimizer (device tier) or zinf's CPU-Adam."""
    return "torch" if recipe.zinf["offload"]["optimizer"] == "device" else "cpu_adam"


def _max_rel(ref: list[float], got: list[float]) -> float:
    if len(ref) != len(got):
        return math.inf
    rel = 0.0
    for a, b in zip(ref, got):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        rel = max(rel, abs(a - b) / max(abs(a), 1e-30))
    return rel


def _rtol(precision: str, world: int, optimizer: str = "cpu_adam") -> float:
    if precision == "fp32":
        if world > 1:
            return FP32_RTOL_RANKS
        return 0.0 if optimizer == "torch" else FP32_RTOL_CPU_ADAM
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.finfo(dtype).eps / 32


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_step_losses_match_same_run_references(world: int, tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    recipes = _recipes(str(tmp_path))
    got = run_distributed(_run, world, recipes)[0]

    references: dict[tuple[str, float, int], tuple[list[float], int]] = {}
    for recipe in recipes.values():
        family = _family(recipe)
        if family not in references:
            if family[0] == "fp32":
                references[family] = (reference(recipe)[0], 0)
            else:
                references[family] = mixed_reference(recipe, world)

    failures, worst = [], {}
    first_of_family: dict[tuple[Any, ...], str] = {}
    for name, recipe in recipes.items():
        family = _family(recipe)
        ref_losses, ref_skipped = references[family]
        rel, rtol = _max_rel(ref_losses, got[name]["losses"]), _rtol(family[0], world, _optimizer(recipe))
        worst[name] = rel
        if not rel <= rtol:
            failures.append(f"{name}: max relative loss difference to the reference {rel:.3e} > {rtol:.3e} "
                            f"(reference {ref_losses}, zinf {got[name]['losses']})")
        if got[name]["skipped"] != ref_skipped:
            failures.append(f"{name}: {got[name]['skipped']} skipped steps, the reference skipped {ref_skipped}")
        if family[0] == "fp32":  # the tier changes no number: bit-identical within a family
            first = first_of_family.setdefault((*family, _optimizer(recipe)), name)
            if got[name]["losses"] != got[first]["losses"]:
                failures.append(f"{name}: losses differ from {first} (same precision, clip, accumulation and optimizer): "
                                f"{got[name]['losses']} vs {got[first]['losses']}")
    if not any(got[n]["skipped"] for n, r in recipes.items() if _family(r)[0] == "fp16"):
        failures.append("no fp16 recipe skipped a step: the loss-scale recipe no longer reaches the overflow edge")
    for precision in ("fp32", "bf16", "fp16"):
        names = [n for n, r in recipes.items() if _family(r)[0] == precision]
        top = max(names, key=lambda n: worst[n])
        print(f"{world} rank(s) {precision}: {len(names)} recipes, largest relative difference to the reference "
              f"{worst[top]:.3e} ({top}; bound {_rtol(precision, world, _optimizer(recipes[top])):.2e})")
    assert not failures, f"{world} rank(s): {len(failures)} failure(s):\n" + "\n".join(failures)
