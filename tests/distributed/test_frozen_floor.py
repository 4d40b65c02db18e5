"""Frozen parameters at their floor (see [Note: frozen groups] in zinf/param/master.py), on 1 and 2 gloo ranks.

The model: a frozen base (an embedding and linear layers) with trainable LoRA-like adapters and a head in
modules of their own, and one mixed module (a LayerNorm whose weight is frozen and bias trains), which keeps
its fp32 master as a trainable group does.

(a) Bytes. Two engines that differ only in the size of the frozen embedding (its vocabulary) differ, per tier
    and kind of the engine's own accounting (``resident_bytes``), by the storage width per frozen parameter in
    ``param_shards`` (2 in bf16, 4 in fp32; on NVMe the records' 4 KiB alignment) and by nothing else: no
    master, gradient or optimizer bytes, no swap-file bytes but the parameter record, no more NVMe bytes
    written by the steps (the optimizer pass neither reads nor writes a frozen group). Before frozen groups dropped their
    master it was 6 bytes in bf16 with a device optimizer, 14 with the CPU-Adam (states and shard rewritten
    every step).
(b) Losses over a few steps equal plain single-process PyTorch with the same frozen setup: fp32 within 1e-6
    relative on 1 rank and 1e-5 on 2; bf16 against PyTorch following the 16-bit contract (fp32 masters, a
    bf16 compute copy) within eps/32. Frozen weights bit-unchanged (their values at their storage width).
(c) A checkpoint saved mid-run and loaded into a fresh engine (built from other random values) resumes
    exactly; ``full_state_dict``, ``zinf consolidate`` and the safetensors export hold the frozen weights
    exactly; an edit of a frozen weight under ``GatheredParameters(modifier_rank=0)`` and a
    ``load_full_state_dict`` reach the shard on every tier.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zinf
from dist_utils import run_distributed
from zinf.offload.swap import TRAILER_BYTES, align_up

pytestmark = pytest.mark.distributed

TIERS = ("device", "cpu", "nvme")
PRECISIONS = ("bf16", "fp32")
WIDTH = {"bf16": 2, "fp32": 4}
VOCAB, MORE_VOCAB = 64, 192  # the frozen embedding of the two engines compared in (a); tokens stay below 64
STEPS, SAVE_AT = 5, 2
LR = 1e-2
BF16_RTOL = torch.finfo(torch.bfloat16).eps / 32  # as tests/distributed/test_step_baselines.py


class LoRA(nn.Module):
    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class Adapted(nn.Module):
    """A frozen base with trainable adapters, each adapter and the head a module (a flat group) of its own."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, depth: int = 3, rank: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.adapters = nn.ModuleList(LoRA(width, rank) for _ in range(depth))
        self.norm = nn.LayerNorm(width)  # mixed: frozen weight, trainable bias
        self.head = nn.Linear(width, classes)

    def freeze_base(self) -> None:
        for p in itertools.chain(self.embed.parameters(), self.layers.parameters(), [self.norm.weight]):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer, adapter in zip(self.layers, self.adapters):
            h = torch.tanh(layer(h) + adapter(h))
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


FROZEN = ("embed.", "layers.", "norm.weight")


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (8, 6), generator=g), torch.randint(0, 8, (8, 6), generator=g))
            for _ in range(steps)]


def _optimizer(model: nn.Module, frozen_in_optimizer: bool) -> torch.optim.Optimizer:
    """AdamW over every parameter (frozen ones too, as many scripts do) or over the trainable ones (as PEFT)."""
    params = [p for p in model.parameters() if frozen_in_optimizer or p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _config(precision: str, params: str, optimizer: str, nvme: str) -> zinf.ZeroConfig:
    return zinf.ZeroConfig.from_dict({"precision": precision, "offload": {
        "params": params, "optimizer": optimizer, "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20,
        "sub_group_numel": 4096}})


def _engine(config: zinf.ZeroConfig, seed: int = 0, vocab: int = VOCAB,
            frozen_in_optimizer: bool = True) -> tuple[zinf.ZeroInfinityEngine, Adapted]:
    torch.manual_seed(seed)
    with zinf.Init(config):
        model = Adapted(vocab)
    model.freeze_base()  # after construction, before the engine: the usual fine-tuning order
    return zinf.initialize(model, _optimizer(model, frozen_in_optimizer), config), model


def _step(engine: zinf.ZeroInfinityEngine, rank: int, world: int, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / world


# -- (a) bytes --------------------------------------------------------------------------------------------------
def _measure(rank: int, world: int, precision: str, params: str, optimizer: str, vocab: int, nvme: str) -> dict:
    engine, _ = _engine(_config(precision, params, optimizer, nvme), vocab=vocab)
    after_backward: dict[str, dict[str, int]] = {}
    written = 0  # NVMe bytes written by the steps: counted as each write is waited for, so summed to the end
    for x, y in _batches(3):
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        after_backward = engine.resident_bytes()
        engine.step()
        written += engine.report().counts.get("nvme_written_bytes", 0)
    engine.synchronize()
    written += engine.placement.io_counts().get("nvme_written_bytes", 0)
    swap = engine.placement.swap
    out = {"after_backward": after_backward, "after_step": engine.resident_bytes(), "written": written,
           "swap_bytes": sum(swap.bytes_per_path.values()) if swap is not None else 0,
           "frozen_shard_numel": sum(g.shard_numel for g in engine.groups if not g.trainable),
           "frozen_holding": [g.name for g in engine.groups if not g.trainable and (
               g.master is not None or g.grad.resident is not None)]}
    engine.close()
    dist.barrier()
    return out


# every placement on one rank; on two, those that put each store and each optimizer to work
PLACEMENTS = {1: list(itertools.product(TIERS, TIERS)),
              2: [("device", "device"), ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "device"), ("device", "nvme")]}


def _measure_all(rank: int, world: int, nvme: str) -> dict[tuple[str, str, str], tuple[dict, dict]]:
    return {(precision, params, optimizer): tuple(  # type: ignore[misc]
                _measure(rank, world, precision, params, optimizer, v, nvme) for v in (VOCAB, MORE_VOCAB))
            for precision in PRECISIONS for params, optimizer in PLACEMENTS[world]}


def _difference(small: dict[str, dict[str, int]], large: dict[str, dict[str, int]]) -> dict[tuple[str, str], int]:
    keys = {(t, k) for part in (small, large) for t, kinds in part.items() for k in kinds}
    diff = {(t, k): large.get(t, {}).get(k, 0) - small.get(t, {}).get(k, 0) for t, k in keys}
    return {key: d for key, d in diff.items() if d}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_frozen_parameters_cost_their_storage_width(world: int, tmp_path: Path) -> None:
    results = run_distributed(_measure_all, world, str(tmp_path))
    failures = []
    for rank, per_setup in enumerate(results):
        for (precision, params, optimizer), (small, large) in per_setup.items():
            name = f"rank {rank} {precision} params={params} optimizer={optimizer}"
            width = WIDTH[precision]
            more = large["frozen_shard_numel"] - small["frozen_shard_numel"]
            assert more == (MORE_VOCAB - VOCAB) * 32 // world, name
            tier = "nvme" if params == "nvme" else "cpu"  # without CUDA the device tier is host memory ("cpu")
            if params == "nvme":  # one 4 KiB-aligned record per group, its data and a trailer
                shard = lambda n: align_up(n * width + TRAILER_BYTES)  # noqa: E731
                expected = shard(MORE_VOCAB * 32 // world) - shard(VOCAB * 32 // world)
            else:
                expected = more * width
            for when in ("after_backward", "after_step"):
                diff = _difference(small[when], large[when])
                if diff != {(tier, "param_shards"): expected}:
                    failures.append(f"{name} {when}: the larger frozen embedding costs {diff}, expected only "
                                    f"{expected} param_shards bytes on {tier} ({width} per parameter)")
            if large["swap_bytes"] - small["swap_bytes"] != (expected if params == "nvme" else 0):
                failures.append(f"{name}: swap files grow by {large['swap_bytes'] - small['swap_bytes']}")
            if large["written"] != small["written"]:
                failures.append(f"{name}: NVMe bytes written by three steps {small['written']} -> "
                                f"{large['written']}: the steps write frozen groups")
            if large["frozen_holding"]:
                failures.append(f"{name}: frozen groups holding a master or gradient: {large['frozen_holding']}")
            if rank == 0 and params == optimizer:
                print(f"{world} rank(s) {precision} {params}/{optimizer}: "
                      f"{expected / more:.3f} bytes per frozen parameter (storage {width})")
    assert not failures, "\n".join(failures)


# -- (b) and (c): training, checkpoints, exports ---------------------------------------------------------------
SETUPS = [(precision, params, optimizer) for precision in PRECISIONS for params, optimizer in
          (("device", "device"), ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "device"))]


def _frozen(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(FROZEN)}


def _train(rank: int, world: int, precision: str, params: str, optimizer: str, tmp: Path) -> dict[str, Any]:
    (tmp / "nvme").mkdir(parents=True, exist_ok=True)
    config = _config(precision, params, optimizer, str(tmp / "nvme"))
    frozen_in_optimizer = params != "cpu"  # both ways of building the optimizer, across the setups
    engine, model = _engine(config, frozen_in_optimizer=frozen_in_optimizer)
    before = _frozen(engine.full_state_dict(rank0_only=False))
    ckpt = tmp / "ckpt"
    losses = []
    for i, (x, y) in enumerate(_batches(STEPS)):
        losses.append(_step(engine, rank, world, x, y))
        if i + 1 == SAVE_AT:
            engine.save_checkpoint(str(ckpt))
    state = engine.full_state_dict(rank0_only=False)
    zinf.checkpoint.save_safetensors(engine, tmp / "export")
    out: dict[str, Any] = {"losses": losses, "before": before, "state": state}
    if rank == 0:
        from safetensors.torch import load_file
        out["export"] = load_file(str(tmp / "export" / "model.safetensors"))
    engine.close()
    dist.barrier()

    # a fresh engine from other random values: the frozen weights come from the checkpoint too
    engine, model = _engine(config, seed=1, frozen_in_optimizer=frozen_in_optimizer)
    engine.load_checkpoint(str(ckpt))
    out["resumed"] = [_step(engine, rank, world, x, y) for x, y in _batches(STEPS)[SAVE_AT:]]
    if rank == 0:
        out["consolidated"] = zinf.checkpoint.consolidate(ckpt)
    # an edit of a frozen weight reaches its shard (on its tier), and so does a loaded state dict
    with zinf.GatheredParameters(model.layers[1].weight, modifier_rank=0):
        if rank == 0:
            model.layers[1].weight.add_(1.0)
    engine.synchronize()
    out["edited"] = engine.full_state_dict(rank0_only=False)["layers.1.weight"]
    loaded = engine.full_state_dict(rank0_only=False)
    loaded["embed.weight"] = loaded["embed.weight"] * 2
    engine.load_full_state_dict(loaded)
    engine.synchronize()
    out["loaded"] = engine.full_state_dict(rank0_only=False)["embed.weight"]
    out["frozen_groups"] = sum(not g.trainable for g in engine.groups)
    engine.close()
    dist.barrier()
    return out


def _train_all(rank: int, world: int, tmp: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for i, setup in enumerate(SETUPS):
        out[setup] = _train(rank, world, *setup, Path(tmp) / str(i))
    return out


def _reference(precision: str, world: int, frozen_in_optimizer: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch in one process: fp32 on the global batch; bf16 following zinf's 16-bit contract (fp32 master
    weights stepped by AdamW, each step computing with a bf16 copy; every rank's gradient summed in fp32)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers
    try:
        torch.manual_seed(0)
        master = Adapted()
        master.freeze_base()
        opt = _optimizer(master, frozen_in_optimizer)
        losses = []
        if precision == "fp32":
            for x, y in _batches(STEPS):
                loss = master(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, master.state_dict()
        compute = Adapted().to(torch.bfloat16)
        compute.freeze_base()
        params, work = list(master.parameters()), list(compute.parameters())
        for x, y in _batches(STEPS):
            with torch.no_grad():
                for w, p in zip(work, params):
                    w.copy_(p.to(torch.bfloat16))
            grads = [torch.zeros_like(p) for p in params]
            total = 0.0
            for xs, ys in zip(x.chunk(world), y.chunk(world)):
                loss = compute(xs, ys)
                loss.backward()
                total += loss.item()
                for g, w in zip(grads, work):
                    if w.grad is not None:
                        g.add_(w.grad.float())
                compute.zero_grad(set_to_none=True)
            losses.append(total / world)
            for p, g in zip(params, grads):
                p.grad = g.div_(world) if p.requires_grad else None
            opt.step()
            opt.zero_grad()
        return losses, {k: v.to(torch.bfloat16).float() for k, v in master.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["world1", "world2"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_distributed(_train_all, world, str(tmp_path_factory.mktemp(f"frozen{world}")))


def test_frozen_setup_matches_pytorch(trained: tuple[int, list[dict]]) -> None:
    world, results = trained
    failures = []
    for setup in SETUPS:
        precision, params, _ = setup
        ref_losses, ref_state = _reference(precision, world, frozen_in_optimizer=params != "cpu")
        got = results[0][setup]
        rel = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, got["losses"]))
        bound = BF16_RTOL if precision == "bf16" else 1e-6 if world == 1 else 1e-5
        print(f"{world} rank(s) {setup}: largest relative loss difference to PyTorch {rel:.2e} (bound {bound:.1e})")
        if not rel <= bound:
            failures.append(f"{setup}: losses {got['losses']} vs PyTorch {ref_losses} (max rel {rel:.2e})")
        assert got["frozen_groups"] == 4, got["frozen_groups"]  # the embedding and three layers; not the norm
        for rank, r in enumerate(results):
            for k, v in _frozen(ref_state).items():
                if not torch.equal(r[setup]["state"][k], v):
                    failures.append(f"{setup} rank {rank}: frozen weight {k} differs from PyTorch's")
                if not torch.equal(r[setup]["state"][k], r[setup]["before"][k]):
                    failures.append(f"{setup} rank {rank}: frozen weight {k} changed in training")
    assert not failures, "\n".join(failures)


def test_frozen_checkpoint_resumes_and_exports_exactly(trained: tuple[int, list[dict]]) -> None:
    world, results = trained
    for setup in SETUPS:
        for rank, per_setup in enumerate(results):
            got = per_setup[setup]
            assert got["resumed"] == got["losses"][SAVE_AT:], (setup, rank, got["resumed"], got["losses"])
            frozen = _frozen(got["state"])
            assert frozen["embed.weight"].dtype == torch.float32 and len(frozen) == 8, frozen.keys()
            before = got["before"]
            assert torch.equal(got["edited"], before["layers.1.weight"] + 1.0 if setup[0] == "fp32"
                               else (before["layers.1.weight"] + 1.0).to(torch.bfloat16).float()), (setup, rank)
            assert torch.equal(got["loaded"], before["embed.weight"] * 2), (setup, rank)  # exact: a power of two
        got = results[0][setup]
        consolidated, export = got["consolidated"], got["export"]
        for k, v in _frozen(got["state"]).items():
            assert torch.equal(export[k], v), (setup, k)
            assert torch.equal(consolidated[k], v), (setup, k)  # saved after step 2; frozen weights never change
