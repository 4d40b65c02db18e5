"""zinf/offload/subgroups.py: a group of 2**k elements (an embedding here) is cut so that its fp32 records stage in
pool blocks of their own size, not twice it (the records' trailers would push a whole group past the power of
two); other groups are cut at ``sub_group_numel`` alone. The cut trains the same as plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn

import zinf
from zinf.offload.pool_room import block_bytes
from zinf.offload.subgroups import ALIGN_NUMEL
from zinf.offload.swap import record_span


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1024, 256)  # 2**18 elements
        self.head = nn.Linear(256, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _steps(model: nn.Module, engine_of=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model if engine_of is None else engine_of(model, opt)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 1024, (8, 5), generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(run(ids), y)
        (run.backward(loss) if engine_of else loss.backward())
        (run.step() if engine_of else (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
    if engine_of:
        run.close()
    return losses


def test_a_power_of_two_group_stages_each_state_in_a_block_of_its_own_size() -> None:
    torch.manual_seed(0)
    reference = Tagger()
    model = Tagger()
    model.load_state_dict(reference.state_dict())
    config = zinf.ZeroConfig.from_dict({"offload": {"optimizer": "cpu", "sub_group_numel": 1 << 20}})
    seen = {}

    def engine_of(m, opt):
        engine = zinf.initialize(m, opt, config)
        seen["cuts"] = [(sg.group.name, sg.numel) for sg in engine.placement.subgroups]
        return engine

    losses = _steps(model, engine_of)
    emb = [n for name, n in seen["cuts"] if "emb" in name]
    assert emb == [(1 << 18) - ALIGN_NUMEL, ALIGN_NUMEL], seen["cuts"]
    assert sum(block_bytes(record_span(n * 4)) for n in emb) < block_bytes(record_span((1 << 18) * 4)), emb
    assert block_bytes(record_span(emb[0] * 4)) == (1 << 18) * 4
    assert len([n for name, n in seen["cuts"] if "head" in name]) == 1, seen["cuts"]  # no power of two: not cut
    torch.testing.assert_close(losses, _steps(reference), rtol=1e-5, atol=0)
