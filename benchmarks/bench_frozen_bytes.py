"""Bytes a frozen parameter costs, per placement, from the engine's own accounting (``engine.resident_bytes()``).

    python benchmarks/bench_frozen_bytes.py [--nvme /tmp/zinf-nvme] [--precision bf16 fp32] [--pool-mib 64]

The model: a frozen base of 8 linear layers 1024 x 1024 (8.4M parameters) and a trainable head 1024 -> 128
(131k), one rank. The same model with a base of 4 layers is built too, and the difference of the two, per kind
of bytes, divided by the difference of their frozen parameters (4.2M), is what one frozen parameter costs:
its parameter shard (the storage width: 2 bytes in bf16, 4 in fp32), and whatever else the engine keeps for
it (an fp32 master, optimizer state). ``written/step`` is the difference in NVMe bytes the steps write, per
frozen parameter and step (the optimizer pass rewriting frozen states and shards). The pinned pool (a setting)
and the gathered buffers are not model state and are left out.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import zinf

PLACEMENTS = (("device", "device"), ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "device"), ("device", "nvme"))
KINDS = ("param_shards", "master", "grad_shards", "optimizer_state")


class Frozen(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.base = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(depth)])
        self.head = nn.Linear(1024, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x))).float().square().mean()


def measure(depth: int, precision: str, params: str, optimizer: str, nvme: str,
            pool_bytes: int) -> tuple[dict[str, int], int, int]:
    config = zinf.ZeroConfig.from_dict({"precision": precision, "offload": {
        "params": params, "optimizer": optimizer, "grads": "nvme" if optimizer == "nvme" else "auto",
        "nvme_paths": [nvme], "pinned_pool_bytes": pool_bytes, "sub_group_numel": 1 << 20}})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = Frozen(depth)
    model.base.requires_grad_(False)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    written = 0
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 1024)))
        engine.step()
        written += engine.report().counts.get("nvme_written_bytes", 0)
    engine.synchronize()
    written += engine.placement.io_counts().get("nvme_written_bytes", 0)  # writes waited for after the last step
    kinds: dict[str, int] = {}
    for per_kind in engine.resident_bytes().values():
        for kind, nbytes in per_kind.items():
            if kind in KINDS:
                kinds[kind] = kinds.get(kind, 0) + nbytes
    frozen = sum(p.numel() for p in model.base.parameters())
    engine.close()
    return kinds, written, frozen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme", default=None, help="directory for swap files (default: a temporary one)")
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--pool-mib", type=int, default=64, help="offload.pinned_pool_bytes in MiB")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    nvme = args.nvme or tempfile.mkdtemp(prefix="zinf_frozen_")
    print(f"{'precision':<10}{'params/optimizer':<18}" + "".join(f"{k:>17}" for k in KINDS)
          + f"{'total':>8}{'written/step':>14}   (bytes per frozen parameter; 8.4M-frozen model: MB)")
    for precision in args.precision:
        for params, optimizer in PLACEMENTS:
            small, small_written, small_frozen = measure(4, precision, params, optimizer, nvme, args.pool_mib << 20)
            large, large_written, large_frozen = measure(8, precision, params, optimizer, nvme, args.pool_mib << 20)
            more = large_frozen - small_frozen
            per = {k: (large.get(k, 0) - small.get(k, 0)) / more for k in KINDS}
            cells = "".join(f"{per[k]:>8.2f} ({large.get(k, 0) / 1e6:>6.1f})" for k in KINDS)
            print(f"{precision:<10}{params + '/' + optimizer:<18}{cells}{sum(per.values()):>8.2f}"
                  f"{(large_written - small_written) / more / 3:>14.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
