"""Plain PyTorch on one GPU, the runs the GPU tests compare zinf with.

``plain_losses(kind, steps, "fp32")`` trains the model as it is; ``"bf16"`` follows zinf's 16-bit contract: fp32
masters stepped by torch's AdamW, the forward and backward on a copy rounded to bf16, the bf16 gradients widened to
fp32 (and clipped there, with ``clip``) for the step. Both start from the model built on the CPU after
``torch.manual_seed(0)``, as under ``zinf.Init``.
"""

from __future__ import annotations

import copy

import torch

from models import batches, build, make_optimizer


def plain_losses(kind: str, steps: int, precision: str = "fp32", clip: float | None = None) -> list[float]:
    torch.manual_seed(0)
    master = build(kind).cuda()
    opt = make_optimizer(master)
    compute = master if precision == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
    pairs = [] if compute is master else list(zip(master.parameters(), compute.parameters()))
    out = []
    for x, y in batches(kind, steps, 8):
        with torch.no_grad():
            for p, w in pairs:
                w.copy_(p)  # rounded to bf16
        loss = compute(x.cuda(), y.cuda())
        loss.backward()
        if pairs:
            for p, w in pairs:
                p.grad = None if w.grad is None else w.grad.float()
            compute.zero_grad(set_to_none=True)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        out.append(loss.float().item())
    return out


def max_relative(ref: list[float], got: list[float]) -> float:
    assert len(ref) == len(got), f"{len(got)} losses against {len(ref)}"
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


def bf16_bound(fp32: list[float], bf16: list[float]) -> float:
    """How far zinf's bf16 run may drift from the fp32 losses: bf16's tolerance (5e-3 relative loss, as on the CPU),
    or 1.25x the drift of plain PyTorch's own bf16 run (``bf16``) where that is larger: longer runs drift further
    on some GPU kernels, for plain PyTorch as for zinf."""
    return max(5e-3, 1.25 * max_relative(fp32, bf16))
