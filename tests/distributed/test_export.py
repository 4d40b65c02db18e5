"""save_safetensors: Hugging Face style files (sharded or single) that load back to the engine's full state dict."""

from __future__ import annotations

from typing import Any

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, batches, build, make_optimizer
from zinf.checkpoint import save_safetensors
from zinf.checkpoint.export import INDEX, SINGLE, parse_size
from zinf.param.flat_group import FlatParamGroup

pytestmark = pytest.mark.distributed

TIED = {"lm_head.weight": "wte.weight"}


def _trained_gpt(rank: int, world: int, steps: int = 2) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    config = zinf.ZeroConfig()
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    for x, y in batches("gpt", steps, 4):  # trained values, not the initialisation
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
    return engine


def _exports(rank: int, world: int, root: str, runs: list[tuple[str, dict]]) -> dict:
    """Export the same trained model once per run (``directory``, keyword arguments) in order."""
    engine = _trained_gpt(rank, world)
    full = engine.full_state_dict()
    out = []
    for directory, kwargs in runs:
        paths = save_safetensors(engine, Path(root) / directory, **kwargs)
        listing = sorted(p.name for p in (Path(root) / directory).iterdir()) if rank == 0 else []
        out.append({"paths": [p.name for p in paths], "listing": listing})
    return {"full": full if rank == 0 else None, "runs": out}


def _read_export(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[set[str]]]:
    """The tensors (tied aliases restored), the alias map, and which names each file holds."""
    if (directory / INDEX).exists():
        index = json.loads((directory / INDEX).read_text())
        metadata, files = index["metadata"], sorted(set(index["weight_map"].values()))
    else:
        with safe_open(str(directory / SINGLE), framework="pt") as f:
            metadata, files = f.metadata(), [SINGLE]
        assert metadata["format"] == "pt"
    tensors, per_file = {}, []
    for name in files:
        part = load_file(str(directory / name))
        assert not set(part) & set(tensors), f"{name} repeats a tensor"
        tensors.update(part)
        per_file.append(set(part))
    if (directory / INDEX).exists():
        assert index["weight_map"] == {n: f for f, names in zip(files, per_file) for n in names}
        assert metadata["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    tied = json.loads(metadata.get("zinf_tied", "{}"))
    for alias, kept in tied.items():
        tensors[alias] = tensors[kept]
    return tensors, tied, per_file


def _check_loads(tensors: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    assert set(tensors) == set(full)
    for k, v in full.items():
        assert torch.equal(tensors[k], v), k
    plain = build("gpt")
    missing, unexpected = plain.load_state_dict(tensors, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, full[k]), k


def _shards(world: int, tmp_path: Path) -> None:
    runs = [("out", {"max_shard_size": "20KB"}),   # several shards
            ("out", {"max_shard_size": "60KB"}),   # fewer: the extra ones of the first export must go
            ("out", {"max_shard_size": "1MB"}),    # one file: the shards and the index must go
            ("out", {"max_shard_size": 20_000}),   # shards again: the single file must go
            ("big", {"max_shard_size": "10KB"}),   # several tensors are bigger than the limit
            ("bf16", {"max_shard_size": "8KiB", "dtype": torch.bfloat16})]
    results = run_distributed(_exports, world, str(tmp_path), runs)
    assert all(r["runs"] == [{"paths": [], "listing": []}] * len(runs) for r in results[1:]), "only rank 0 writes"
    full, (many, fewer, single, again, big, bf16) = results[0]["full"], results[0]["runs"]

    n = len(many["paths"]) - 1
    assert n > 2 and many["paths"][-1] == INDEX
    assert many["listing"] == sorted([f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + [INDEX])
    assert 1 < len(fewer["paths"]) - 1 < n and sorted(fewer["paths"]) == fewer["listing"], fewer
    assert single["paths"] == single["listing"] == [SINGLE]
    assert sorted(again["paths"]) == again["listing"] == many["listing"]

    tensors, tied, per_file = _read_export(tmp_path / "out")
    assert tied == TIED and "lm_head.weight" not in set().union(*per_file), "a tied weight is written once"
    _check_loads(tensors, full)
    for names in per_file:  # greedy: full files stay within the limit (20 000 bytes)
        assert sum(full[k].numel() * 4 for k in names) <= 20_000

    tensors, _, per_file = _read_export(tmp_path / "big")
    _check_loads(tensors, full)
    for names in per_file:
        size = sum(full[k].numel() * 4 for k in names)
        assert size <= 10_000 or len(names) == 1, f"a tensor above the limit shares its file: {names}"
    above = {k for k in full if k not in TIED and full[k].numel() * 4 > 10_000}
    assert len(above) == 7 and above == {next(iter(names)) for names in per_file if len(names) == 1} & above

    tensors, tied, per_file = _read_export(tmp_path / "bf16")
    assert tied == TIED and all(sum(tensors[k].numel() * 2 for k in names) <= 8192 or len(names) == 1
                                for names in per_file)
    for k, v in full.items():
        assert tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v.to(torch.bfloat16)), k


@pytest.mark.parametrize("world", [1, 2])
def test_export_matches_full_state_dict(tmp_path: Path, world: int) -> None:
    _shards(world, tmp_path)


def test_single_file_prefix_and_buffers(tmp_path: Path) -> None:
    """One process: a model rooted under "module." (as the Lightning adapter does) with buffers."""
    torch.manual_seed(0)
    with zinf.Init():
        gpt = GPT(GPTConfig())
    gpt.register_buffer("steps", torch.arange(3))
    gpt.register_buffer("scale", torch.full((4,), 0.3))
    gpt.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in state_dict(): not exported
    root = nn.Module()
    root.module = gpt
    engine = zinf.initialize(root)
    full = {k.removeprefix("module."): v for k, v in engine.full_state_dict().items() if not k.endswith("scratch")}

    paths = save_safetensors(engine, tmp_path / "hf", prefix="module.", dtype=torch.bfloat16)
    assert paths == [tmp_path / "hf" / SINGLE]
    with safe_open(str(paths[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "zinf_tied": json.dumps(TIED)}
    tensors = load_file(str(paths[0]))
    assert set(tensors) == set(full) - set(TIED)
    assert tensors["steps"].dtype == torch.int64 and torch.equal(tensors["steps"], torch.arange(3))
    for k in tensors:
        assert torch.equal(tensors[k], full[k].to(tensors[k].dtype)), k
        assert tensors[k].dtype == (torch.int64 if k == "steps" else torch.bfloat16), k


def test_shards_are_written_while_gathering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed: a shard is on disk before the later groups are gathered (the model is never whole in memory)."""
    engine = _trained_gpt(0, 1)
    seen: list[int] = []
    import zinf.checkpoint.export as export

    gather = export.gather_full_master

    def counting(comm: Any, group: FlatParamGroup, master: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(len(list((tmp_path / "hf").glob("model-*.safetensors"))))
        return gather(comm, group, master)

    monkeypatch.setattr(export, "gather_full_master", counting)
    paths = save_safetensors(engine, tmp_path / "hf", max_shard_size="20KB")
    assert len(seen) == len(engine.groups) and seen[0] == 0 and seen[-1] == len(paths) - 2, seen
    assert seen == sorted(seen)


def test_bad_arguments_name_the_fix(tmp_path: Path) -> None:
    assert parse_size("500KB") == 500_000 and parse_size("5MB") == 5_000_000 and parse_size("10GB") == 10**10
    assert parse_size("2KiB") == 2048 and parse_size("1GiB") == 2**30 and parse_size(123) == 123
    torch.manual_seed(0)
    with zinf.Init():
        model = nn.Linear(4, 3)
    engine = zinf.initialize(model)
    for bad in ("5XB", "ten GB", "", -1, 0, 1.5):
        with pytest.raises(ValueError, match=r"max_shard_size=.*'500KB'.*'1GiB'"):
            save_safetensors(engine, tmp_path / "x", max_shard_size=bad)
    with pytest.raises(ValueError, match="floating-point"):
        save_safetensors(engine, tmp_path / "x", dtype=torch.int8)
    target = tmp_path / "a_file"
    target.write_text("not a directory")
    with pytest.raises(ValueError, match=f"{target}.*not a directory"):
        save_safetensors(engine, target)
    assert not (tmp_path / "x").exists(), "a refused call writes nothing"


def _into_file(rank: int, world: int, target: str) -> str:
    engine = _trained_gpt(rank, world, steps=0)
    try:
        save_safetensors(engine, target)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "written"


def test_rank0_failure_raises_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 cannot write: every rank raises (none is left waiting in a gather)."""
    target = tmp_path / "a_file"
    target.write_text("not a directory")
    first, second = run_distributed(_into_file, 2, str(target))
    assert first.startswith("ValueError") and "not a directory" in first
    assert second.startswith("ZinfError") and "rank 0 failed" in second
