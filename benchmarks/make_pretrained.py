"""Write a Hugging Face pretrained checkpoint of any size without ever holding the model, e.g. a 13B Llama in bf16
(26 GB) on a machine with 24 GiB of RAM, for demos of the fine-tuning path (docs: DESIGN.md, "The fine-tuning path").

    python benchmarks/make_pretrained.py OUT_DIR --size 13b|7b|1b|tiny [--layers N --hidden H --intermediate I
        --heads N --kv-heads N --vocab V] [--dtype bf16|fp16|fp32] [--shard-size 5GB] [--seed 0] [--overwrite]
        [--dry-run] [--no-progress]

The directory holds what ``model.save_pretrained(OUT_DIR, max_shard_size=...)`` writes: ``config.json``,
``generation_config.json``, and either ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` shards with
``model.safetensors.index.json``; same names, same sharding, same tensor order, same header, so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.

How it stays small: parameter names and shapes come from the model built on the meta device (no memory); each
shard's tensors are planned first (greedy in state-dict order, as huggingface_hub splits), its header written, then
each tensor's bytes generated and written one chunk of ``CHUNK_NUMEL`` elements at a time, generation on a thread
overlapping the writes. Peak memory is a few chunks (about 200 MiB in bf16), whatever the model's size.

Values: a chunk's values depend only on (seed, tensor name, chunk index), through a stable hash, so a re-run writes
the same bytes and any tensor can be regenerated on its own (``tensor_values``) to verify a file. Matrices and
embeddings are normal with std ``config.initializer_range`` (0.02), norm weights are ones, biases zeros: a model
that computes finite losses, as a trained one does.

Files are written under a hidden temporary name, flushed to disk and renamed when complete; the index and the
configs come last, so an interrupted run never leaves a directory that looks like a complete checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import errno
import hashlib
import json
import os
import queue
import re
import resource
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PretrainedConfig

CHUNK_NUMEL = 1 << 24  # the values are defined per chunk of this many elements (32 MiB in bf16)
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}
FOUR_BIT_BLOCK = 64  # bitsandbytes' block of 4-bit codes per scale
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
_OWN_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|\..*\.partial")
_PARTIAL = ".{name}.partial"

LLAMA2 = dict(max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, vocab_size=32000)
PRESETS: dict[str, dict[str, object]] = {
    # Llama-2-13B and -7B shapes (meta-llama/Llama-2-*-hf config.json)
    "13b": dict(LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40),
    "7b": dict(LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    # TinyLlama-1.1B shapes (Llama-2 architecture, grouped-query attention)
    "1b": dict(LLAMA2, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, max_position_embeddings=2048),
    # for tests: 2 layers, 64 wide
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False),
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its state-dict name, shape, storage dtype and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str  # "normal" (std), "ones" or "zeros"; a 4-bit weight's parts: "codes-nf4", "scales", "const" (payload)
    std: float
    source: TensorSpec | None = None  # a 4-bit part: the weight whose values it encodes
    payload: bytes = b""  # "const": the bytes themselves

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One safetensors file: its name and its tensors in file order (by name, as safetensors sorts them)."""

    file_name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def header(self) -> bytes:
        return safetensors_header(self.tensors)

    @property
    def file_bytes(self) -> int:
        return 8 + len(self.header) + sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class WriteSummary:
    out_dir: str
    num_parameters: int
    tensor_bytes: int  # the index's total_size
    file_bytes: int  # everything written, headers and configs included
    files: tuple[str, ...]
    seconds: float
    write_gb_per_s: float  # file_bytes / seconds, 1 GB = 1e9 bytes
    peak_rss_bytes: int  # of this process since it started (resource.getrusage)


def llama_config(size: str, **overrides: object) -> LlamaConfig:
    """A preset's LlamaConfig (``PRESETS``), with the given fields replaced (None leaves the preset's value)."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}: expected one of {sorted(PRESETS)}")
    fields = dict(PRESETS[size])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return LlamaConfig(**fields)


def tensor_specs(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """The tensors ``model.save_pretrained`` writes, in state-dict order: the model is built on the meta device
    (free), non-persistent buffers are skipped (they are not in the state dict) and a tied weight is written once,
    under the name transformers keeps (the tie's source, e.g. ``model.embed_tokens.weight`` for ``lm_head.weight``)."""
    return _specs_of(_meta_model(config), dtype)


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _four_bit_parts(weight: TensorSpec, quant_type: str) -> list[TensorSpec]:
    """A weight as bitsandbytes' ``save_pretrained`` writes a 4-bit one (no double quantization): the packed codes,
    the fp32 block scales, the code values and the quantization state (JSON bytes)."""
    from zinf.param.four_bit import CODES

    state = json.dumps({"quant_type": quant_type, "blocksize": FOUR_BIT_BLOCK, "dtype": str(weight.dtype)[6:],
                        "shape": list(weight.shape)}).encode()
    n, code = weight.numel, struct.pack("<16f", *CODES[quant_type])
    return [TensorSpec(weight.name, ((n + 1) // 2, 1), torch.uint8, f"codes-{quant_type}", 0.0, weight),
            TensorSpec(f"{weight.name}.absmax", (-(-n // FOUR_BIT_BLOCK),), torch.float32, "scales", 0.0, weight),
            TensorSpec(f"{weight.name}.quant_map", (16,), torch.float32, "const", 0.0, None, code),
            TensorSpec(f"{weight.name}.quant_state.bitsandbytes__{quant_type}", (len(state),), torch.uint8, "const",
                       0.0, None, state)]


def four_bit_weights(model: torch.nn.Module) -> set[str]:
    """The weights ``BitsAndBytesConfig(load_in_4bit=True)`` stores in 4 bits (transformers' own rule)."""
    from zinf.param.four_bit import convertible_linears

    return {f"{name}.weight" for name, _ in convertible_linears(model)}


def _specs_of(model: torch.nn.Module, dtype: torch.dtype, four_bit: str | None = None) -> list[TensorSpec]:
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported: expected one of {list(SAFETENSORS_DTYPES)}")
    state = model.state_dict(keep_vars=True)
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    kept = set()
    for names in groups.values():
        sources = [n for n in names if n not in tied_targets]
        kept.add(sources[0] if sources else names[0])
    std = float(getattr(model.config, "initializer_range", 0.02))
    quantized = four_bit_weights(model) if four_bit else set()
    specs = []
    for name, tensor in state.items():
        if name not in kept:
            continue
        if not tensor.is_floating_point():
            raise ValueError(f"{name} is a {tensor.dtype} tensor: only floating-point state is generated; "
                             "this script writes models whose state dict is floating point (Llama and the like)")
        module = model.get_submodule(name.rpartition(".")[0])
        if name.endswith("bias"):
            init = "zeros"
        elif "norm" in type(module).__name__.lower():
            init = "ones"
        else:
            init = "normal"
        spec = TensorSpec(name, tuple(tensor.shape), dtype, init, std)
        specs += _four_bit_parts(spec, four_bit) if four_bit and name in quantized else [spec]
    return specs


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[ShardPlan]:
    """Split as huggingface_hub's ``split_torch_state_dict_into_shards`` does: greedy in state-dict order, a new shard
    when the next tensor would pass ``max_shard_bytes``, a tensor larger than that alone in its own shard."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in specs:
        if spec.nbytes > max_shard_bytes:
            groups.append([spec])
            continue
        if current and current_bytes + spec.nbytes > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += spec.nbytes
    if current:
        groups.append(current)
    if len(groups) == 1:
        names = [SINGLE_FILE]
    else:
        names = [SHARD_FILE.format(index=i + 1, count=len(groups)) for i in range(len(groups))]
    return [ShardPlan(n, tuple(sorted(g, key=lambda s: s.name))) for n, g in zip(names, groups)]


def safetensors_header(tensors: Sequence[TensorSpec]) -> bytes:
    """The JSON header as the safetensors library writes it: compact, metadata first, tensors in data order, padded
    with spaces to a multiple of 8 bytes (the 8-byte little-endian length that precedes it is not included)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _chunk_seed(seed: int, name: str, chunk_index: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{name}\0{chunk_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def chunk_values(spec: TensorSpec, seed: int, chunk_index: int) -> torch.Tensor:
    """Elements ``[chunk_index * CHUNK_NUMEL, ...)`` of the flattened tensor, in ``spec.dtype``."""
    if spec.init == "const":
        return torch.frombuffer(bytearray(spec.payload), dtype=torch.uint8)
    if spec.source is not None:  # a 4-bit part: the codes or scales of the weight's chunk (blocks never straddle one)
        from zinf.native import four_bit
        from zinf.param.four_bit import CODES

        values = chunk_values(spec.source, seed, chunk_index)
        if spec.init == "scales":
            return four_bit.block_absmax(values, FOUR_BIT_BLOCK)
        return four_bit.encode(values, FOUR_BIT_BLOCK, CODES[spec.init.split("-")[1]])[0]
    begin = chunk_index * CHUNK_NUMEL
    count = min(CHUNK_NUMEL, spec.numel - begin)
    if spec.init == "ones":
        return torch.ones(count, dtype=spec.dtype)
    if spec.init == "zeros":
        return torch.zeros(count, dtype=spec.dtype)
    generator = torch.Generator().manual_seed(_chunk_seed(seed, spec.name, chunk_index))
    values = torch.randn(count, generator=generator, dtype=torch.float32).mul_(spec.std)
    return values.to(spec.dtype)


def parameters(specs: Sequence[TensorSpec]) -> int:
    """The model's parameters (a 4-bit weight counted once, by its elements)."""
    return sum(t.source.numel if t.init.startswith("codes") else t.numel for t in specs
               if t.init not in ("scales", "const"))


def num_chunks(spec: TensorSpec) -> int:
    if spec.init == "const":
        return 1
    return -(-(spec.source or spec).numel // CHUNK_NUMEL)


def tensor_values(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The whole tensor as written (for verification; holds the tensor)."""
    chunks = [chunk_values(spec, seed, i) for i in range(num_chunks(spec))]
    return torch.cat(chunks).reshape(spec.shape) if chunks else torch.empty(spec.shape, dtype=spec.dtype)


class _ChunkProducer:
    """Generates the chunks of ``specs`` in order on a thread, at most ``depth`` ahead of the writer."""

    _DONE = object()

    def __init__(self, specs: Sequence[TensorSpec], seed: int, depth: int = 2) -> None:
        self._specs = specs
        self._seed = seed
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="make_pretrained-generate", daemon=True)

    def __enter__(self) -> _ChunkProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _run(self) -> None:
        try:
            for spec in self._specs:
                for i in range(num_chunks(spec)):
                    if not self._put(chunk_values(spec, self._seed, i)):
                        return
        except BaseException as e:  # handed to the writer, which raises it
            self._put(e)
            return
        self._put(self._DONE)

    def next_chunk(self) -> torch.Tensor:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, torch.Tensor), "the producer ended before the writer"
        return item


def _check_out_dir(out_dir: Path, overwrite: bool) -> list[Path]:
    """Refuses a file or a non-empty directory unless ``overwrite``; returns the files a previous checkpoint left that
    will be deleted (shards, index, temporaries; ``config.json`` and the rest are replaced or kept)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"output directory {out_dir} is a file: choose a directory path")
    entries = sorted(out_dir.iterdir()) if out_dir.exists() else []
    if entries and not overwrite:
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise FileExistsError(f"output directory {out_dir} is not empty ({len(entries)} entries: {shown}); "
                              "pass --overwrite (overwrite=True) to replace the checkpoint there, or choose an "
                              "empty or new directory")
    return [p for p in entries if p.is_file() and _OWN_FILE.fullmatch(p.name)]


def _check_disk(out_dir: Path, needed_bytes: int, reclaimable_bytes: int) -> None:
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free_bytes = shutil.disk_usage(probe).free + reclaimable_bytes
    if needed_bytes > free_bytes:
        raise OSError(errno.ENOSPC, f"not enough free disk space for {out_dir}: the checkpoint needs {needed_bytes} "
                      f"bytes ({needed_bytes / 1e9:.2f} GB) and {free_bytes} bytes ({free_bytes / 1e9:.2f} GB) are "
                      "free there; free some space, choose another OUT_DIR, or a smaller --size/--dtype")


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    partial = path.with_name(_PARTIAL.format(name=path.name))
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):  # do not let 26 GB of written pages push everything else out of the cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def _progress_bar(total_bytes: int, enabled: bool) -> tqdm:
    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="writing", disable=not enabled,
                smoothing=0.1, mininterval=1.0)


def _index_text(shards: Sequence[ShardPlan]) -> str:
    weight_map = {t.name: s.file_name for s in shards for t in s.tensors}
    tensors = [t for s in shards for t in s.tensors]
    index = {"metadata": {"total_parameters": sum(t.numel for t in tensors),
                          "total_size": sum(t.nbytes for t in tensors)},
             "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def _save_json(path: Path, save_to_dir: Callable[[Path], object]) -> None:
    """Runs a ``save_pretrained`` of a config into a scratch directory, then renames its file into place."""
    scratch = path.with_name(_PARTIAL.format(name=path.name) + ".d")
    shutil.rmtree(scratch, ignore_errors=True)
    save_to_dir(scratch)
    os.replace(scratch / path.name, path)
    shutil.rmtree(scratch)


def write_pretrained(config: PretrainedConfig, out_dir: str | os.PathLike[str], *, dtype: torch.dtype = torch.bfloat16,
                     max_shard_bytes: int = 5 * 10**9, seed: int = 0, overwrite: bool = False,
                     progress: bool = True, four_bit: str | None = None) -> WriteSummary:
    """Writes the checkpoint of ``AutoModelForCausalLM.from_config(config)`` with generated values to ``out_dir``,
    streaming (see the module docstring). Refuses a non-empty ``out_dir`` unless ``overwrite`` and, before writing
    anything, a disk without room for the files."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this script writes native bytes and needs a "
                           "little-endian machine")
    out = Path(out_dir)
    stale = _check_out_dir(out, overwrite)
    model = _meta_model(config)
    if four_bit and CHUNK_NUMEL % FOUR_BIT_BLOCK:
        raise ValueError(f"CHUNK_NUMEL {CHUNK_NUMEL} is not a multiple of the 4-bit block, {FOUR_BIT_BLOCK}")
    shards = plan_shards(_specs_of(model, dtype, four_bit), max_shard_bytes)
    data_bytes = sum(s.file_bytes for s in shards)
    _check_disk(out, data_bytes + (1 << 20), sum(p.stat().st_size for p in stale))

    config = copy.deepcopy(config)
    config.dtype = dtype
    config.architectures = [type(model).__name__]
    if four_bit:  # what transformers writes for a bitsandbytes 4-bit model: from_pretrained reads it back as one
        from transformers import BitsAndBytesConfig

        config.quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=four_bit,
                                                        bnb_4bit_compute_dtype=dtype).to_dict()
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(stale, key=lambda p: p.name != INDEX_FILE):  # the index first: never an index without its files
        p.unlink()

    start = time.perf_counter()
    specs = [t for s in shards for t in s.tensors]
    with _progress_bar(data_bytes, progress) as bar, _ChunkProducer(specs, seed) as producer:
        for shard in shards:
            def write_shard(f: BinaryIO, shard: ShardPlan = shard) -> None:
                header = shard.header
                f.write(struct.pack("<Q", len(header)) + header)
                bar.update(8 + len(header))
                for spec in shard.tensors:
                    for _ in range(num_chunks(spec)):
                        chunk = producer.next_chunk()
                        f.write(chunk.view(torch.uint8).numpy().data)
                        bar.update(chunk.numel() * chunk.element_size())

            _write_atomic(out / shard.file_name, write_shard)
    if len(shards) > 1:
        text = _index_text(shards)
        _write_atomic(out / INDEX_FILE, lambda f: f.write(text.encode()))
    _save_json(out / "generation_config.json", GenerationConfig.from_model_config(config).save_pretrained)
    _save_json(out / "config.json", config.save_pretrained)
    seconds = time.perf_counter() - start

    files = tuple(s.file_name for s in shards) + ((INDEX_FILE,) if len(shards) > 1 else ()) + (
        "generation_config.json", "config.json")
    file_bytes = sum((out / f).stat().st_size for f in files)
    return WriteSummary(
        out_dir=str(out), num_parameters=parameters(specs), tensor_bytes=sum(t.nbytes for t in specs),
        file_bytes=file_bytes, files=files, seconds=seconds, write_gb_per_s=file_bytes / seconds / 1e9,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9, ``500MiB`` -> 500 * 2**20, ``1000`` -> 1000 (the units transformers' max_shard_size takes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not understood: write e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(m.group(1)) * scale)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--size", choices=sorted(PRESETS), default="tiny", help="shape preset (default tiny)")
    ap.add_argument("--layers", type=int, help="num_hidden_layers")
    ap.add_argument("--hidden", type=int, help="hidden_size")
    ap.add_argument("--intermediate", type=int, help="intermediate_size")
    ap.add_argument("--heads", type=int, help="num_attention_heads")
    ap.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    ap.add_argument("--vocab", type=int, help="vocab_size")
    ap.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bf16")
    ap.add_argument("--shard-size", default="5GB", help="largest shard, e.g. 5GB (1e9 bytes) or 4GiB (default 5GB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace a checkpoint in a non-empty OUT_DIR")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (parameters, bytes, files), write nothing")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--four-bit", choices=["nf4", "fp4"], help="write the linear weights as bitsandbytes saves a 4-bit "
                    "model (QLoRA's base; no double quantization)")
    args = ap.parse_args(argv)
    try:
        max_shard_bytes = parse_size(args.shard_size)
    except ValueError as e:
        ap.error(f"--shard-size: {e}")
    config = llama_config(args.size, num_hidden_layers=args.layers, hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, vocab_size=args.vocab)
    dtype = DTYPE_NAMES[args.dtype]
    if args.dry_run:
        shards = plan_shards(_specs_of(_meta_model(config), dtype, args.four_bit), max_shard_bytes)
        specs = [t for s in shards for t in s.tensors]
        print(f"{args.size} ({args.dtype}): {parameters(specs):,} parameters, "
              f"{sum(s.file_bytes for s in shards) / 1e9:.3f} GB in {len(shards)} file(s)")
        for s in shards:
            print(f"  {s.file_name}: {len(s.tensors)} tensors, {s.file_bytes / 1e9:.3f} GB")
        return 0
    try:
        summary = write_pretrained(config, args.out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                   seed=args.seed, overwrite=args.overwrite, progress=not args.no_progress,
                                   four_bit=args.four_bit)
    except (FileExistsError, NotADirectoryError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.out_dir}: {summary.num_parameters:,} parameters ({args.size}, {args.dtype}), "
          f"{summary.file_bytes / 1e9:.3f} GB in {len(summary.files)} files, {summary.seconds:.1f} s, "
          f"{summary.write_gb_per_s:.3f} GB/s, peak RSS {summary.peak_rss_bytes / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
