"""A sharded checkpoint as model files, from the files alone (``zinf consolidate``): one torch file, a directory of
safetensors or torch shards, or the Hugging Face layout that ``from_pretrained`` loads.

The tensors stream from the checkpoint's parts one group at a time (:func:`zinf.checkpoint.iter_state`) into the
model-file writer shared with the live export (see [Note: model files] in zinf/checkpoint/shard_writer.py), which
plans the files from the names and shapes the checkpoint records before any tensor is read. Memory: one group, plus
one output shard for torch files (a safetensors shard is written tensor by tensor); a single torch file (OUT ending
in .pt, .pth or .bin) is one shard, so it holds the whole model.

A directory is built under a temporary sibling name (``.OUT.zinf-partial``) and moved into place when complete;
a single file is written as ``OUT.tmp`` then renamed. A failed or killed run leaves OUT as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zinf.checkpoint.config_match import check_config_matches
from zinf.checkpoint.shard_writer import SAFETENSORS, TORCH, FileLayout, ShardWriter, parse_size, plan_shards
from zinf.checkpoint.sharded import iter_state, state_specs
from zinf.errors import CheckpointError, ConfigError

__all__ = ["export_checkpoint", "resolve_target", "Target", "Exported", "FORMATS", "DTYPES", "DEFAULT_MAX_SHARD_SIZE"]

log = logging.getLogger("zinf")

FORMATS = ("torch", "safetensors", "hf")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
FILE_SUFFIXES = (".pt", ".pth", ".bin")
CONFIG = "config.json"
COMMIT = "commit.json"  # names a checkpoint's current save (zinf/checkpoint/commit_record.py)
CONFIG_FILES = (CONFIG, "generation_config.json")  # what --config DIR copies (config.json required)
_PARTIAL = ".zinf-partial"


@dataclass(frozen=True)
class Target:
    """What to write, checked: OUT, the file layout, one file or a directory, dtype, shard limit, config files."""

    out: Path
    layout: FileLayout
    single_file: bool
    dtype: torch.dtype | None
    limit_bytes: int
    config_files: dict[str, Path]  # name in OUT -> source


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or (isinstance(value, torch.dtype) and value in DTYPES.values()):
        return value
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise ConfigError(f"zinf consolidate: --dtype {value!r} is not a dtype it writes. Pass fp32, bf16 or fp16 "
                      "(parameters and floating-point buffers are cast; integer buffers keep their dtype).")


def _config_files(config: str | os.PathLike) -> dict[str, Path]:
    path = Path(config)
    if not path.exists():
        raise ConfigError(f"zinf consolidate: --config {str(path)!r} does not exist. Pass the model's config.json, "
                          "or the directory holding it (e.g. the directory the model was loaded from).")
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise ConfigError(f"zinf consolidate: --config {str(path)!r} is a directory without {CONFIG}. Pass the "
                              "model's config.json, or the directory holding it.")
        files = {name: path / name for name in CONFIG_FILES if (path / name).is_file()}
    else:
        files = {CONFIG: path}
    try:
        if not isinstance(json.loads(files[CONFIG].read_text()), dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"zinf consolidate: --config {str(files[CONFIG])!r} is not a model config (a JSON object): "
                          f"{exc}. Pass the model's config.json.") from None
    return files


def _checkpoint_below(path: Path) -> Path | None:
    """A direct subdirectory of ``path`` holding a zinf checkpoint, where ``path`` itself has none."""
    if not path.is_dir() or (path / COMMIT).exists():
        return None
    found = sorted(p for p in path.iterdir() if p.is_dir() and (p / COMMIT).is_file())
    return next((p for p in found if p.name == "zinf_model"), found[0] if found else None)


def _is_own(name: str) -> bool:
    """A file an export writes (so an earlier export's files may be replaced)."""
    return SAFETENSORS.is_own(name) or TORCH.is_own(name) or name in CONFIG_FILES


def resolve_target(out: str | os.PathLike, *, format: str | None = None, dtype: str | torch.dtype | None = None,
                   max_shard_size: int | str | None = None, config: str | os.PathLike | None = None) -> Target:
    """Check the options against each other and against what is at ``out``; raise ConfigError naming the option
    and the fix. See ``zinf consolidate --help`` for the rules."""
    out = Path(out)
    if format is not None and format not in FORMATS:
        raise ConfigError(f"zinf consolidate: --format {format!r} is not one of {', '.join(FORMATS)}.")
    written = _dtype(dtype)
    if out.suffix == ".safetensors":
        raise ConfigError(f"zinf consolidate: OUT {str(out)!r} names a .safetensors file, but safetensors output is a "
                          "directory (model.safetensors, or shards and an index). Pass a directory path as OUT.")
    single = out.suffix in FILE_SUFFIXES
    if single:
        if format not in (None, "torch"):
            raise ConfigError(f"zinf consolidate: --format {format} writes a directory, but OUT {str(out)!r} ends in "
                              f"{out.suffix} (one torch file). Pass a directory path as OUT, or drop --format.")
        for option, value in (("--max-shard-size", max_shard_size), ("--config", config)):
            if value is not None:
                raise ConfigError(f"zinf consolidate: {option} needs a directory as OUT, but {str(out)!r} ends in "
                                  f"{out.suffix} (one torch file). Pass a directory path as OUT (e.g. --format "
                                  f"{'hf' if option == '--config' else 'torch'}), or drop {option}.")
        if out.is_dir():
            raise ConfigError(f"zinf consolidate: OUT {str(out)!r} is a directory, but a name ending in {out.suffix} "
                              "asks for one torch file. Pass a file path, or --format safetensors|hf|torch for a "
                              "directory.")
        return Target(out, TORCH, True, written, 1 << 62, {})

    format = format or ("hf" if config is not None else "safetensors")
    if format == "hf" and config is None:
        raise ConfigError("zinf consolidate: --format hf needs --config PATH: the model's config.json, or the "
                          "directory holding it (and generation_config.json), so that from_pretrained can build the "
                          "model. For the weights alone use --format safetensors.")
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size,
                       "zinf consolidate: --max-shard-size")
    files = _config_files(config) if config is not None else {}
    if out.exists() and not out.is_dir():
        raise ConfigError(f"zinf consolidate: OUT {str(out)!r} exists and is a file; --format {format} writes a "
                          "directory. Pass a directory path (created when missing), or remove the file.")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if not (p.is_file() and _is_own(p.name)))
        if other:
            raise ConfigError(f"zinf consolidate: OUT {str(out)!r} already holds files it would not write "
                              f"({', '.join(other[:5])}{', ...' if len(other) > 5 else ''}). Pass a new or empty "
                              "directory (one holding only an earlier export's files is replaced).")
    return Target(out, TORCH if format == "torch" else SAFETENSORS, False, written, limit, files)


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote: the files (weights, the index last, then config files), the number of
    names they hold, and the weights' bytes."""

    files: list[Path]
    num_tensors: int
    num_bytes: int


class _Progress:
    """A log line each time another tenth of the bytes is written."""

    def __init__(self, total_bytes: int, num_tensors: int) -> None:
        self.total_bytes, self.num_tensors = total_bytes, num_tensors
        self.step_bytes = max(total_bytes // 10, 1)
        self.next_bytes = self.step_bytes
        self.start = time.monotonic()
        self.num_done = 0

    def advance(self, written_bytes: int) -> None:
        self.num_done += 1
        if written_bytes >= self.next_bytes and written_bytes < self.total_bytes:
            log.info("zinf consolidate: %d of %d tensors, %s of %s (%d%%), %.0f s", self.num_done, self.num_tensors,
                     _size(written_bytes), _size(self.total_bytes), 100 * written_bytes // self.total_bytes,
                     time.monotonic() - self.start)
            self.next_bytes = (written_bytes // self.step_bytes + 1) * self.step_bytes


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _write_config(files: dict[str, Path], directory: Path, dtype: torch.dtype) -> None:
    """Copy the config files; config.json's ``dtype`` says what the weights were written in (as save_pretrained)."""
    for name, source in files.items():
        if name != CONFIG:
            shutil.copyfile(source, directory / name)
            continue
        config = json.loads(source.read_text())
        written = str(dtype).removeprefix("torch.")
        config["dtype"] = written
        if "torch_dtype" in config:
            config["torch_dtype"] = written
        (directory / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _move_into_place(staging: Path, out: Path) -> None:
    if not out.exists():
        os.rename(staging, out)
        return
    for path in out.iterdir():  # resolve_target allowed only an earlier export's files here
        if path.is_file() and _is_own(path.name):
            path.unlink()
    for path in staging.iterdir():
        os.replace(path, out / path.name)
    staging.rmdir()


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *, format: str | None = None,
                      dtype: str | torch.dtype | None = None, max_shard_size: int | str | None = None,
                      config: str | os.PathLike | None = None, allow_pickle: bool = False) -> "Exported":
    """Write the current save in ``checkpoint`` to ``out`` (see ``zinf consolidate --help``); no process group
    needed. Options are checked (:func:`resolve_target`) before anything is read or written. Only the record and
    the tensors are read (never the client state); ``allow_pickle`` opens parts of the earlier, pickled format."""
    target = resolve_target(out, format=format, dtype=dtype, max_shard_size=max_shard_size, config=config)
    try:
        specs, tied = state_specs(checkpoint, allow_pickle=allow_pickle)
    except CheckpointError as exc:
        inner = _checkpoint_below(Path(checkpoint))
        if inner is None:
            raise
        raise CheckpointError(f"{exc} Did you mean {inner}? It holds a zinf checkpoint (Accelerate's save_state "
                              "writes the engine's under zinf_model); pass that directory as CKPT.") from None
    if CONFIG in target.config_files:  # from_pretrained(OUT) builds the model from it: the names and shapes must fit
        check_config_matches(target.config_files[CONFIG], specs, tied)
    hint = " The checkpoint's record is inconsistent; consolidate it with the zinf that wrote it."
    plan = plan_shards(specs, tied, target.limit_bytes, target.dtype, duplicate_hint=hint)
    log.info("zinf consolidate: %s -> %s: %d tensors, %s, %d %s file(s)", checkpoint, target.out, len(plan.specs),
             _size(plan.total_bytes), len(plan.shards), target.layout.format)
    target.out.parent.mkdir(parents=True, exist_ok=True)
    if target.single_file:
        directory = target.out.parent
    else:
        directory = target.out.parent / f".{target.out.name}{_PARTIAL}"
        if directory.exists():  # left by a killed run
            shutil.rmtree(directory)
        directory.mkdir()
    writer = ShardWriter(plan, directory, target.layout, single_file=target.out if target.single_file else None)
    progress = _Progress(plan.total_bytes, len(plan.specs))
    try:
        with torch.no_grad():
            for name, value in iter_state(checkpoint, allow_pickle=allow_pickle):
                if name in tied:  # the writer places a tied weight's other names itself
                    continue
                writer.add(name, value)
                del value
                progress.advance(writer.written_bytes)
        written = writer.finish()
        if not target.single_file:
            _write_config(target.config_files, directory, target.dtype or torch.float32)
            _move_into_place(directory, target.out)
            written = [target.out / p.name for p in written] + [target.out / n for n in target.config_files]
    except BaseException:
        writer.abort()
        if not target.single_file:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    log.info("zinf consolidate: wrote %d file(s), %s, to %s in %.1f s", len(written), _size(plan.total_bytes),
             target.out, time.monotonic() - progress.start)
    names = len(plan.specs) + (len(tied) if target.layout is TORCH else 0)  # a torch file keeps every tied name
    return Exported(written, names, plan.total_bytes)
