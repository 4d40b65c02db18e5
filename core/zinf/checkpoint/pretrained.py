"""Pretrained weights into a partitioned model, streaming: every rank reads only the byte ranges of its own slices
and writes them to the tier its shards live on (device, CPU or NVMe), one group at a time.

    with zinf.Init(config):
        model = MyModel()                       # or transformers' from_pretrained, which calls this itself
    report = zinf.load_pretrained(model, "path/to/checkpoint")   # a save_pretrained directory, a file, a state dict

A rank's memory is its shards plus one group's fp32 slice and one piece of a tensor (see [Note: reading a slice] in
tensor_files.py): never the model. No collective is issued, so ranks may load at their own pace (a persistent,
gathered group is the exception: it is gathered again once its shard changes, on every rank in the same order).
Keys are matched like ``load_state_dict``: a tied weight under any of its names, a checkpoint of the base model
(without the head's ``base_model_prefix``) or of the model with it; values are cast to fp32 for the masters
(bf16 files into an fp32 run are exact). A shape mismatch, and with ``strict`` a missing or unexpected key, is an
error raised before anything is written.

[Note: reading at the storage width]
A group whose shard is its only copy (frozen, or built straight to NVMe under ``zinf.Init``: its master is made at
the placement, from the shard) and whose parameters the files hold in its storage dtype (a bf16 checkpoint into
bf16 storage, the usual LoRA base) gets the file's bytes as they are: read into the store's buffer and written,
without the fp32 slice, the check that the storage dtype holds the values exactly (it holds its own dtype's
values) or the narrowing. Any other group goes through its fp32 master.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from zinf.checkpoint import eight_bit_files, four_bit_files
from zinf.checkpoint.names import param_names, persistent_buffers
from zinf.checkpoint.tensor_files import TensorFiles, open_weights
from zinf.errors import CheckpointError
from zinf.heap import HeapTrimmer
from zinf.offload.in_place import Extent, InPlaceRecord
from zinf.param.eight_bit import EightBitFormat
from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.registry import group_of, groups_of
from zinf.units import format_bytes

__all__ = ["load_pretrained", "LoadReport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What ``load_pretrained`` did on this rank; ``missing_keys`` / ``unexpected_keys`` as ``load_state_dict``."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    loaded_keys: list[str]  # the model's names (every name of a tied weight) that got values from the files
    bytes_read: int  # the bytes this rank read from the files
    file_bytes: int  # the bytes of every tensor in the files
    seconds: float
    skipped: list[str] = field(default_factory=list)  # unpartitioned parameters or buffers left as they are

    def incompatible_keys(self) -> "nn.modules.module._IncompatibleKeys":
        return nn.modules.module._IncompatibleKeys(self.missing_keys, self.unexpected_keys)


def _resolver(model: nn.Module, file_keys: set[str]):
    """Map a model name to the checkpoint's key: as it is, or with the base model prefix removed or added
    (a ``LlamaModel`` checkpoint loaded into ``LlamaForCausalLM``, or the reverse)."""
    prefix = getattr(model, "base_model_prefix", "") or ""

    def resolve(name: str) -> str | None:
        if name in file_keys:
            return name
        if prefix:
            if name.startswith(prefix + ".") and name[len(prefix) + 1:] in file_keys:
                return name[len(prefix) + 1:]
            if f"{prefix}.{name}" in file_keys:
                return f"{prefix}.{name}"
        return None

    return resolve


def load_pretrained(model: nn.Module, source: str | os.PathLike | list[str] | dict[str, torch.Tensor], *,
                    strict: bool = True) -> LoadReport:
    """Load weights from ``source`` (a checkpoint directory in the Hugging Face layout, one safetensors or torch
    file, a list of them, or a state dict) into ``model``, whose parameters zinf has partitioned (``zinf.Init``,
    or an engine). Call it on every rank. See the module docstring."""
    start = time.perf_counter()
    with open_weights(source) as files:
        report = _load(model, files, strict, start)
    log.info("zinf: loaded %d tensors in %.1f s: this rank read %s of the files' %s (%s/s)", len(report.loaded_keys),
             report.seconds, format_bytes(report.bytes_read), format_bytes(report.file_bytes),
             format_bytes(report.bytes_read / max(report.seconds, 1e-9)))
    return report


def _load(model: nn.Module, files: TensorFiles, strict: bool, start: float) -> LoadReport:
    names, buffers = param_names(model), persistent_buffers(model)
    params = {id(p): p for p in model.parameters()}
    file_keys = set(files.keys())
    resolve = _resolver(model, file_keys)
    key_of: dict[int, str] = {}
    missing: list[str] = []
    errors: list[str] = []
    used: set[str] = set()
    for pid, ns in names.items():
        keys = [k for k in map(resolve, ns) if k is not None]  # a tied weight may be saved under each of its names
        if not keys:
            missing.append(ns[0])
            continue
        key = keys[0]
        used.update(keys)
        shape = tuple(params[pid].shape)  # a partitioned parameter's placeholder keeps its shape
        group = group_of(params[pid])
        if group is not None and group.quantized is not None:  # bitsandbytes' saved codes and scales
            saved = _saved_files(group)
            used.update(saved.companions(key, files))
            why = saved.check(group, group.index_of(params[pid]), key, files)
            if why:
                errors.append(why)
            key_of[pid] = key
            continue
        if files.tensors[key].shape != shape:
            errors.append(f"size mismatch for {ns[0]}: the checkpoint has {list(files.tensors[key].shape)} ({key}), "
                          f"the model {list(shape)}")
        key_of[pid] = key
    buffer_key: dict[str, str] = {}
    for n, b in buffers.items():
        key = resolve(n)
        if key is None:
            missing.append(n)
        elif files.tensors[key].shape != tuple(b.shape):
            errors.append(f"size mismatch for buffer {n}: the checkpoint has {list(files.tensors[key].shape)}, "
                          f"the model {list(b.shape)}")
        else:
            buffer_key[n] = key
            used.add(key)
    unexpected = sorted(file_keys - used)
    if errors or (strict and (missing or unexpected)):
        raise CheckpointError("zinf: load_pretrained: " + "; ".join(
            errors[:8] + ([f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}"] if strict and missing else [])
            + ([f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"] if strict and unexpected else []))
            + ". Nothing was loaded." + ("" if errors else " Pass strict=False to load what matches and keep the rest "
                                         "as it is."))

    groups = groups_of(params.values())
    step = max(1, len(groups) // 10)
    heap = HeapTrimmer()  # see [Note: heap growth] in zinf/heap.py
    with torch.no_grad():
        for i, g in enumerate(groups, 1):
            if g.quantized is not None:
                _saved_files(g).load_group(g, files, key_of)
            else:
                _load_group(g, files, key_of)
            heap.count(g.shard_numel * 8)  # the slices read and the fp32 shard built from them
            if i % step == 0 or i == len(groups):
                log.info("zinf: load_pretrained %d/%d groups, %s read", i, len(groups), format_bytes(files.bytes_read))
        skipped = []
        for pid, p in params.items():  # parameters zinf does not manage: whole
            if group_of(p) is None:
                if pid in key_of:
                    p.copy_(files.read_range(key_of[pid], 0, p.numel()).view(p.shape))
                else:
                    skipped.append(names[pid][0])
        for n, key in buffer_key.items():
            b = buffers[n]
            b.copy_(files.read_range(key, 0, b.numel()).view(b.shape))
    heap.trim()
    return LoadReport(missing_keys=missing, unexpected_keys=unexpected,
                      loaded_keys=[n for pid in key_of for n in names[pid]] + list(buffer_key),
                      bytes_read=files.bytes_read, file_bytes=sum(t.numel * t.dtype.itemsize for t in files.tensors.values()),
                      seconds=time.perf_counter() - start, skipped=skipped)


def _saved_files(g: FlatParamGroup) -> ModuleType:
    """The reader of a quantized group's saved codes and scales: bitsandbytes' 4-bit or 8-bit files."""
    return eight_bit_files if isinstance(g.quantized, EightBitFormat) else four_bit_files


def _load_group(g: FlatParamGroup, files: TensorFiles, key_of: dict[int, str]) -> None:
    """This rank's slice of every parameter of ``g`` from the files, written to its shard (and master) at once."""
    if g.state is not GroupState.SHARDED and not g.persistent:
        raise CheckpointError(f"zinf: load_pretrained: {g.name} is gathered (inside GatheredParameters or a forward "
                              "pass, or after a training forward whose backward has not run?); load weights outside "
                              "them, or call engine.load_full_state_dict / engine.load_checkpoint, which give back "
                              "what such a forward kept.")
    params = g.params
    keep = any(p is not None and id(p) not in key_of for p in params)
    at_width = not keep and all(files.tensors[key_of[id(p)]].dtype == g.storage_dtype for p in params if p is not None)
    if at_width:
        g.master_shard.expect_exact_values()
    if at_width and g.shard_only and g.master is None:
        # [Note: reading at the storage width]; the buffer is the store's: what no file fills is zeroed, as in the
        # fp32 path's fresh vector
        record = _in_place(g, params, files, key_of)
        if record is not None:  # [Note: frozen shards in place] in zinf/offload/in_place.py
            g.residence.keep_in_place(g, record)
            files.count_read(sum(e.nbytes for e in record.extents))  # read by the store, not through ``files``
        else:
            g.write_shard(lambda out: _read_slices(g, params, files, key_of, out, zero_rest=True))
        return
    local = g.master_shard.read().to("cpu", torch.float32, copy=True) if keep else torch.zeros(g.shard_numel)
    _read_slices(g, params, files, key_of, local, zero_rest=False)
    g.write_master(local.to(g.device))


def _in_place(g: FlatParamGroup, params: list[nn.Parameter | None], files: TensorFiles,
              key_of: dict[int, str]) -> InPlaceRecord | None:
    """Where this rank's shard of ``g`` lies in the safetensors files, when it may stay there (see [Note: frozen
    shards in place] in zinf/offload/in_place.py); None otherwise."""
    if not g.residence.may_load_in_place(g) or g.persistent:
        return None
    infos = [files.tensors[key_of[id(p)]] for p in params if p is not None]
    if not infos or any(info.offset < 0 for info in infos) or files.from_state_dict:
        return None
    size = g.storage_dtype.itemsize
    extents = []
    for p, a, b, first in _rank_slices(g, params):
        if p is not None:
            info = files.tensors[key_of[id(p)]]
            extents.append(Extent(os.path.abspath(info.file), info.offset + first * size, (b - a) * size, a * size))
    return InPlaceRecord.of(g.name, g.shard_numel * size, extents)


def _rank_slices(g: FlatParamGroup, params: list[nn.Parameter | None]
                 ) -> Iterator[tuple[nn.Parameter | None, int, int, int]]:
    """(parameter, start, end in this rank's shard, the first of its flattened elements there) for every parameter
    slot of ``g`` that this rank's shard covers."""
    for i, a, b, first in g.layout.local_slices():
        yield params[i], a, b, first


def _read_slices(g: FlatParamGroup, params: list[nn.Parameter | None], files: TensorFiles, key_of: dict[int, str],
                 out: torch.Tensor, zero_rest: bool) -> None:
    """This rank's slice of every parameter of ``g`` that the files hold, into ``out`` (laid out as its shard, in
    any dtype: read straight in where it is the file's); with ``zero_rest`` the rest of ``out`` (dropped
    parameters, the padding past the last one) is zeroed, else left as it is."""
    for p, a, b, first in _rank_slices(g, params):
        if p is not None and id(p) in key_of:
            files.read_into(key_of[id(p)], first, first + (b - a), out[a:b])
        elif zero_rest:
            out[a:b].zero_()
    if zero_rest:
        out[max(g.numel - g.rank * g.shard_numel, 0) :].zero_()
