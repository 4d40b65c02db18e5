"""Frozen weights stored in 8 bits, as bitsandbytes' ``load_in_8bit`` stores them (LLM.int8's row-wise codes),
decoded on gather.

[Note: 8-bit shards]
``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_8bit=True))`` turns each convertible ``nn.Linear``
into bitsandbytes' ``Linear8bitLt``: its weight, cast to fp16, becomes one int8 code per element and one fp32 scale
per output row, the row's absolute maximum (``int8_vectorwise_quant``: ``round(w * (127 / absmax))``). On a CPU,
training runs ``MatMul8bitFp``: the weight decoded as ``code * (absmax * (1 / 127))`` in the compute dtype, then
``F.linear``. zinf stores the same codes and scales and decodes with the same arithmetic, so the decoded weight
equals bitsandbytes' to the bit (the tests compare the two) and every pass computes what bitsandbytes' training path
computes. bitsandbytes' inference path (``model.eval()``) quantizes the activations to 8 bits as well; zinf does not.

A scale belongs to a row, so an 8-bit group holds one weight and its layout aligns the shard size to the row
(``align``: ``in_features`` elements): no row straddles two ranks, and each rank encodes and keeps its own rows. A
shard is ``shard_numel`` int8 codes followed by one fp32 scale per row; the padding rows' codes and scales are zeros,
which decode to zeros. The all-gather moves the codes and scales; each rank decodes the gathered bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

from zinf.errors import UnsupportedModelError
from zinf.param.four_bit import FourBitFormat, fp32_view, shard_spans

if TYPE_CHECKING:
    from zinf.native.checksum import ContentCheck

__all__ = ["EightBitFormat", "QuantizedFormat"]


@dataclass(frozen=True)
class EightBitFormat:
    """How an 8-bit group stores its shard: ``row`` elements per fp32 scale (the weight's ``in_features``; 0 in the
    request, before ``for_weight`` fits it to a weight)."""

    row: int = 0
    bits = 8

    def for_weight(self, weight: torch.Tensor) -> "EightBitFormat":
        """This format fitted to ``weight`` (a ``nn.Linear`` weight: one scale per output row)."""
        if weight.dim() != 2:
            raise UnsupportedModelError(f"zinf: an 8-bit weight of shape {tuple(weight.shape)}; bitsandbytes' 8-bit "
                                        "format takes 2-D linear weights.")
        return replace(self, row=int(weight.shape[1]))

    @property
    def align(self) -> int:
        assert self.row > 0, "zinf: an 8-bit format fitted to no weight (for_weight)"
        return self.row

    def nbytes(self, shard_numel: int) -> int:
        """Bytes of a shard of ``shard_numel`` elements (whole rows): codes, then fp32 scales."""
        assert shard_numel % self.align == 0, (shard_numel, self.row)
        return shard_numel + shard_numel // self.row * 4

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, slots: Sequence, values: Sequence[torch.Tensor], lo: int, shard_numel: int) -> torch.Tensor:
        """This rank's shard (flat positions ``[lo, lo + shard_numel)``) of the weight whose whole values are
        ``values[0]``, quantized row by row as bitsandbytes' ``Int8Params`` quantizes it on the CPU."""
        out = torch.zeros(self.nbytes(shard_numel), dtype=torch.uint8)  # padding rows: zero codes and scales
        codes, scales = out[:shard_numel], torch.zeros(shard_numel // self.row, dtype=torch.float32)
        for slot, value in zip(slots, values):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + shard_numel)
            if a >= b:
                continue
            assert (a - slot.offset) % self.row == 0 and (b - slot.offset) % self.row == 0, \
                f"{slot.name}: an 8-bit shard cuts a row"
            rows = value.detach().reshape(-1)[a - slot.offset : b - slot.offset].view(-1, self.row)
            row_codes, absmax = quantize_rows(rows)
            codes[a - lo : b - lo].copy_(row_codes.view(-1).view(torch.uint8))
            scales[(a - lo) // self.row : (b - lo) // self.row].copy_(absmax)
        out[shard_numel:].copy_(scales.view(torch.uint8))
        return out

    # -- decoding -------------------------------------------------------------------------------
    def empty_shards(self, world: int, shard_numel: int, device: torch.device,
                     empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
        """``world`` shards end to end (1: a shard; the group's size: an all-gather's buffer), uninitialised."""
        return empty(world * self.nbytes(shard_numel), dtype=torch.uint8, device=device)

    def widen(self, shards: torch.Tensor, world: int, shard_numel: int, out: torch.Tensor,
              check: "ContentCheck | None" = None) -> None:
        """Decode ``world`` shards laid end to end into ``out`` (``world * shard_numel`` elements of the compute
        dtype) as ``MatMul8bitFp`` does: the codes cast to the compute dtype, times ``absmax * (1 / 127)``."""
        assert check is None, "zinf: an 8-bit shard's checksum is taken at its read"
        rows = shards.view(world, self.nbytes(shard_numel))
        n = shard_numel // self.row
        for r in range(world):
            codes = rows[r, :shard_numel].view(torch.int8).view(n, self.row)
            scales = fp32_view(rows[r, shard_numel:])  # unaligned after a row of odd length
            dst = out[r * shard_numel : (r + 1) * shard_numel].view(n, self.row)
            # one pass: each code widened exactly, times its row's scale in fp32, cast once to the compute dtype
            torch.mul(codes, scales.unsqueeze(1).mul(1.0 / 127.0), out=dst)

    def decode_range(self, shards: torch.Tensor, world: int, shard_numel: int, a: int, b: int,
                     out: torch.Tensor) -> None:
        """Elements ``[a, b)`` (whole rows) of the flat vector ``world`` shards hold end to end, decoded into ``out``
        (fp32, ``b - a`` elements) as :meth:`widen` decodes them."""
        rows, row = shards.view(world, self.nbytes(shard_numel)), self.row
        for r, lo, hi, done in shard_spans(a, b, shard_numel):
            codes = rows[r, lo:hi].view(torch.int8).view(-1, row)
            scales = fp32_view(rows[r, shard_numel + lo // row * 4 : shard_numel + hi // row * 4])
            torch.mul(codes, scales.unsqueeze(1).mul(1.0 / 127.0), out=out[done : done + hi - lo].view(-1, row))

    def values(self, shard: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """One rank's shard decoded to fp32 (checkpoints, exports, comparisons)."""
        out = torch.empty(shard_numel, dtype=torch.float32, device=shard.device)
        self.widen(shard, 1, shard_numel, out)
        return out


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' ``int8_vectorwise_quant`` of ``rows`` cast to fp16 (no outlier threshold, as ``Int8Params``
    calls it): int8 codes and each row's absolute maximum in fp32. A row of zeros gets zero codes (bitsandbytes
    divides by its zero maximum; any code decodes to zero with a zero scale)."""
    half = rows.to(torch.float16)
    absmax = torch.max(half.abs(), dim=1).values.float()
    scaled = torch.round(half * (127.0 / absmax.unsqueeze(-1)))
    return torch.nan_to_num(scaled, nan=0.0).to(torch.int8), absmax


QuantizedFormat = Union[FourBitFormat, EightBitFormat]
