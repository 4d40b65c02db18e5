"""Tiled models train like untiled ones (fp32, 1 and 2 gloo ranks), checkpoints move between the two, and a
layer too large for the gather budget trains under it once tiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, batches, make_optimizer
from training import Recipe, reference, zinf_worker
from zinf.checkpoint import consolidate
from zinf.checkpoint.export import save_safetensors
from zinf.tiling import TiledLinear

pytestmark = pytest.mark.distributed

RECIPES = {
    "tiles_2x3": Recipe(kind="gpt", steps=12, zinf={"tiling": {"min_numel": 1000, "tiles": [2, 3]}}),
    # uneven grids picked by the planner (32 x 128 in 3 KiB tiles: 6 x 1 of 22 or 21 rows)
    "tiles_by_bytes": Recipe(kind="gpt", steps=12, accum=2, clip=0.5,
                             zinf={"tiling": {"min_numel": 1000, "max_tile_bytes": 3000}}),
    "tiles_cpu_offload": Recipe(kind="gpt", steps=12, zinf={"tiling": {"min_numel": 1000, "tiles": [3, 5]},
                                                            "offload": {"optimizer": "cpu"}}),
}


def _run_all(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, dict]:
    return {name: zinf_worker(rank, world, r) for name, r in recipes.items()}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tiled_models_match_untiled_pytorch(world: int) -> None:
    results = run_distributed(_run_all, world, RECIPES)[0]
    for name, recipe in RECIPES.items():
        ref_losses, ref_state = reference(recipe)  # plain PyTorch, untiled
        got = results[name]
        ref, z = torch.tensor(ref_losses, dtype=torch.float64), torch.tensor(got["losses"], dtype=torch.float64)
        rel = ((z - ref).abs() / ref.abs()).max().item()
        assert rel < 1e-5, f"{name} on {world} ranks: max relative loss difference {rel:.2e}"
        assert set(got["state"]) == set(ref_state), f"{name}: full_state_dict names differ from the untiled model's"
        for k, v in ref_state.items():
            assert got["state"][k].shape == v.shape
            drift = ((got["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
            assert drift < 1e-3, f"{name} on {world} ranks: weight {k} drifted {drift:.2e}"
        assert got["rerecords"] == {"forward": 0, "backward": 0, "eval": 0}


def _engine(tiled: bool, offload: str = "device") -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {"optimizer": offload},
                                        **({"tiling": {"min_numel": 1000, "tiles": [2, 3]}} if tiled else {})})
    with zinf.Init(config):
        model = GPT(GPTConfig())
    assert any(isinstance(m, TiledLinear) for m in model.modules()) == tiled
    return zinf.initialize(model, make_optimizer(model), config)


def _loss(engine: zinf.ZeroInfinityEngine, rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    dist.all_reduce(loss)
    return loss.item() / world


def _move(rank: int, world: int, ckpt: str) -> dict:
    data = batches("gpt", 4, 8)
    tiled = _engine(True, "cpu")
    for x, y in data[:3]:
        tiled.backward(tiled(x.chunk(world)[rank], y.chunk(world)[rank]))
        tiled.step()
    tiled.save_checkpoint(ckpt)
    save_safetensors(tiled, ckpt + "_safetensors", max_shard_size="20KB")  # several shards: tiles cross files
    dist.barrier()
    x, y = data[3]
    out = {"tiled": _loss(tiled, rank, world, x, y)}
    untiled = _engine(False)
    untiled.load_full_state_dict(consolidate(ckpt))  # tiled checkpoint -> untiled model
    out["untiled"] = _loss(untiled, rank, world, x, y)
    back = _engine(True)
    back.load_full_state_dict(untiled.full_state_dict(rank0_only=False))  # and back
    out["back"] = _loss(back, rank, world, x, y)
    out["names"] = sorted(untiled.full_state_dict(rank0_only=False))
    for e in (tiled, untiled, back):
        e.close()
    return out


def test_a_checkpoint_moves_between_tiled_and_untiled_models(tmp_path: Path) -> None:
    out = run_distributed(_move, 2, str(tmp_path / "ckpt"))[0]
    full = consolidate(tmp_path / "ckpt")
    names = sorted(full)
    assert names == out["names"], "zinf consolidate of a tiled model must give the untiled names"
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "ckpt_safetensors").glob("*.safetensors")):
        exported.update(load_file(f))
    assert len(list((tmp_path / "ckpt_safetensors").glob("*.safetensors"))) > 1
    for k, v in exported.items():  # the export writes tiled layers whole too (tied lm_head once: wte)
        assert torch.equal(v, full[k]), k
    assert not any(".tiles." in n for n in names)
    assert abs(out["untiled"] - out["tiled"]) <= 1e-5 * abs(out["tiled"])
    assert abs(out["back"] - out["tiled"]) <= 1e-5 * abs(out["tiled"])


class _Wide(torch.nn.Module):
    """One layer (256 x 256 fp32 = 256 KiB) much larger than anything else in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 256)
        self.wide = torch.nn.Linear(256, 256)
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.wide(torch.relu(self.inp(x)))
        return torch.nn.functional.cross_entropy(self.out(torch.relu(h)), y)


def _budget(rank: int, world: int, tiles: list[int] | None, budget: int) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"max_gathered_bytes": budget},
                                        **({"tiling": {"min_numel": 50_000, "tiles": tiles}} if tiles else {})})
    model = _Wide()
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    try:
        for _ in range(6):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            peaks.append(engine.report().peak_gathered_bytes)
    except zinf.UnsupportedModelError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()
    return {"losses": losses, "peaks": peaks}


@pytest.mark.slow
def test_a_layer_over_the_gather_budget_trains_under_it_once_tiled() -> None:
    budget = 96 * 1024  # the wide layer alone needs 257 KiB gathered (weight and bias)
    refused = run_distributed(_budget, 2, None, budget)[0]
    assert refused["error"].startswith("zinf: wide needs 257.0 KiB of parameters gathered at once"), refused["error"]
    assert "above overlap.max_gathered_bytes = 96.0 KiB" in refused["error"] and "tiling.max_tile_bytes" in refused["error"]
    untiled = run_distributed(_budget, 2, None, 0)[0]
    assert max(untiled["peaks"]) > budget
    tiled = run_distributed(_budget, 2, [2, 4], budget)[0]  # 8 tiles of 32 KiB
    assert max(tiled["peaks"]) <= budget, tiled["peaks"]
    for a, b in zip(tiled["losses"], untiled["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (tiled["losses"], untiled["losses"])
