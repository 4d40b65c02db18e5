"""bf16 parameters on the GPU with the optimizer on the CPU and on NVMe, one rank (see [Note: staged updates] in
zinf/offload/staged_store.py and [Note: gradient landing] in zinf/param/grad_shard.py): the updates reach the
device through pinned staging, the gradient shards leave it into pinned host memory, and the run tracks the fp32
PyTorch reference as closely as bf16 allows (``references.bf16_bound``: 5e-3 relative loss, as on the CPU, or 1.25x
plain PyTorch's own bf16 drift where that is larger).

Skipped without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from references import bf16_bound, max_relative, plain_losses

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


STEPS = 20


def _worker(rank: int, world: int, optimizer: str, nvme: str) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"precision": "bf16", "gradient_clipping": 1.0, "offload": {
        "params": "device", "optimizer": optimizer, "nvme_paths": [nvme], "overlap_optimizer": True}})
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    store = engine.placement.store
    assert all(store.read(g).is_cuda for g in engine.groups)
    losses = []
    for x, y in batches("gpt", STEPS, 8):
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    engine.synchronize()
    pinned = {"grad": all(g.grad.resident is None or g.grad.resident.is_pinned() for g in engine.groups),
              "staging": all(buf.is_pinned() for buf, _ in store._ring)}
    engine.close()
    return {"losses": losses, "pinned": pinned}


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_bf16_on_gpu_with_optimizer_offloaded(optimizer: str, tmp_path: Path) -> None:
    ref, plain_bf16 = plain_losses("gpt", STEPS, clip=1.0), plain_losses("gpt", STEPS, "bf16", clip=1.0)
    got = run_distributed(_worker, 1, optimizer, str(tmp_path), backend="nccl")[0]
    rel = max_relative(ref, got["losses"])
    assert rel <= bf16_bound(ref, plain_bf16), f"bf16, optimizer on {optimizer}: {rel:.2e} from the fp32 reference; " \
                                               f"plain PyTorch's bf16: {max_relative(ref, plain_bf16):.2e}"
    assert got["pinned"] == {"grad": True, "staging": True}
