"""[Note: reading ahead within the pool] in zinf/schedule/fetcher.py: with the parameters on NVMe, the shards of
the modules after the running one are read ahead by bytes (a quarter of the pool), further than the gathers run
ahead; never past that, except the next module's; and how far changes no value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, batches, make_optimizer
from training import train_global

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, nvme: str, pool_bytes: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": pool_bytes}})
    with zinf.Init(config):
        model = GPT(GPTConfig(n_layer=6, n_embd=64))
    engine = zinf.initialize(model, make_optimizer(model, "adamw"), config)
    hooks, store = engine.hooks, engine.placement.store
    forward = hooks.traces["forward"]
    reads: list[tuple[int, str]] = []  # (the running module's forward position, the group read ahead)
    prefetch = store.prefetch

    def watched(group: Any, demand: bool = False) -> bool:
        if not demand and hooks.pass_state.in_forward and forward.position:
            reads.append((forward.position - 1, group.name))
        return prefetch(group, demand)

    store.prefetch = watched
    losses = train_global(engine, batches("gpt", 2, 8), rank, world)
    reads.clear()  # the forward order replays from the third step on
    losses += train_global(engine, batches("gpt", 2, 8, seed=5), rank, world)
    # each module's bytes to read, and where each group is first needed from a position on
    order = [[(g.name, g.shard_nbytes) for g in hooks.states[m].needed()] for m in forward.order]
    out = {"losses": losses, "reads": reads, "order": order, "limit": engine.fetcher.reads.limit_bytes,
           "prefetch_modules": engine.config.overlap.prefetch_modules}
    engine.close()
    return out


def _distances(run: dict[str, Any]) -> list[tuple[int, int]]:
    """For each read ahead: (modules ahead, bytes of the modules from the next one to the one that needs it)."""
    order = run["order"]
    out = []
    for at, name in run["reads"]:
        q = next(i for i in range(at + 1, len(order)) if any(n == name for n, _ in order[i]))
        out.append((q - at, sum(b for module in order[at + 1 : q + 1] for _, b in module)))
    return out


@pytest.mark.slow
def test_reads_run_ahead_by_bytes_within_a_quarter_of_the_pool(tmp_path: Path) -> None:
    (tmp_path / "roomy").mkdir()
    (tmp_path / "tight").mkdir()
    roomy = run_distributed(_worker, 1, str(tmp_path / "roomy"), 2 << 20)[0]
    tight = run_distributed(_worker, 1, str(tmp_path / "tight"), 1 << 20)[0]
    assert roomy["limit"] == 512 << 10 and tight["limit"] == 256 << 10
    model_bytes = sum(b for module in roomy["order"] for _, b in module)
    assert model_bytes > roomy["limit"]  # so that the limit, not the end of the pass, stops the reads
    for run in (roomy, tight):
        far = _distances(run)
        assert far, "nothing was read ahead"
        assert all(modules == 1 or nbytes <= run["limit"] for modules, nbytes in far), far
    # further than the gathers look ahead (the old horizon was twice prefetch_modules)
    assert max(m for m, _ in _distances(roomy)) > 2 * roomy["prefetch_modules"]
    assert max(m for m, _ in _distances(tight)) < max(m for m, _ in _distances(roomy))
    assert roomy["losses"] == tight["losses"]


def _backward_reads(rank: int, world: int, nvme: str) -> list[int]:
    """Checkpointed blocks gathered module by module, every group gathered again for its backward: how many shard
    reads each backward had to start itself (its gather waited for the disk)."""
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({
        "offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": 2 << 20},
        "unit_policy": "modules", "activation_checkpointing": {"modules": ["Block"]},
        "overlap": {"reshard_after_forward": "always"}})
    with zinf.Init(config):
        model = GPT(GPTConfig(n_layer=4, n_embd=64))
    engine = zinf.initialize(model, make_optimizer(model, "adamw"), config)
    store, hooks = engine.placement.store, engine.hooks
    counts = [0]
    prefetch = store.prefetch

    def watched(group: Any, demand: bool = False) -> bool:
        if demand and hooks.pass_state.in_backward and id(group) not in store._slots:  # no read was started ahead
            counts[0] += 1
        return prefetch(group, demand)

    store.prefetch = watched
    per_step = []
    for x, y in batches("gpt", 4, 8):
        counts[0] = 0
        engine.backward(engine(x, y))
        engine.step()
        per_step.append(counts[0])
    engine.close()
    return per_step


@pytest.mark.slow
def test_a_group_used_twice_in_a_pass_is_read_ahead_for_its_second_use(tmp_path: Path) -> None:
    """A recomputed module gives its slot back after the recomputation, when the cursor has passed its backward:
    the next modules are looked at again at every call, so its backward finds it read ahead."""
    per_step = run_distributed(_backward_reads, 1, str(tmp_path))[0]
    assert per_step[2:] == [0, 0], per_step  # once the orders replay
