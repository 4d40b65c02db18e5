"""[Note: 8-bit shards] in zinf/param/eight_bit.py against bitsandbytes on the CPU: the codes and row scales of
``Int8Params`` (what ``load_in_8bit`` stores), and the weight ``MatMul8bitFp`` decodes for training, fp32 and bf16,
cut into ranks' shards of whole rows."""

from __future__ import annotations

import pytest
import torch

from zinf.param.eight_bit import EightBitFormat
from zinf.param.layout import FlatLayout

bnb = pytest.importorskip("bitsandbytes")


def _weight(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(rows * cols)
    w = torch.randn(rows, cols) * torch.logspace(-3, 1, rows).unsqueeze(1)  # rows of very different ranges
    w[1].zero_()  # a row of zeros: a zero scale
    return w


def _bitsandbytes(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' codes and scales as ``load_in_8bit`` stores them, and the weight its training path decodes."""
    p = bnb.nn.Int8Params(w.clone(), requires_grad=False).to("cpu")
    decoded = p.CB.to(dtype).mul_(p.SCB.unsqueeze(1).mul(1.0 / 127.0))  # MatMul8bitFp.forward
    return p.CB, p.SCB, decoded


@pytest.mark.parametrize("rows,cols,world", [(20, 40, 1), (20, 40, 2), (7, 13, 2), (9, 24, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_decode_to_the_weight_bitsandbytes_trains_with(rows: int, cols: int, world: int,
                                                              dtype: torch.dtype) -> None:
    w = _weight(rows, cols)
    codes, scales, expected = _bitsandbytes(w, dtype)
    fmt = EightBitFormat().for_weight(w)
    shards = []
    for rank in range(world):
        layout = FlatLayout.of(["w"], [w], rank, world, align=fmt.align)
        assert layout.shard_numel % cols == 0  # whole rows on every rank
        shards.append(fmt.encode(layout.slots, [w], layout.lo, layout.shard_numel))
    n = layout.shard_numel
    gathered = torch.cat(shards)
    assert gathered.numel() == world * (n + n // cols * 4)
    # each rank's rows hold bitsandbytes' codes and scales; the padding rows zeros
    mine = torch.cat([s[:n].view(torch.int8) for s in shards])[: rows * cols].view(rows, cols)
    assert torch.equal(mine, codes)
    scale_bytes = torch.cat([s[n:] for s in shards]).clone().view(torch.float32)
    assert torch.equal(scale_bytes[:rows], scales) and not scale_bytes[rows:].any()
    out = torch.empty(world * n, dtype=dtype)
    fmt.widen(gathered, world, n, out)
    assert torch.equal(out[: rows * cols].view(rows, cols), expected)
    assert not out[rows * cols :].any()
    first = min(n, rows * cols)  # one rank's shard decoded to fp32 (checkpoints, exports)
    assert torch.equal(fmt.values(shards[0], n)[:first], _bitsandbytes(w, torch.float32)[2].reshape(-1)[:first])


def test_a_format_needs_a_linear_weight() -> None:
    from zinf.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="2-D linear weights"):
        EightBitFormat().for_weight(torch.zeros(3, 4, 5))
