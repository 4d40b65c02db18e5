"""The NVMe pipeline keeps updated shards for the next forward, reads the next step's optimizer states
during the backward, and lets state writes trail behind the step; none of it changes a number, and
none of it holds pool memory once the engine is synchronized. One process, real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf


def _engine(tmp: Path, pool_bytes: int, grads: str = "auto", overlap: bool = True,
            optimizer: str = "nvme") -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"gradient_clipping": 0.5, "offload": {
        "params": "nvme", "optimizer": optimizer, "grads": grads, "nvme_paths": [str(tmp)], "sub_group_numel": 16384,
        "pinned_pool_bytes": pool_bytes, "overlap_optimizer": overlap}})
    with zinf.Init(config):
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())], nn.Linear(128, 4))
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _train(engine: zinf.ZeroInfinityEngine, steps: int = 6) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 128, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class _ReadLog:
    """Which swap records are read, and in which phase of the training loop (wraps the real SwapSpace)."""

    def __init__(self, engine: zinf.ZeroInfinityEngine) -> None:
        self.swap = engine.placement.swap
        self.phase = "start"
        self.reads: list[tuple[str, int]] = []
        submit = self.swap.submit_read

        def logged(rec, buf):  # type: ignore[no-untyped-def]
            self.reads.append((self.phase, rec.record_id))
            return submit(rec, buf)

        self.swap.submit_read = logged

    def of(self, phase: str) -> set[int]:
        return {rid for p, rid in self.reads if p == phase}


@pytest.mark.parametrize("grads", ["nvme", "cpu"])
def test_pool_pressure_changes_no_number(grads: str, tmp_path: Path) -> None:
    # pools from just above the minimum (every read-ahead, kept shard and trailing write competes for
    # room) to roomy; the synchronous step with states in host memory is the reference
    reference = _train(_engine(tmp_path, 8 << 20, grads="cpu", overlap=False, optimizer="cpu"))
    for pool_bytes in (2 << 20, 3 << 20, 8 << 20):
        engine = _engine(tmp_path, pool_bytes, grads=grads)
        assert _train(engine) == reference, f"pinned_pool_bytes={pool_bytes}"
        engine.synchronize()
        assert engine.placement.pool.bytes_in_use == 0  # read-ahead, kept shards and writes all given back
        engine.close()


def test_updated_shards_are_not_read_back_and_states_are_read_ahead(tmp_path: Path) -> None:
    engine = _engine(tmp_path, 8 << 20)  # room for every shard and the first sub-groups' states
    params = {rec.record_id for rec in engine.placement.store.records.values()}
    states = engine.placement.states
    first = states.subgroups[0]
    first_states = [rec.record_id for rec in states.records[id(first)].values()]
    log = _ReadLog(engine)
    g = torch.Generator().manual_seed(1)
    steps = 3
    for step in range(steps):
        x, y = torch.randn(16, 128, generator=g), torch.randint(0, 4, (16,), generator=g)
        log.phase = f"forward{step}"
        loss = nn.functional.cross_entropy(engine(x), y)
        log.phase = f"backward{step}"
        engine.backward(loss)
        # the step starts from the first sub-group's master and moments, read once the last step's
        # writes were done (during the backward, or as soon as that step finished: waited for here, since with the
        # gradients in host memory the backward can end first)
        engine.optimizer.wait()
        preread = states._preread
        assert preread and preread[0][0] is first, f"step {step}: the first sub-group's states were not read ahead"
        log.phase = f"step{step}"
        engine.step()
        engine.optimizer.before_backward()
    engine.optimizer.wait()
    # after a step the forward gathers the updated shards from their slots, and the backward the ones
    # the forward kept: no parameter shard is read from the file again
    for phase in ("forward1", "backward1", "forward2", "backward2"):
        assert not log.of(phase) & params, phase
    # and no state is read twice for a step: once per step, plus the read-ahead for the step to come
    for rid in first_states:
        assert sum(r == rid for _, r in log.reads) == steps + 1
    engine.close()


def test_write_states_drops_what_was_read_ahead(tmp_path: Path) -> None:
    # states changed from outside (a checkpoint load) must not be stepped from an older read-ahead copy
    engine = _engine(tmp_path, 8 << 20)
    _train(engine, steps=2)
    group = engine.groups[0]
    engine.optimizer.wait()
    states = engine.placement.states
    assert states._preread, "the next step's first states were read ahead"
    new_master = torch.full((group.shard_numel,), 0.25)
    states.write_states(group, {"master": new_master})
    assert not states._preread
    assert torch.equal(states.read_states(group)["master"], new_master)
    engine.close()
