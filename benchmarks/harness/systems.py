"""The training systems compared, each set up in one rank of a run: plain PyTorch, DDP, FSDP2 (with and without
CPUOffloadPolicy), DeepSpeed ZeRO-3 (CPU / NVMe offload) and zinf in each placement.

Every system trains the same model from seed 0 with AdamW(lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay
0.01) on its rank's rows of the same global batch, in fp32 or in bf16 (``Context.precision``). bf16 is each system's
own mixed precision, all with fp32 master weights and optimizer states: plain PyTorch and DDP under
``torch.autocast``, FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, zinf with
``precision="bf16"``, DeepSpeed with its ``bf16`` section. DeepSpeed takes its optimizer from its config (its
CPU Adam when offloaded: it refuses a client optimizer with ZeRO-Offload) and builds the model under
``deepspeed.zero.Init``, as zinf builds it under ``zinf.Init``; the others build it whole on every rank.

``ZINF_BENCH_EXTRA`` (environment): a JSON object merged into every zinf system's config (its ``offload`` section
into the system's placement), to compare settings with the same harness."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where a run is set up, so that listing the systems stays light
    import torch

    from harness import models

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # "plain", "torch" (DDP / FSDP2), "deepspeed", "zinf"
    nvme: bool = False


SYSTEMS: dict[str, System] = {
    "plain": System("plain PyTorch (1 process)", "plain"),
    "ddp": System("DDP", "torch"),
    "fsdp2": System("FSDP2", "torch"),
    "fsdp2-offload": System("FSDP2 + CPUOffloadPolicy", "torch"),
    "fsdp2-keep": System("FSDP2, reshard_after_forward=False", "torch"),
    "ds-cpu": System("DeepSpeed ZeRO-3, params+optimizer on CPU", "deepspeed"),
    "ds-nvme": System("DeepSpeed ZeRO-3, params+optimizer on NVMe", "deepspeed", nvme=True),
    "zinf-mem": System("zinf in memory", "zinf"),
    "zinf-optcpu": System("zinf, optimizer on CPU", "zinf"),
    "zinf-optcpu-early": System("zinf, optimizer on CPU, stepped during the backward", "zinf"),
    "zinf-optcpu-share": System("zinf, optimizer on CPU, three quarters of it on the device", "zinf"),
    "zinf-cpu": System("zinf, params+optimizer on CPU", "zinf"),
    "zinf-nvme": System("zinf, params+optimizer on NVMe", "zinf", nvme=True),
    "zinf-nvme-gradcpu": System("zinf, params+optimizer on NVMe, gradients on the host", "zinf", nvme=True),
}

ZINF_OFFLOAD = {"zinf-mem": {}, "zinf-optcpu": {"optimizer": "cpu"},
                "zinf-optcpu-early": {"optimizer": "cpu", "step_during_backward": True},
                "zinf-optcpu-share": {"optimizer": "cpu", "optimizer_device_fraction": 0.75}, "zinf-cpu": {"params": "cpu", "optimizer": "cpu"},
                "zinf-nvme": {"params": "nvme", "optimizer": "nvme", "grads": "nvme"},
                "zinf-nvme-gradcpu": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}}


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    global_batch: int
    nvme_dir: str
    precision: str = "fp32"  # or "bf16" (the module docstring says what each system does with it)
    build_on_cpu: bool = False  # plain, DDP, FSDP2: build on the CPU then move, drawing the initial weights from
    # the CPU generator as zinf.Init does (zinf/init.py, [Note: edits draw where plain PyTorch would]); needed where
    # losses are compared with zinf's, not for speed


PRECISIONS = ("fp32", "bf16")


class Run:
    """One system, set up: ``train_step(idx, tgt)`` runs forward, backward and the optimizer step and returns the
    loss; ``breakdown()`` is zinf's StepReport of that step as flat metrics (None for the others)."""

    def __init__(self, model: torch.nn.Module, call: Callable, backward: Callable, step: Callable, spec: models.ModelSpec,
                 breakdown: Callable[[], dict | None] = lambda: None, finish: Callable[[], None] = lambda: None,
                 close: Callable[[], None] = lambda: None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        from harness import models

        self.model, self.call, self._backward, self._step = model, call, backward, step
        self.loss = models.loss_fn(spec)
        self.breakdown, self.finish, self.close, self.autocast = breakdown, finish, close, autocast

    def train_step(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = self.loss(self.call, idx, tgt)
        self._backward(loss)
        self._step()
        return loss


def setup(name: str, spec: models.ModelSpec, ctx: Context) -> Run:
    import torch

    from harness import models

    kind = SYSTEMS[name].kind
    if ctx.precision not in PRECISIONS:
        raise SystemExit(f"precision '{ctx.precision}': the benchmarks compare {' or '.join(PRECISIONS)}")
    if kind == "zinf":
        return _zinf(name, spec, ctx)
    if kind == "deepspeed":
        return _deepspeed(name, spec, ctx)
    torch.manual_seed(0)
    with torch.device("cpu") if ctx.build_on_cpu else ctx.device:
        model = models.build(spec)
    model.to(ctx.device)
    bf16 = ctx.precision == "bf16"
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        call = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    elif name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw: dict = {"mesh": init_device_mesh(ctx.device.type, (ctx.world,))}
        if bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if name == "fsdp2-offload":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
        if name == "fsdp2-keep":  # every block stays gathered from its forward to its backward
            kw["reshard_after_forward"] = False
        for block in models.blocks(model, spec):
            fully_shard(block, **kw)
        call = fully_shard(model, **kw)
    else:
        call = model
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    autocast = contextlib.nullcontext
    if bf16 and not name.startswith("fsdp2"):
        autocast = lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)  # noqa: E731
    return Run(model, call, lambda loss: loss.backward(), step, spec, autocast=autocast)


def _nvme_pool_bytes(spec: models.ModelSpec) -> int:
    """A pool that holds what zinf's NVMe placement never waits for (its check in zinf/placement.py): the
    optimizer pipeline of 3 sub-groups x 4 buffers (3 states and the gradient) of the default 32 Mi-element
    sub-groups, and the largest shard (the embedding) four times, each in a power-of-two block; plus one more
    largest block for read-ahead, and at least zinf's default 256 MiB."""
    def block(nbytes: int) -> int:
        return 1 << max(nbytes - 1, 1).bit_length()
    sub_group = block(min(32 << 20, spec.vocab * spec.n_embd) * 4)
    largest = block(spec.vocab * spec.n_embd * 4 + 4096)
    return max(256 << 20, 12 * sub_group + 5 * largest)


def _zinf(name: str, spec: models.ModelSpec, ctx: Context) -> Run:
    import torch
    import zinf

    from harness import models

    offload = dict(ZINF_OFFLOAD[name])
    if SYSTEMS[name].nvme:
        offload["nvme_paths"] = [ctx.nvme_dir]
        offload["pinned_pool_bytes"] = _nvme_pool_bytes(spec)
    extra = json.loads(os.environ.get("ZINF_BENCH_EXTRA", "{}"))
    config = zinf.ZeroConfig.from_dict({"precision": ctx.precision, **extra,
                                        "offload": {**offload, **extra.get("offload", {})}})
    torch.manual_seed(0)
    with zinf.Init(config, device=ctx.device):  # the device named: with gloo, zinf would otherwise compute on the CPU
        model = models.build(spec)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine = zinf.initialize(model, opt, config, device=ctx.device)

    def breakdown() -> dict | None:
        report = engine.report()
        return None if report is None else report.metrics()

    return Run(model, engine, engine.backward, engine.step, spec, breakdown=breakdown, finish=engine.synchronize,
               close=engine.close)


def _deepspeed(name: str, spec: models.ModelSpec, ctx: Context) -> Run:
    import deepspeed
    import torch

    from harness import models

    tier = {"device": "nvme", "nvme_path": ctx.nvme_dir} if SYSTEMS[name].nvme else {"device": "cpu"}
    tier["pin_memory"] = ctx.device.type == "cuda"
    config = {"train_micro_batch_size_per_gpu": ctx.global_batch // ctx.world, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
              "zero_optimization": {"stage": 3, "offload_param": dict(tier), "offload_optimizer": dict(tier)},
              "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
              "bf16": {"enabled": ctx.precision == "bf16"}}
    models.import_model_code(spec)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = models.build(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return Run(model, engine, engine.backward, engine.step, spec)
