"""The CPU-Adam pass checks the NVMe state records it steps ([Note: checks in the Adam pass] in
zinf/offload/record_check.py): the same numbers bit for bit as the sweep with checksums in passes of their own and
as the states in memory, with frozen and unused parameters (ranges nothing steps), gradients on NVMe and in memory,
fp32 and bf16 moments; a corrupted gradient record is refused too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.offload.record_check import RecordCheck
from zinf.offload.swap import OffloadFileError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.b.bias.requires_grad_(False)  # frozen inside a trained group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _losses(tmp: Path | None, grads: str, moments: str, checksums: bool = True,
            counts: dict[str, int] | None = None) -> list[float]:
    torch.manual_seed(0)
    offload = {"optimizer": "nvme", "grads": grads, "nvme_paths": [str(tmp)], "sub_group_numel": 4096,
               "pinned_pool_bytes": 8 << 20} if tmp is not None else {"optimizer": "cpu", "sub_group_numel": 4096}
    config = zinf.ZeroConfig.from_dict({"offload": offload, "optimizer_storage": moments})
    with zinf.Init(config):
        model = _Net()
    engine = zinf.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                             config)
    if tmp is not None:
        engine.placement.swap.checksums = checksums
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(4):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.synchronize()
    finally:
        engine.close()
    return losses


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
@pytest.mark.parametrize("grads", ["nvme", "cpu"])
def test_checked_in_pass_steps_as_the_other_ways(tmp_path: Path, grads: str, moments: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"in_pass": 0, "now": 0}
    for name, key in (("check_in_pass", "in_pass"), ("check_now", "now")):
        orig = getattr(RecordCheck, name)

        def counted(self, *args, _orig=orig, _key=key):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _orig(self, *args)
        monkeypatch.setattr(RecordCheck, name, counted)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    checked = _losses(tmp_path / "a", grads, moments)
    assert calls["in_pass"] > 0 and calls["now"] == 0, calls
    apart = _losses(tmp_path / "b", grads, moments, checksums=False)
    assert checked == apart
    assert checked == _losses(None, grads, moments)  # the states in host memory


@pytest.mark.parametrize("where", ["record", "held"])
def test_a_corrupted_gradient_is_refused(where: str, tmp_path: Path) -> None:
    """In its record (held gradients written out to make pool room: the step reads them back), or held in its pool
    buffer for the step ([Note: gradients held for the step] in zinf/offload/grad_stash.py)."""
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {"optimizer": "nvme", "grads": "nvme", "nvme_paths": [str(tmp_path)],
                                                    "sub_group_numel": 4096, "pinned_pool_bytes": 8 << 20}})
    with zinf.Init(config):
        model = _Net()
    engine = zinf.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                             config)
    stash = engine.placement.optimizer.stash
    try:
        engine.backward(engine(torch.randn(8, 32)).square().mean())
        stash.flush()
        first = engine.placement.optimizer.states.subgroups[0]
        assert stash.holds(first)  # the sweep's first gradients stay in the pool
        if where == "record":
            while stash._write_one_held():  # as a thread short of pool room has them written
                pass
            assert not stash.holds(first)
            rec = stash.record(first)
            with open(rec.path, "r+b") as f:
                f.seek(rec.offset + 8)
                byte = f.read(1)
                f.seek(rec.offset + 8)
                f.write(bytes([byte[0] ^ 0x10]))
        else:
            stash._held[id(first)][8] ^= 0x10
        with pytest.raises(OffloadFileError, match="is corrupted"):
            engine.step()
            engine.synchronize()
    finally:
        engine.close()
