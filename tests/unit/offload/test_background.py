"""The background optimizer step gives exactly the numbers of the synchronous one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf


def _losses(overlap: bool, persistent: int, offload: dict) -> list[float]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"persistent_numel": persistent},
                                        "offload": {**offload, "overlap_optimizer": overlap}})
    model = nn.Sequential(nn.Linear(512, 2048), nn.Tanh(), nn.Linear(2048, 512), nn.Tanh(), nn.Linear(512, 4))
    engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(engine(torch.randn(16, 512, generator=g)), torch.randint(0, 4, (16,), generator=g))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    engine.close()
    return out


@pytest.mark.parametrize("persistent", [0, 1 << 30], ids=["sharded", "persistent"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_background_equals_synchronous(tier: str, persistent: int, tmp_path: Path) -> None:
    # regression: groups that stay gathered (persistent, or one rank gathering in place) were read by the
    # next forward while the background step was still writing them
    offload = {"optimizer": tier, "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 256 << 20}
    assert _losses(True, persistent, offload) == _losses(False, persistent, offload)


def test_parameter_writes_do_not_fill_a_small_pool(tmp_path: Path) -> None:
    # regression (3.2B run, step 3): every updated parameter shard kept its pool buffer until that group
    # was next read, so once the shards outgrew the pool the background step failed with PoolExhaustedError
    torch.manual_seed(0)
    layers = [m for _ in range(12) for m in (nn.Linear(256, 256), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(256, 4))
    config = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path)],
                                                    "sub_group_numel": 1024, "pinned_pool_bytes": 4 << 20}})
    engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
    shard_block = 1 << (256 * 257 * 4).bit_length()  # the pool's power-of-two block for one layer's shard
    assert 12 * shard_block > engine.placement.pool.capacity_bytes  # the shards do not all fit in the pool
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 256, generator=g), torch.randint(0, 4, (8,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    engine.synchronize()
    assert engine.placement.pool.bytes_in_use <= engine.placement.pool.capacity_bytes // 2
    engine.close()


class _BuiltBackwards(nn.Module):
    """Children built in the reverse of the order the forward runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 4)
        self.mid = nn.Linear(128, 64)
        self.first = nn.Linear(32, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.first(x)))))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_groups_are_stepped_in_the_next_forwards_order(tier: str, tmp_path: Path) -> None:
    """[Note: stepped in the next forward's order]: the sweep follows the recorded forward, not construction; and
    the background step still gives the synchronous one's numbers."""

    def run(overlap: bool) -> tuple[list[str], list[float]]:
        torch.manual_seed(0)
        config = zinf.ZeroConfig.from_dict({"offload": {
            "optimizer": tier, "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 16 << 20, "sub_group_numel": 2048,
            "overlap_optimizer": overlap}})
        model = _BuiltBackwards()
        engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
        built = [sg.group.name for sg in engine.placement.states.subgroups]
        assert built.index("head") < built.index("first")  # construction order
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            loss = engine(torch.randn(8, 32, generator=g)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.synchronize()
        swept = list(dict.fromkeys(sg.group.name for sg in engine.placement.states.subgroups))
        engine.close()
        return swept, losses

    order, background = run(True)
    assert order == ["first", "mid", "head"]
    assert run(False) == (order, background)
