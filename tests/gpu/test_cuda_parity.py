"""The parity recipes on CUDA with NCCL: the same engine code with real streams and device shards.

"Exact" holds with deterministic settings, as on CPU: both sides run with torch's deterministic algorithms
(cuBLAS with a fixed workspace), since CUDA's default kernels (atomics in the embedding's backward, for one)
change the last bits from run to run and 30 Adam steps amplify them.

Skipped without a GPU.
"""

from __future__ import annotations


import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from references import bf16_bound, max_relative, plain_losses

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.usefixtures("deterministic")]


def _worker(rank: int, world: int, kind: str, steps: int, precision: str) -> list[float]:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    config = zinf.ZeroConfig(precision=precision)
    with zinf.Init(config):
        model = build(kind)
    engine = zinf.initialize(model, make_optimizer(model), config)
    assert engine.device.type == "cuda" and all(g.shard.is_cuda for g in engine.groups)
    out = []
    for x, y in batches(kind, steps, 8):
        loss = engine(x.chunk(world)[rank].cuda(), y.chunk(world)[rank].cuda())
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        torch.distributed.all_reduce(total)
        out.append(total.item() / world)
    return out


@pytest.mark.parametrize("kind", ["gpt", "gpt_functional", "cnn", "twice"])
def test_cuda_fp32_matches_pytorch(kind: str) -> None:
    world = min(torch.cuda.device_count(), 4)
    ref = plain_losses(kind, 30)
    got = run_distributed(_worker, world, kind, 30, "fp32", backend="nccl")[0]
    rel = max_relative(ref, got)
    assert rel < 1e-5, f"{kind} on {world} GPU(s): max relative loss difference {rel:.2e}"


def test_cuda_bf16_tracks_fp32() -> None:
    world = min(torch.cuda.device_count(), 4)
    ref, plain_bf16 = plain_losses("gpt", 30), plain_losses("gpt", 30, "bf16")
    got = run_distributed(_worker, world, "gpt", 30, "bf16", backend="nccl")[0]
    rel = max_relative(ref, got)
    assert rel <= bf16_bound(ref, plain_bf16), \
        f"bf16 on {world} GPU(s): {rel:.2e} from fp32; plain PyTorch's bf16: {max_relative(ref, plain_bf16):.2e}"


def _built_values(rank: int, world: int, kind: str, precision: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig(precision=precision)
    with zinf.Init(config):
        model = build(kind)
    engine = zinf.initialize(model, make_optimizer(model), config)
    return {k: v.cpu() for k, v in engine.full_state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_init_on_cuda_gives_the_values_of_a_model_built_on_cpu(precision: str) -> None:
    """GPT re-initialises its children's weights after they are partitioned (``apply(_init_weights)``): those
    fills draw from the CPU generator at the built dtype (fp32), as they would in ``build().cuda()`` ([Note: edits
    draw where plain PyTorch would] in zinf/init.py), then bf16 rounds them."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    ref = {k: v.to(dtype) for k, v in build("gpt").state_dict().items()}
    got = {k: v.to(dtype) for k, v in run_distributed(_built_values, 1, "gpt", precision, backend="nccl")[0].items()}
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]
