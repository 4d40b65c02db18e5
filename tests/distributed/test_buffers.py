"""Module buffers follow DDP (``broadcast_buffers=True``, its default): after training, eval on every rank gives
DDP's output on that rank, with rank 0's BatchNorm statistics; ``broadcast_buffers=False`` keeps each rank's own.

One spawn of 2 gloo ranks runs every case: the same ResNet-style BatchNorm CNN trained by DDP (the reference, in
the same process) and by zinf (fp32, in memory; and with parameters and optimizer offloaded to the CPU), each rank
on its own slice of every batch. See [Note: buffers like DDP] in zinf/schedule/buffers.py.

``torch.nn.SyncBatchNorm`` cannot train here: in training mode under a process group torch 2.13 refuses CPU inputs
("SyncBatchNorm expected input tensor to be on GPU ..."; its kernels such as ``batch_norm_stats`` have no CPU
implementation), and DDP refuses a CPU module holding one ("SyncBatchNorm layers only work with GPU modules").
What runs here is tested: in eval mode it is plain batch norm on rank 0's statistics under zinf, its training
error reaches the caller unchanged and leaves the engine usable, and what it does on a GPU, a collective of its
own inside the forward and the backward, is done by a stand-in (``CrossRankBatchNorm``) that trains under zinf
exactly as under DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zinf
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3
BATCH = 8  # global; each rank trains on its half
# as tests/distributed/test_parity.py for fp32 on several ranks: only the rounding of the cross-rank average
# differs from the reference, so losses (and eval outputs, compared by the norm of the difference) within 1e-5
TOLERANCE = 1e-5
CASES = {
    "in_memory": {},
    "offload_cpu": {"offload": {"params": "cpu", "optimizer": "cpu", "sub_group_numel": 4096,
                                "pinned_pool_bytes": 4 << 20}},
    "per_rank": {"broadcast_buffers": False},
}


class ResNetish(nn.Module):
    """conv-BN-ReLU, one residual block (two conv-BN with a skip), global average pool, linear."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(h + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, in forward and (of the gradient) in backward: SyncBatchNorm's communication pattern."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CrossRankBatchNorm(nn.BatchNorm2d):
    """Training-mode batch statistics over every rank's batch (as SyncBatchNorm computes them on a GPU), from
    collectives issued inside the forward and the backward; eval mode is plain batch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        c, n = x.size(1), x.numel() // x.size(1) * dist.get_world_size()
        sums = _AllReduceSum.apply(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))]))
        mean, var = sums[:c] / n, sums[c:] / n - (sums[:c] / n) ** 2
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, c, 1, 1)
        return (x - mean.view(shape)) / (var.view(shape) + self.eps).sqrt() * self.weight.view(shape) + self.bias.view(shape)


def _replace_batchnorm(module: nn.Module, make: type) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, make(child.num_features))
        else:
            _replace_batchnorm(child, make)
    return module


def _data(rank: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """This rank's half of every training batch (ranks see different data: their statistics differ) and one
    eval batch, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    train = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 3, 8, 8, generator=g) * 2 + 1  # far from BatchNorm's initial mean 0, var 1
        y = torch.randint(0, 5, (BATCH,), generator=g)
        train.append((x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]))
    return train, torch.randn(6, 3, 8, 8, generator=g) * 2 + 1


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def _ddp(model: nn.Module, data: list, x_eval: torch.Tensor) -> dict:
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-2)
    losses = []
    for x, y in data:
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = _buffers(model)
    ddp.eval()
    with torch.no_grad():
        out = ddp(x_eval)  # syncs rank 0's buffers first: the last forward had grad enabled
        again = ddp(x_eval)  # does not sync (the last forward was no_grad); an eval forward changes no buffer
    return {"losses": losses, "trained": trained, "eval": out, "again": again, "buffers": _buffers(model)}


def _zinf(model: nn.Module, data: list, x_eval: torch.Tensor, config: dict) -> dict:
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-2), config)
    losses, syncs = [], []
    for x, y in data:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        syncs.append(engine.report().counts.get("broadcast_buffers", 0))
    trained = _buffers(model)
    model.eval()
    with torch.no_grad():
        out = model(x_eval)  # straight through the module, not engine.forward: the root's hooks sync all the same
        again = engine(x_eval)
    result = {"losses": losses, "trained": trained, "eval": out, "again": again, "buffers": _buffers(model),
              "state": engine.full_state_dict(), "state_all_ranks": engine.full_state_dict(rank0_only=False)}
    model.train()
    loss = F.cross_entropy(engine(data[0][0]), data[0][1])  # after a no_grad forward: no sync
    engine.backward(loss)
    engine.step()
    report = engine.report()
    # broadcasts per step: every training step's forward (the first by DDP's initial flag, the others after a
    # grad-enabled forward), then the two eval forwards and the training forward after them: the first eval only
    result["syncs"] = syncs + [report.counts.get("broadcast_buffers", 0)]
    result["summary"] = report.summary()
    engine.close()
    return result


def _sync_batchnorm(rank: int, data: list, x_eval: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(ResNetish())
    out: dict = {}
    try:
        DistributedDataParallel(copy.deepcopy(model))
    except ValueError as exc:
        out["ddp_error"] = str(exc)
    reference = copy.deepcopy(model).eval()
    for b in model.buffers():
        b.add_(rank)  # each rank's own statistics; the engine starts every rank from rank 0's, as DDP would
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-2))
    out["buffers"] = _buffers(model)
    out["reference_buffers"] = _buffers(reference)
    model.eval()
    with torch.no_grad():
        out["eval"], out["reference_eval"] = engine(x_eval), reference(x_eval)
    model.train()
    try:
        engine(data[0][0])
    except ValueError as exc:
        out["train_error"] = str(exc)
    model.eval()
    with torch.no_grad():
        out["eval_after_error"] = engine(x_eval)
    engine.close()
    return out


def _worker(rank: int, world: int) -> dict:
    data, x_eval = _data(rank)
    torch.manual_seed(0)
    model = ResNetish()
    init = copy.deepcopy(model)  # before anything trains: the same weights and buffers for every run
    out = {"ddp": _ddp(copy.deepcopy(init), data, x_eval)}
    for name, config in CASES.items():
        out[name] = _zinf(copy.deepcopy(init), data, x_eval, config)
    cross = _replace_batchnorm(copy.deepcopy(init), CrossRankBatchNorm)
    out["cross_rank"] = {"ddp": _ddp(copy.deepcopy(cross), data, x_eval), "zinf": _zinf(cross, data, x_eval, {})}
    out["sync_batchnorm"] = _sync_batchnorm(rank, data, x_eval)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, WORLD)


@pytest.mark.parametrize("case", ["in_memory", "offload_cpu"])
def test_eval_matches_ddp_on_every_rank(ranks: list[dict], case: str) -> None:
    rank0_ddp = ranks[0]["ddp"]["buffers"]
    for rank, got in enumerate(ranks):
        ddp, z = got["ddp"], got[case]
        rel = max(abs(a - b) / abs(b) for a, b in zip(z["losses"], ddp["losses"]))
        assert rel < TOLERANCE, f"{case}, rank {rank}: training losses {rel:.2e} from DDP's"
        # trained with its own batch, each rank's statistics are its own (DDP's too), until the next forward
        for n, b in z["trained"].items():
            assert torch.allclose(b.double(), ddp["trained"][n].double(), rtol=TOLERANCE), f"{case}: {n} trained"
        # eval: the same output as DDP's on this rank, and the buffers are rank 0's
        for key in ("eval", "again"):
            diff = _close(z[key], ddp[key])
            assert diff < TOLERANCE, f"{case}, rank {rank}: {key} output {diff:.2e} from DDP's"
        for n, b in z["buffers"].items():
            assert torch.allclose(b.double(), rank0_ddp[n].double(), rtol=TOLERANCE), f"{case}, rank {rank}: {n}"
            assert torch.equal(b, ranks[0][case]["buffers"][n]), f"{case}, rank {rank}: {n} is not rank 0's"
        assert torch.equal(z["eval"], ranks[0][case]["eval"]), f"{case}, rank {rank}: eval differs from rank 0's"
        assert z["syncs"] == [1] * STEPS + [1] and "broadcast_buffers" in z["summary"], (z["syncs"], z["summary"])
        # every rank's full state dict holds rank 0's buffers
        for n, b in ranks[0][case]["buffers"].items():
            assert torch.equal(z["state_all_ranks"][n], b), f"{case}, rank {rank}: full_state_dict {n}"
    assert ranks[1][case]["state"] == {}
    for n, b in ranks[0][case]["buffers"].items():
        assert torch.equal(ranks[0][case]["state"][n], b)
    # the ranks trained on different data: without the broadcast they would disagree
    assert not torch.equal(ranks[0]["ddp"]["trained"]["bn1.running_mean"], ranks[1]["ddp"]["trained"]["bn1.running_mean"])


def test_broadcast_buffers_false_keeps_each_ranks_own(ranks: list[dict]) -> None:
    r0, r1 = ranks[0]["per_rank"], ranks[1]["per_rank"]
    for got in (r0, r1):
        for n, b in got["buffers"].items():
            assert torch.equal(b, got["trained"][n]), f"{n} changed without a broadcast"
        assert got["syncs"] == [0] * (STEPS + 1) and "broadcast_buffers" not in got["summary"]
    assert not torch.equal(r0["buffers"]["bn1.running_var"], r1["buffers"]["bn1.running_var"])
    assert _close(r1["eval"], r0["eval"]) > 1e-3, "ranks' eval outputs should differ with per-rank statistics"
    assert not torch.equal(r1["state_all_ranks"]["bn1.running_var"], r0["state"]["bn1.running_var"])


def test_sync_batchnorm_what_runs_on_cpu(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        sbn = got["sync_batchnorm"]
        assert "only work with GPU modules" in sbn["ddp_error"]  # DDP refuses it on CPU: no DDP reference here
        # training mode: torch's own error, unchanged; the engine unwound the pass and goes on
        assert "SyncBatchNorm expected input tensor to be on GPU" in sbn["train_error"], sbn.get("train_error")
        # eval mode: plain batch norm, on rank 0's statistics (broadcast when the engine was built)
        for n, b in sbn["buffers"].items():
            assert torch.equal(b, sbn["reference_buffers"][n]), f"rank {rank}: {n} is not rank 0's"
        assert _close(sbn["eval"], sbn["reference_eval"]) < TOLERANCE
        assert torch.equal(sbn["eval_after_error"], sbn["eval"])
        assert torch.equal(sbn["eval"], ranks[0]["sync_batchnorm"]["eval"])


def test_collectives_inside_forward_and_backward_train_as_under_ddp(ranks: list[dict]) -> None:
    """SyncBatchNorm's pattern on a GPU (its own all-reduce in forward and backward) under zinf, on CPU."""
    for rank, got in enumerate(ranks):
        ddp, z = got["cross_rank"]["ddp"], got["cross_rank"]["zinf"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(z["losses"], ddp["losses"]))
        assert rel < TOLERANCE, f"rank {rank}: losses {rel:.2e} from DDP's"
        for n, b in z["buffers"].items():  # statistics of the global batch: the same on every rank, as DDP's
            assert torch.allclose(b.double(), ddp["buffers"][n].double(), rtol=TOLERANCE), f"rank {rank}: {n}"
        assert _close(z["eval"], ddp["eval"]) < TOLERANCE
