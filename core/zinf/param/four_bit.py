"""Frozen weights stored in 4 bits, as bitsandbytes stores them (QLoRA's NF4 and FP4), decoded on gather.

[Note: 4-bit shards]
A 4-bit group holds the weights of ``nn.Linear`` layers that ``from_pretrained(quantization_config=
BitsAndBytesConfig(load_in_4bit=True))`` would turn into bitsandbytes' ``Linear4bit`` (zinf/integrations/
quantized.py). Each weight is quantized as bitsandbytes' ``quantize_4bit`` does it on the CPU (blocks of
``blocksize`` elements from the tensor's start, a 4-bit code per element, the block's absolute maximum as its scale;
zinf/native/four_bit.py reproduces it bit for bit, and the tests compare the two). The flat layout aligns every slot
and the shard size to ``blocksize`` elements (``FlatLayout.of(align=...)``), so no block straddles two parameters or
two ranks: each rank encodes and keeps its own blocks' codes and scales, and the decoded values are those of the
whole weight.

A shard is ``shard_numel / 2`` bytes of codes (two per byte, the first element in the high nibble, as bitsandbytes
packs them) followed by one fp32 scale per block. With ``bnb_4bit_use_double_quant`` the scales are stored decoded
(bitsandbytes' ``dequantize_blockwise`` of the 8-bit scales, plus the offset): the values equal bitsandbytes' to the
bit, at 0.5625 bytes per parameter instead of 0.516, and no nested block has to respect the shard boundaries. The
offset, the mean of a weight's scales, is summed on one thread: the same bits whatever the run's thread count
(torch's parallel sum, which bitsandbytes uses, changes its last bit with the threads past 32768 blocks, and a resume
on another world size, another thread count, would find its base changed).

Decoding is bitsandbytes' arithmetic: ``code[nibble] * scale`` in fp32, then one cast to the compute dtype. The
all-gather moves the 4-bit shards; each rank decodes the gathered bytes into its full buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.native import four_bit as native_four_bit
from zinf.native.widen import copy_checked, widen_into

if TYPE_CHECKING:
    from zinf.native.checksum import ContentCheck

__all__ = ["FourBitFormat", "WidenedShard", "CODES", "refuse_change", "convertible_linears", "fp32_view",
           "shard_spans"]

# bitsandbytes' codebooks (bitsandbytes.functional.get_4bit_type), index = the 4-bit code
CODES = {
    "nf4": (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0),
    "fp4": (0.0, 0.0052083333333333333, 0.6666666666666666, 1.0, 0.3333333333333333, 0.5, 0.16666666666666666,
            0.25, 0.0, -0.0052083333333333333, -0.6666666666666666, -1.0, -0.3333333333333333, -0.5,
            -0.16666666666666666, -0.25),
}
_ZERO_CODE = {"nf4": 7, "fp4": 0}  # the code of 0.0: padding decodes to zeros


class WidenedShard:
    """The usual shard: ``storage_dtype`` elements (maybe narrower than the compute dtype), widened by one cast."""

    align = 1

    def __init__(self, storage_dtype: torch.dtype) -> None:
        self.dtype = storage_dtype

    def nbytes(self, shard_numel: int) -> int:
        return shard_numel * self.dtype.itemsize

    def values(self, shard: torch.Tensor, shard_numel: int) -> torch.Tensor:
        return shard.to(torch.float32)

    def empty_shards(self, world: int, shard_numel: int, device: torch.device,
                     empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
        """``world`` shards end to end (1: a shard; the group's size: an all-gather's buffer), uninitialised;
        ``empty`` allocates it (``torch.empty``, or a run context's gather buffers)."""
        return empty(world * shard_numel, dtype=self.dtype, device=device)

    def widen(self, gathered: torch.Tensor, world: int, shard_numel: int, out: torch.Tensor,
              check: "ContentCheck | None" = None) -> None:
        """``gathered`` widened into ``out`` ([Note: streaming the widening] in zinf/native/widen.py); with a
        ``check``, its checksum taken in the same pass and verified before this returns ([Note: one pass per byte]
        in zinf/offload/in_place.py)."""
        if check is None:
            widen_into(out, gathered)
        else:
            check.verify(copy_checked(out, gathered))


def convertible_linears(model: nn.Module, skip_modules: Sequence[str] | None = None) -> list[tuple[str, nn.Linear]]:
    """The layers ``BitsAndBytesConfig(load_in_4bit=True or load_in_8bit=True, llm_int8_skip_modules=...)`` turns
    into ``Linear4bit`` or ``Linear8bitLt`` (transformers' own rule: ``get_modules_to_not_convert``,
    ``should_convert_module``). A transformers ``Conv1D`` it would convert (the GPT-2 family) is refused: zinf does
    not store it quantized."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(model, skip_modules, getattr(model, "_keep_in_fp32_modules", None))
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    out = []
    for name, module in model.named_modules():
        if not name or not should_convert_module(name, skip):
            continue
        if type(module) is nn.Linear:
            tied = [n for n in owners.get(id(module.weight), []) if n != name]
            if tied:  # an embedding read through this weight would be decoded from 4 bits
                raise UnsupportedModelError(
                    f"zinf: {name}'s weight is tied to {tied[0]}, and a tied weight is not stored quantized. Add "
                    f"'{name.rsplit('.', 1)[-1]}' to BitsAndBytesConfig(llm_int8_skip_modules=[...]) (transformers "
                    "leaves a tied output layer out by default).")
            out.append((name, module))
        elif type(module).__name__ == "Conv1D":
            raise UnsupportedModelError(
                f"zinf: {name} is a transformers Conv1D (the GPT-2 family), which zinf does not store quantized. "
                "Load this model without quantization_config (LoRA on a 16-bit base), or add it to "
                "BitsAndBytesConfig(llm_int8_skip_modules=[...]).")
    return out


def fp32_view(raw: torch.Tensor) -> torch.Tensor:
    """Bytes read as fp32 (copied where they do not start on a 4-byte boundary)."""
    return (raw if raw.data_ptr() % 4 == 0 else raw.clone()).view(torch.float32)


def shard_spans(a: int, b: int, shard_numel: int) -> Iterator[tuple[int, int, int, int]]:
    """Elements ``[a, b)`` of a flat vector that shards of ``shard_numel`` elements hold end to end, shard by shard:
    ``(rank, lo, hi, done)``, elements ``[lo, hi)`` of rank ``rank``'s shard, the span's first ``done`` elements before
    them (a ``decode_range``'s walk)."""
    done = 0
    while a < b:
        r, lo = divmod(a, shard_numel)
        hi = min(b - r * shard_numel, shard_numel)
        yield r, lo, hi, done
        a, done = a + hi - lo, done + hi - lo


def refuse_change(group: Any, what: str, values: torch.Tensor | None = None) -> None:
    """A quantized group refuses ``what`` (a change of its values; with ``values``, this rank's shard of them, unless they
    are its own where its parameters lie: the padding between them decodes to whatever its codes were read as)."""
    if group.quantized is not None and (values is None or not _same_values(group, values.float().cpu())):
        raise UnsupportedModelError(
            f"zinf: {group.name} is stored in {group.quantized.bits} bits (from_pretrained's quantization_config), so "
            f"{what} cannot change it. Train adapters on it (peft's LoRA), or load the model without "
            "quantization_config to train or edit these weights.")


def _same_values(group: Any, values: torch.Tensor) -> bool:
    own = group.shard_values(group.store.read(group)).cpu()
    return all(torch.equal(values[a:b], own[a:b]) for _, a, b, _ in group.layout.local_slices())


@dataclass(frozen=True)
class FourBitFormat:
    """How a 4-bit group stores its shard (``quant_type`` "nf4" or "fp4", ``blocksize`` elements per scale,
    ``double_quant``: scales from bitsandbytes' 8-bit double quantization, stored decoded)."""

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = False
    bits = 4

    def __post_init__(self) -> None:
        if self.quant_type not in CODES:
            raise UnsupportedModelError(f"zinf: bnb_4bit_quant_type={self.quant_type!r} is not a 4-bit format zinf "
                                        f"stores; use one of {sorted(CODES)}.")
        if self.blocksize < 2 or self.blocksize & (self.blocksize - 1):
            raise UnsupportedModelError(f"zinf: a 4-bit block size of {self.blocksize} elements; use a power of two "
                                        "(bitsandbytes uses 64).")

    @property
    def align(self) -> int:
        return self.blocksize

    def for_weight(self, weight: torch.Tensor) -> "FourBitFormat":
        """The format of one weight: blocks run over the flat weight, whatever its shape."""
        return self

    def nbytes(self, shard_numel: int) -> int:
        """Bytes of a shard of ``shard_numel`` elements (a multiple of ``blocksize``): codes, then fp32 scales."""
        assert shard_numel % self.blocksize == 0, (shard_numel, self.blocksize)
        return shard_numel // 2 + shard_numel // self.blocksize * 4

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, slots: Sequence, values: Sequence[torch.Tensor], lo: int, shard_numel: int) -> torch.Tensor:
        """This rank's shard (flat positions ``[lo, lo + shard_numel)``) of parameters whose whole values are
        ``values``, laid out by ``slots`` (block-aligned offsets). Each rank quantizes only its elements (blocks are
        independent); with double quantization the scales are bitsandbytes' 8-bit codes of the whole weight's
        scales, decoded by bitsandbytes."""
        out = torch.empty(self.nbytes(shard_numel), dtype=torch.uint8)
        bs = self.blocksize
        codes, scales = self.cleared(out, shard_numel)
        for slot, value in zip(slots, values):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + shard_numel)
            if a >= b:
                continue
            assert (slot.offset - lo) % bs == 0, f"{slot.name}: slot not aligned to the 4-bit blocks"
            flat = value.detach().reshape(-1)
            ea, eb = a - slot.offset, b - slot.offset  # elements of the parameter this rank keeps; ea is block-aligned
            packed, scale = native_four_bit.encode(flat[ea:eb], bs, CODES[self.quant_type])
            if self.double_quant:
                scale = self._double_quantized(native_four_bit.block_absmax(flat, bs))[ea // bs : -(-eb // bs)]
            codes[(a - lo) // 2 : (a - lo) // 2 + packed.numel()].copy_(packed)
            scales[(a - lo) // bs : (a - lo) // bs + scale.numel()].copy_(scale)
        return out

    def cleared(self, shard: torch.Tensor, shard_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A shard's codes (uint8) and scales (fp32) views, set to what decodes to zeros (the padding's values)."""
        half = shard_numel // 2
        codes, scales = shard[:half], shard[half:].view(torch.float32)
        zero = _ZERO_CODE[self.quant_type]
        codes.fill_(zero << 4 | zero)
        scales.zero_()
        return codes, scales

    @staticmethod
    def _double_quantized(absmax: torch.Tensor) -> torch.Tensor:
        """A weight's block scales as bitsandbytes' double quantization leaves them, decoded as its
        ``dequantize_4bit`` decodes them: 8-bit codes of ``absmax - mean`` in blocks of 256, plus the mean."""
        from bitsandbytes import functional as bnb_f

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the mean's bits would depend on the thread count past 32768 blocks
        try:
            offset = absmax.mean()
        finally:
            torch.set_num_threads(threads)
        codes, state = bnb_f.quantize_blockwise(absmax - offset, blocksize=256)
        decoded = bnb_f.dequantize_blockwise(codes, state)
        decoded += offset
        return decoded.float()

    # -- decoding -------------------------------------------------------------------------------
    def empty_shards(self, world: int, shard_numel: int, device: torch.device,
                     empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
        """``world`` shards end to end (1: a shard; the group's size: an all-gather's buffer), uninitialised;
        ``empty`` allocates it (``torch.empty``, or a run context's gather buffers)."""
        return empty(world * self.nbytes(shard_numel), dtype=torch.uint8, device=device)

    def widen(self, shards: torch.Tensor, world: int, shard_numel: int, out: torch.Tensor,
              check: "ContentCheck | None" = None) -> None:
        """Decode ``world`` shards laid end to end (an all-gather's buffer) into ``out`` (``world * shard_numel``
        elements of the compute dtype): ``code * scale`` in fp32, then cast, as bitsandbytes decodes. Its store
        checks the codes' checksum itself (``check`` is None)."""
        assert check is None, "zinf: a 4-bit shard's checksum is taken at its read"
        nbytes, half = self.nbytes(shard_numel), shard_numel // 2
        rows = shards.view(world, nbytes)
        for r in range(world):
            scales = fp32_view(rows[r, half:])  # at a multiple of 32 bytes from the row's start
            native_four_bit.decode(rows[r, :half], scales, out[r * shard_numel : (r + 1) * shard_numel],
                                   self.blocksize, CODES[self.quant_type])

    def decode_range(self, shards: torch.Tensor, world: int, shard_numel: int, a: int, b: int,
                     out: torch.Tensor) -> None:
        """Elements ``[a, b)`` of the flat vector ``world`` shards hold end to end, decoded into ``out`` (fp32, ``b - a``
        elements; ``a`` and ``b`` on block boundaries): a tile of a layer computed from its codes
        ([Note: frozen linears from storage] in zinf/frozen_linear.py)."""
        half, bs = shard_numel // 2, self.blocksize
        rows = shards.view(world, self.nbytes(shard_numel))
        for r, lo, hi, done in shard_spans(a, b, shard_numel):
            scales = fp32_view(rows[r, half + lo // bs * 4 : half + hi // bs * 4])
            native_four_bit.decode(rows[r, lo // 2 : hi // 2], scales, out[done : done + hi - lo], bs,
                                   CODES[self.quant_type])

    def values(self, shard: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """One rank's shard decoded to fp32 (checkpoints, exports, comparisons)."""
        out = torch.empty(shard_numel, dtype=torch.float32, device=shard.device)
        self.widen(shard, 1, shard_numel, out)
        return out
