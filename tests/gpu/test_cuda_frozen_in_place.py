"""A frozen base read from its checkpoint's files on a GPU ([Note: frozen shards in place] in
zinf/offload/in_place.py), one rank (NCCL): a bf16 GPT saved as a safetensors file, loaded under ``zinf.Init`` with
bf16 parameters on NVMe, its first half frozen. Read in place (direct reads into the pinned pool, moved into place,
copied to the device on the copy-in stream) it trains bit for bit as with the frozen shards copied to swap files.

Skipped without a GPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.usefixtures("deterministic")]

STEPS = 4


def save_bf16_safetensors(model: torch.nn.Module, path: Path) -> None:
    """``model``'s state dict in bf16 as one safetensors file (header, then the tensors' bytes in order)."""
    header, blobs, offset = {}, [], 0
    for name, t in model.state_dict().items():
        data = t.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _worker(rank: int, world: int, path: str, nvme: str, in_place: bool) -> dict:
    torch.use_deterministic_algorithms(True)
    Path(nvme).mkdir(exist_ok=True)
    config = zinf.ZeroConfig.from_dict({"precision": "bf16", "offload": {
        "params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 8 << 20, "frozen_in_place": in_place}})
    with zinf.Init(config):
        model = build("gpt")
    zinf.load_pretrained(model, path)
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        p.requires_grad_(names.index(n) >= len(names) // 2)
    engine = zinf.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3),
                             config)
    frozen = engine.resident_bytes()["nvme"].get("frozen_in_checkpoint", 0)
    losses = []
    for x, y in batches("gpt", STEPS, 8):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return {"losses": losses, "frozen": frozen, "device": engine.device.type}


def test_cuda_frozen_base_read_in_place_trains_as_copied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_bf16_safetensors(build("gpt"), path)
    before = path.read_bytes()
    got = {flag: run_distributed(_worker, 1, str(path), str(tmp_path / f"nvme_{flag}"), flag, backend="nccl")[0]
           for flag in (True, False)}
    assert got[True]["device"] == "cuda" and got[True]["frozen"] > 0 and got[False]["frozen"] == 0, got
    assert got[True]["losses"] == got[False]["losses"], got
    assert path.read_bytes() == before
