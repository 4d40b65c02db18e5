"""A checkpoint saved in 8 bits by bitsandbytes (``save_pretrained`` of a ``load_in_8bit`` model) into 8-bit groups:
each rank reads its rows' codes and scales, nothing else ([Note: 8-bit shards] in zinf/param/eight_bit.py).

bitsandbytes saves an 8-bit layer's weight ``M.weight`` as its int8 codes (``(out_features, in_features)``, row
major), ``M.SCB`` as the rows' fp32 scales and ``M.weight_format`` as 0 (rows). A rank's shard is its rows: one byte
range of the codes and one of the scales, so with the parameters on NVMe it stays where it lies ([Note: frozen
shards in place] in zinf/offload/in_place.py): nothing is written, and each gather reads it from the files.
"""

from __future__ import annotations

import os

import torch

from zinf.checkpoint.four_bit_files import weights_held
from zinf.checkpoint.tensor_files import TensorFiles
from zinf.offload.in_place import Extent, InPlaceRecord
from zinf.param.flat_group import FlatParamGroup

__all__ = ["companions", "check", "load_group"]


def _scales_key(key: str) -> str:
    return f"{key.removesuffix('.weight')}.SCB"


def companions(key: str, files: TensorFiles) -> list[str]:
    """The keys saved beside 8-bit weight ``key`` (its rows' scales and its format)."""
    return [k for k in (_scales_key(key), f"{key}_format") if k in files.tensors]


def check(group: FlatParamGroup, slot_index: int, key: str, files: TensorFiles) -> str | None:
    """Why the file's 8-bit weight ``key`` cannot fill slot ``slot_index`` of ``group``, or None."""
    slot, info = group.slots[slot_index], files.tensors[key]
    scales = files.tensors.get(_scales_key(key))
    if info.dtype != torch.int8 or scales is None:
        return (f"{key}: the checkpoint holds no 8-bit weight there ({info.dtype}, no {_scales_key(key)} beside it). "
                "Load an unquantized checkpoint with quantization_config=BitsAndBytesConfig(load_in_8bit=True), or "
                "this one without it.")
    if tuple(info.shape) != tuple(slot.shape) or tuple(scales.shape) != tuple(slot.shape[:1]) \
            or scales.dtype != torch.float32:
        return (f"{key}: the checkpoint's 8-bit weight is {list(info.shape)} with {scales.dtype} scales of "
                f"{list(scales.shape)}; the model's is {list(slot.shape)} with a float32 scale a row")
    if f"{key}_format" in files.tensors and int(files.read_range(f"{key}_format", 0, 1)[0]) != 0:
        return (f"{key}: the checkpoint's 8-bit weight is in a tiled GPU layout (weight_format not 'row'); save it "
                "again from bitsandbytes on the CPU, or load the unquantized checkpoint with load_in_8bit=True")
    return None


def load_group(group: FlatParamGroup, files: TensorFiles, key_of: dict[int, str]) -> None:
    """This rank's codes and scales of 8-bit ``group``'s weight from the files, written to its shard."""
    fmt = group.quantized
    assert fmt is not None
    record = _in_place(group, files, key_of)
    if record is not None:
        group.residence.keep_in_place(group, record)
        files.count_read(sum(e.nbytes for e in record.extents))  # read by the store, not through ``files``
        return
    n, row = group.shard_numel, fmt.row

    def fill(out: torch.Tensor) -> None:
        out.zero_()  # padding rows: zero codes and scales
        scales = torch.zeros(n // row, dtype=torch.float32)
        for key, a, ea, eb in weights_held(group, key_of):
            files.read_into(key, ea, eb, out[a : a + eb - ea].view(torch.int8))
            files.read_into(_scales_key(key), ea // row, eb // row, scales[a // row : (a + eb - ea) // row])
        out[n:].copy_(scales.view(torch.uint8))

    group.residence.write(group, fill)


def _in_place(group: FlatParamGroup, files: TensorFiles, key_of: dict[int, str]) -> InPlaceRecord | None:
    """Where this rank's codes and scales of ``group`` lie in the files, when the shard may stay there (the spill
    takes shards in place, the files are safetensors); None otherwise."""
    if not group.residence.may_load_in_place(group) or group.persistent or files.from_state_dict:
        return None
    keys = [key_of[id(p)] for p in group.params if p is not None]
    if not keys or any(files.tensors[k].offset < 0 or files.tensors[_scales_key(k)].offset < 0 for k in keys):
        return None
    n, row = group.shard_numel, group.quantized.row
    extents = []
    for key, a, ea, eb in weights_held(group, key_of):
        codes, scales = files.tensors[key], files.tensors[_scales_key(key)]
        extents.append(Extent(os.path.abspath(codes.file), codes.offset + ea, eb - ea, a))
        extents.append(Extent(os.path.abspath(scales.file), scales.offset + ea // row * 4, (eb - ea) // row * 4,
                              n + a // row * 4))
    return InPlaceRecord.of(group.name, group.shard_nbytes, extents)
