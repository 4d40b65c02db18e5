"""fp32 zinf training matches plain single-process PyTorch step for step, on 1, 2 and 4 gloo ranks.

One rank: bit-identical losses and weights. Several ranks: each rank sees 1/world of every batch,
so only float rounding of the cross-rank average differs: within 1e-5 relative per step.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from training import Recipe, reference, zinf_worker

pytestmark = pytest.mark.distributed

STEPS = 12  # the first step records the module order, the rest replay it: more steps prove nothing more
RECIPES = {
    "gpt_tied": Recipe(kind="gpt", steps=STEPS),
    "gpt_external_param": Recipe(kind="gpt_functional", steps=STEPS),
    "cnn_clipped": Recipe(kind="cnn", clip=0.05, steps=STEPS),
    "module_called_twice": Recipe(kind="twice", optimizer="adam", steps=STEPS),
    # tiny buckets: every group reduced on its own, several buckets in flight; small groups stay gathered
    "gpt_small_buckets_persistent": Recipe(kind="gpt", steps=STEPS,
                                           zinf={"overlap": {"reduce_bucket_bytes": 4096, "persistent_numel": 2000}}),
    "gpt_accum_clip_sgd": Recipe(kind="gpt", accum=2, clip=0.5, optimizer="sgd", steps=STEPS),
}


def _run_all(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, dict]:
    return {name: zinf_worker(rank, world, r) for name, r in recipes.items()}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {name: reference(r) for name, r in RECIPES.items()}


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_fp32_matches_pytorch(world: int, references) -> None:
    results = run_distributed(_run_all, world, RECIPES)[0]
    for name, recipe in RECIPES.items():
        ref_losses, ref_state = references[name]
        got = results[name]
        assert len(got["losses"]) == recipe.steps
        if world == 1:
            assert got["losses"] == ref_losses, f"{name}: losses differ on one rank"
            for k, v in ref_state.items():
                assert torch.equal(got["state"][k], v), f"{name}: weight {k} differs on one rank"
        else:
            ref, z = torch.tensor(ref_losses, dtype=torch.float64), torch.tensor(got["losses"], dtype=torch.float64)
            rel = ((z - ref).abs() / ref.abs()).max().item()
            assert rel < 1e-5, f"{name} on {world} ranks: max relative loss difference {rel:.2e}"
            # Adam divides by sqrt(v), so elements whose true gradient is zero (the key third of the qkv
            # bias: softmax ignores a constant added to every key) follow rounding noise. Compare the
            # norm of each tensor's difference; a wrong gradient drifts by O(1), rounding by < 1e-3.
            for k, v in ref_state.items():
                drift = ((got["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
                assert drift < 1e-3, f"{name} on {world} ranks: weight {k} drifted {drift:.2e} (relative norm)"
        assert got["rerecords"]["forward"] == 0 and got["rerecords"]["backward"] == 0, f"{name}: trace re-recorded"
