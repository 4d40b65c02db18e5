"""Pretrained weights into a partitioned model (zinf/checkpoint/pretrained.py, zinf/integrations/transformers.py),
on real gloo processes:

- transformers' ``from_pretrained`` of a sharded safetensors checkpoint inside ``zinf.Init`` gives every parameter
  exactly the values of a plain ``from_pretrained`` (fp32: identical), with tied and untied heads, then trains
  like plain PyTorch on the same global batch (losses within 1e-6 relative on 1 rank, 1e-5 on 2: the gradient
  sum runs in another order), with parameters on the device tier, on the CPU, and on NVMe;
- every rank reads only its own slices: the bytes each rank reads are about 1/world of the files';
- a model built under ``zinf.Init`` on ranks seeded differently trains exactly like one process (rank 0's values,
  as DDP), also when the parent re-initialises its children after they were partitioned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import save_llama, token_batches
from training import lm_step_global

pytestmark = pytest.mark.distributed

STEPS = 4
LR = 1e-3


def _batches(world_batch: int = 4, seq: int = 16) -> list[torch.Tensor]:
    return token_batches(STEPS, world_batch, seq)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {"tied" if tied else "untied": save_llama(tmp_path_factory.mktemp(f"llama_tied{int(tied)}"), tied)
            for tied in (False, True)}


def _reference(path: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for x in _batches():
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return state, losses
    finally:
        torch.set_num_threads(threads)


def _train(rank: int, world: int, path: str, params_tier: str, nvme: str) -> dict:
    from transformers import AutoModelForCausalLM

    offload = {"params": params_tier}
    if params_tier == "nvme":
        offload.update(nvme_paths=[nvme], pinned_pool_bytes=4 << 20)
        os.makedirs(nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({"offload": offload})
    torch.manual_seed(100 + rank)  # the weights come from the files: the seed must not matter
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    state = engine.full_state_dict()
    model.train()
    losses = [lm_step_global(engine, x, rank, world) for x in _batches()]
    engine.close()
    return {"state": state, "losses": losses}


def _check(got: dict, ref: tuple[dict[str, torch.Tensor], list[float]], world: int, what: str) -> None:
    ref_state, ref_losses = ref
    assert set(got["state"]) == set(ref_state), f"{what}: keys differ: {set(got['state']) ^ set(ref_state)}"
    for k, v in ref_state.items():
        assert torch.equal(got["state"][k], v), f"{what}: {k} differs from plain from_pretrained"
    r = torch.tensor(ref_losses, dtype=torch.float64)
    z = torch.tensor(got["losses"], dtype=torch.float64)
    rel = ((z - r).abs() / r.abs()).max().item()
    bound = 1e-6 if world == 1 else 1e-5
    assert rel < bound, f"{what}: losses {got['losses']} vs plain PyTorch {ref_losses} (max rel {rel:.2e})"


def _train_all(rank: int, world: int, runs: list[tuple[str, str, str]]) -> list[dict]:
    """Every (checkpoint, tier, nvme dir) in one process group: one spawn for all of them."""
    return [_train(rank, world, path, tier, nvme) for path, tier, nvme in runs]


@pytest.mark.parametrize("world", [1, 2])
def test_from_pretrained_under_init_equals_plain(world: int, checkpoints, tmp_path) -> None:
    tiers = ("device", "nvme") if world == 1 else ("device", "cpu", "nvme")
    runs = [(name, str(path), tier) for name, path in checkpoints.items() for tier in tiers]
    got = run_distributed(_train_all, world, [(path, tier, str(tmp_path / f"nvme_{name}_{tier}"))
                                              for name, path, tier in runs])[0]
    refs = {name: _reference(path) for name, path in checkpoints.items()}
    for (name, _, tier), result in zip(runs, got):
        _check(result, refs[name], world, f"{name} head, params on {tier}, {world} rank(s)")


def _read_share(rank: int, world: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    with zinf.Init(zinf.ZeroConfig()):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    report = zinf.load_pretrained(model, path)  # again, directly, to read its report
    return {"read": report.bytes_read, "files": report.file_bytes, "missing": report.missing_keys}


def test_each_rank_reads_only_its_slices(checkpoints) -> None:
    results = run_distributed(_read_share, 2, str(checkpoints["untied"]))
    for r in results:
        assert not r["missing"]
        # its half of every tensor, plus at most one row more at each end of a slice
        assert 0.45 * r["files"] < r["read"] < 0.62 * r["files"], (r["read"], r["files"])


def _seeded(rank: int, world: int, reinit: bool) -> dict:
    from models import build

    config = zinf.ZeroConfig()
    torch.manual_seed(1000 * rank)  # what many scripts do: seed + rank
    with zinf.Init(config):
        model = build("gpt")
        if reinit:
            for m in model.modules():  # a parent initialising its children after they were partitioned
                if isinstance(m, torch.nn.Linear):
                    torch.nn.init.normal_(m.weight, std=0.05)
    engine = zinf.initialize(model, None, config)
    return engine.full_state_dict()


@pytest.mark.parametrize("reinit", [False, True])
def test_ranks_seeded_differently_train_rank0s_model(reinit: bool) -> None:
    from models import build

    torch.manual_seed(0)  # rank 0's seed
    ref = build("gpt")
    if reinit:
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.05)
    got = run_distributed(_seeded, 2, reinit)[0]
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), f"{k}: not rank 0's initial values"
