"""The overlapped optimizer step, on a worker thread or driven by the training thread's gathers, gives exactly the
numbers of the synchronous one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.offload.nvme_slots import SlotState


def _losses(overlap: bool, persistent: int, offload: dict, thread: str = "auto") -> list[float]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"persistent_numel": persistent},
                                        "offload": {**offload, "overlap_optimizer": overlap, "optimizer_thread": thread}})
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


@pytest.mark.parametrize("thread", ["worker", "training"])
@pytest.mark.parametrize("persistent", [0, 1 << 30], ids=["sharded", "persistent"])
@pytest.mark.parametrize("tier", ["cpu", "nvme", "nvme-params"])
def test_background_equals_synchronous(tier: str, persistent: int, thread: str, tmp_path: Path) -> None:
    # regression: groups that stay gathered (persistent, or one rank gathering in place) were read by the
    # next forward while the background step was still writing them
    offload = {"optimizer": tier.split("-")[0], "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 256 << 20,
               **({"params": "nvme"} if tier == "nvme-params" else {})}
    assert _losses(True, persistent, offload, thread) == _losses(False, persistent, offload)


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


def _nvme_engine(tmp_path: Path, thread: str, layers: int = 4) -> tuple[zinf.ZeroInfinityEngine, nn.Module]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 32 << 20,
        "sub_group_numel": 1 << 16, "optimizer_thread": thread}})
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 4))
    return zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config), model


def _train_step(engine: zinf.ZeroInfinityEngine, g: torch.Generator) -> None:
    x, y = torch.randn(8, 256, generator=g), torch.randint(0, 4, (8,), generator=g)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    engine.step()


def test_a_driven_step_runs_as_far_as_a_gather_needs(tmp_path: Path) -> None:
    """[Note: a sweep the gathers drive]: ``step()`` steps nothing; a wait for a group steps the sub-groups up to that
    group's and no further; the backward's start finishes the step."""
    engine, _ = _nvme_engine(tmp_path, "training")
    optimizer, fence = engine.placement.optimizer, engine.placement.fence
    assert optimizer.driven
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # from the second step on, the sweep follows the recorded forward's order
        _train_step(engine, g)  # each returns with nothing of its step done
    order = list(dict.fromkeys(sg.group for sg in engine.placement.states.subgroups))
    assert len(order) >= 3 and all(fence.pending(grp) for grp in order)
    fence.wait(order[1])  # as the forward's gather of the second group does
    assert [fence.pending(grp) for grp in order] == [False, False] + [True] * (len(order) - 2)
    fence.wait_all()  # as the backward's start does
    assert not any(fence.pending(grp) for grp in order)
    engine.close()


@pytest.mark.parametrize("thread", ["worker", "training"])
def test_trained_slots_kept_for_the_backward_make_room_for_the_next_states(thread: str, tmp_path: Path) -> None:
    """[Note: kept slots before an update]: groups the forward keeps gathered for the backward give their kept pool
    slots back as the backward starts, so the optimizer reads the next step's first states during the backward."""
    engine, _ = _nvme_engine(tmp_path, thread)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _train_step(engine, g)
    store, states = engine.placement.store, engine.placement.states
    x, y = torch.randn(8, 256, generator=g), torch.randint(0, 4, (8,), generator=g)
    loss = nn.functional.cross_entropy(engine(x), y)
    held = [grp for grp in engine.groups if grp.trainable and grp.backward_held]
    assert held  # the forward kept them gathered for its backward
    engine.backward(loss)
    assert not any(store._slots.get(id(grp)) is not None and store._slots[id(grp)].state is SlotState.KEPT for grp in held)
    states.finish_writes()  # the last step's writes, which the read-ahead waits for (still in flight in a step this small)
    assert len(states._preread) > 0  # the next step's first states, read into the room the slots gave back
    engine.step()
    engine.close()
