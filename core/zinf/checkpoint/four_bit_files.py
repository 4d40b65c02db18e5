"""A checkpoint saved in 4 bits by bitsandbytes (``save_pretrained`` of a ``load_in_4bit`` model) into 4-bit groups:
each rank reads its blocks' codes and scales, nothing else ([Note: 4-bit shards] in zinf/param/four_bit.py).

bitsandbytes saves a 4-bit weight ``W`` as ``W`` (the packed codes, uint8, ``(ceil(n / 2), 1)``), ``W.absmax`` (the
block scales: fp32, or uint8 codes with double quantization), ``W.quant_map`` (the 16 code values), with double
quantization ``W.nested_absmax`` and ``W.nested_quant_map`` (the scales' own blocks of 256 and their 8-bit code
values), and ``W.quant_state.bitsandbytes__<type>`` (JSON bytes: the type, block size, shape, and the scales' offset).
Double-quantized scales are decoded as bitsandbytes' ``dequantize_4bit`` decodes them: ``code[q] * nested_absmax`` in
fp32, then the offset added.

Without double quantization a rank's shard is two byte ranges of the files per weight (its blocks' codes, then their
fp32 scales), so with the parameters on NVMe it stays where it lies, as any frozen shard at its storage width ([Note:
frozen shards in place] in zinf/offload/in_place.py): nothing is written, and each gather reads it from the files.
Double-quantized scales must be decoded first: those shards are written to the spill, then to swap.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from zinf.checkpoint.tensor_files import TensorFiles
from zinf.errors import CheckpointError
from zinf.offload.in_place import Extent, InPlaceRecord
from zinf.param.flat_group import FlatParamGroup
from zinf.param.four_bit import CODES

__all__ = ["companions", "check", "load_group", "weights_held"]

_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def _state_key(key: str, files: TensorFiles) -> str | None:
    return next((f"{key}.quant_state.bitsandbytes__{t}" for t in CODES
                 if f"{key}.quant_state.bitsandbytes__{t}" in files.tensors), None)


def companions(key: str, files: TensorFiles) -> list[str]:
    """The keys saved beside 4-bit weight ``key`` (its scales, code maps and quantization state)."""
    state = _state_key(key, files)
    return [k for k in (*(f"{key}.{p}" for p in _PARTS), state) if k is not None and k in files.tensors]


def _quant_state(key: str, files: TensorFiles) -> dict:
    state = _state_key(key, files)
    if state is None:
        raise CheckpointError(f"zinf: {key} is loaded into a 4-bit layer, but the checkpoint holds no 4-bit weight "
                              "there (no quant_state beside it). Load an unquantized checkpoint with "
                              "quantization_config=BitsAndBytesConfig(load_in_4bit=True), or this one without it.")
    raw = files.read_range(state, 0, files.tensors[state].numel)
    return json.loads(bytes(raw.to(torch.uint8).tolist()).decode())


def check(group: FlatParamGroup, slot_index: int, key: str, files: TensorFiles) -> str | None:
    """Why the file's 4-bit weight ``key`` cannot fill slot ``slot_index`` of ``group``, or None."""
    slot, fmt = group.slots[slot_index], group.quantized
    assert fmt is not None
    state = _quant_state(key, files)
    found = (state.get("quant_type"), state.get("blocksize"), tuple(state.get("shape", ())))
    want = (fmt.quant_type, fmt.blocksize, tuple(slot.shape))
    if found != want:
        fix = ("; zinf reads 4-bit checkpoints in blocks of 64, as transformers quantizes them: load the unquantized "
               "base with quantization_config to quantize it at loading" if found[1] != want[1] else "")
        return (f"{key}: the checkpoint's 4-bit weight is {found[0]}, blocks of {found[1]}, shape {list(found[2])}; "
                f"the model's is {want[0]}, blocks of {want[1]}, shape {list(want[2])}{fix}")
    if ("nested_offset" in state) != fmt.double_quant:
        return (f"{key}: the checkpoint's scales are {'' if 'nested_offset' in state else 'not '}double-quantized; "
                f"set bnb_4bit_use_double_quant={'nested_offset' in state} to match it")
    return None


def load_group(group: FlatParamGroup, files: TensorFiles, key_of: dict[int, str]) -> None:
    """This rank's codes and scales of every weight of 4-bit ``group`` from the files, written to its shard."""
    fmt = group.quantized
    assert fmt is not None
    bs = fmt.blocksize
    record = _in_place(group, files, key_of)
    if record is not None:
        group.residence.keep_in_place(group, record)
        files.count_read(sum(e.nbytes for e in record.extents))  # read by the store, not through ``files``
        return

    def fill(out: torch.Tensor) -> None:
        codes, scales = fmt.cleared(out, group.shard_numel)
        for key, a, ea, eb in weights_held(group, key_of):
            _read_code_bytes(files, key, ea // 2, (eb + 1) // 2, codes[a // 2 : a // 2 + (eb + 1) // 2 - ea // 2])
            scales[a // bs : a // bs + -(-eb // bs) - ea // bs].copy_(_scales(key, files, ea // bs, -(-eb // bs)))

    group.residence.write(group, fill)


def _read_code_bytes(files: TensorFiles, key: str, first: int, end: int, out: torch.Tensor) -> None:
    """Bytes ``[first, end)`` of weight ``key``'s packed codes into ``out`` (uint8). bitsandbytes packs the codes into
    its ``bnb_4bit_quant_storage`` dtype (uint8 by default; bf16, fp32, ... pack 2, 4, ... bytes an element): the
    bytes are read as they lie, never converted as values."""
    size = files.tensors[key].dtype.itemsize
    if size == 1:
        files.read_into(key, first, end, out)
        return
    raw = files.read_range(key, first // size, -(-end // size)).contiguous().view(torch.uint8)
    out.copy_(raw[first % size : first % size + end - first])


def _in_place(group: FlatParamGroup, files: TensorFiles, key_of: dict[int, str]) -> InPlaceRecord | None:
    """Where this rank's codes and scales of ``group`` lie in the files, when the shard may stay there: the spill
    takes shards in place, the files are safetensors, and no scale is double-quantized; None otherwise."""
    fmt = group.quantized
    assert fmt is not None
    params = group.params
    if not group.residence.may_load_in_place(group) or group.persistent or files.from_state_dict:
        return None
    keys = [key_of[id(p)] for p in params if p is not None]
    if not keys or any("nested_offset" in _quant_state(k, files) for k in keys):
        return None
    if any(files.tensors[k].offset < 0 or files.tensors[f"{k}.absmax"].offset < 0
           or files.tensors[f"{k}.absmax"].dtype != torch.float32 for k in keys):
        return None
    bs, half = fmt.blocksize, group.shard_numel // 2
    extents = []
    for key, a, ea, eb in weights_held(group, key_of):
        codes, scales = files.tensors[key], files.tensors[f"{key}.absmax"]
        extents.append(Extent(os.path.abspath(codes.file), codes.offset + ea // 2, (eb + 1) // 2 - ea // 2, a // 2))
        nblocks = -(-eb // bs) - ea // bs
        extents.append(Extent(os.path.abspath(scales.file), scales.offset + ea // bs * 4, nblocks * 4,
                              half + a // bs * 4))
    return InPlaceRecord.of(group.name, group.shard_nbytes, extents)


def weights_held(group: FlatParamGroup, key_of: dict[int, str]) -> Iterator[tuple[str, int, int, int]]:
    """(file key, start in this rank's shard, first and end of the weight's elements there) for every weight of
    ``group`` this rank holds a part of; the first element is block-aligned (the layout aligns slots to blocks, or
    to an 8-bit weight's rows)."""
    params = group.params
    for i, a, b, first in group.layout.local_slices():
        if params[i] is not None:
            yield key_of[id(params[i])], a, first, first + (b - a)


def _scales(key: str, files: TensorFiles, first: int, end: int) -> torch.Tensor:
    """Blocks ``[first, end)`` of weight ``key``'s scales as fp32 (decoded when double-quantized)."""
    raw = files.read_range(f"{key}.absmax", first, end)
    state = _quant_state(key, files)
    if "nested_offset" not in state:
        return raw.float()
    nested_bs = state.get("nested_blocksize", 256)
    nested = files.read_range(f"{key}.nested_absmax", first // nested_bs, -(-end // nested_bs))
    code = files.read_range(f"{key}.nested_quant_map", 0, 256).float()
    blocks = torch.arange(first, end) // nested_bs - first // nested_bs
    decoded = code[raw.long()] * nested.float()[blocks]
    decoded += torch.tensor(state["nested_offset"], dtype=torch.float32)
    return decoded
