"""``zinf consolidate`` (zinf/checkpoint/convert.py): every output format holds the engine's full state (tied
weights once in safetensors and under every name in torch files, tiled layers untiled, integer buffers uncast);
a rerun replaces an earlier export; a failure leaves OUT as it was; and the memory of a consolidation stays far
below the model's size (one group at a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import zinf
from models import build
from zinf.checkpoint.shard_writer import ShardWriter
from zinf.cli import main
from zinf.tiling import TiledLinear

TIED = {"lm_head.weight": "wte.weight"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPT with tied embeddings, a tiled layer and an integer buffer, checkpointed on one process."""
    torch.manual_seed(0)
    model = build("gpt")
    model.extra = TiledLinear(8, 6, tiles=(2, 3))
    model.register_buffer("steps", torch.arange(3))
    engine = zinf.initialize(model)
    path = tmp_path_factory.mktemp("consolidate") / "ckpt"
    engine.save_checkpoint(str(path))
    full = engine.full_state_dict()
    engine.close()
    assert "extra.weight" in full and TIED.keys() <= full.keys()
    return path, full


def _read_dir(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a directory output (safetensors or torch; sharded or not) and its index (or {})."""
    index_file = next(iter([*out.glob("*.index.json")]), None)
    index = json.loads(index_file.read_text()) if index_file else {}
    files = sorted(set(index["weight_map"].values())) if index else [p.name for p in out.iterdir()
                                                                     if p.suffix in (".safetensors", ".bin")]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(out / name) if name.endswith(".safetensors") else torch.load(out / name, weights_only=True)
        assert not set(part) & set(tensors), f"{name} repeats a tensor"
        tensors.update(part)
    if index:
        assert set(index["weight_map"]) == set(tensors)
    return tensors, index


def test_every_format_holds_the_full_state(checkpoint, tmp_path: Path) -> None:
    path, full = checkpoint
    kept = {k: v for k, v in full.items() if k not in TIED}

    assert main(["consolidate", str(path), str(tmp_path / "st"), "--max-shard-size", "20KB", "-q"]) == 0
    tensors, index = _read_dir(tmp_path / "st")
    assert len(index["weight_map"]) == len(kept) and json.loads(index["metadata"]["zinf_tied"]) == TIED
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in kept.values())
    assert set(tensors) == set(kept) and all(torch.equal(tensors[k], v) for k, v in kept.items())

    # torch shards in fp16: every name (the tied one shares its storage), the integer buffer keeps int64
    assert main(["consolidate", str(path), str(tmp_path / "pt"), "--format", "torch", "--dtype", "fp16",
                 "--max-shard-size", "30KB", "-q"]) == 0
    tensors, index = _read_dir(tmp_path / "pt")
    assert (tmp_path / "pt" / "pytorch_model.bin.index.json").exists() and len(set(index["weight_map"].values())) > 1
    assert set(tensors) == set(full) and tensors["steps"].dtype == torch.int64
    assert all(torch.equal(tensors[k], v.to(tensors[k].dtype)) for k, v in full.items())
    assert tensors["extra.weight"].dtype == torch.float16 and tensors["extra.weight"].shape == (6, 8)
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["wte.weight"]

    # one torch file: an ordinary state_dict that the untiled model loads strictly
    assert main(["consolidate", str(path), str(tmp_path / "one.pt"), "-q"]) == 0
    state = torch.load(tmp_path / "one.pt", weights_only=True)
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    plain = build("gpt")
    plain.extra = nn.Linear(8, 6)
    plain.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    plain.load_state_dict(state)
    assert all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())

    # a rerun into the same directory replaces the earlier export (fewer files: the extra shards go)
    assert main(["consolidate", str(path), str(tmp_path / "st"), "--dtype", "bf16", "-q"]) == 0
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["model.safetensors"]
    with safe_open(str(tmp_path / "st" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "zinf_tied": json.dumps(TIED)}
    tensors, _ = _read_dir(tmp_path / "st")
    assert all(torch.equal(tensors[k], v.to(tensors[k].dtype)) for k, v in kept.items())
    assert not list(tmp_path.glob(".*zinf-partial")) and not list(tmp_path.rglob("*.tmp"))


def test_a_failed_consolidation_leaves_out_as_it_was(checkpoint, tmp_path: Path, monkeypatch) -> None:
    path, _ = checkpoint
    out, single = tmp_path / "out", tmp_path / "one.pt"
    assert main(["consolidate", str(path), str(out), "--max-shard-size", "20KB", "-q"]) == 0
    assert main(["consolidate", str(path), str(single), "-q"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    single_before = single.read_bytes()

    calls = []
    add = ShardWriter.add

    def failing(self: ShardWriter, name: str, value: torch.Tensor) -> None:
        calls.append(name)
        if len(calls) == 12:  # after some shards are complete
            raise OSError(28, "No space left on device")
        add(self, name, value)

    monkeypatch.setattr(ShardWriter, "add", failing)
    assert main(["consolidate", str(path), str(out), "--max-shard-size", "5KB", "--dtype", "bf16", "-q"]) == 1
    calls.clear()
    assert main(["consolidate", str(path), str(single), "--dtype", "bf16", "-q"]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert single.read_bytes() == single_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.pt", "out"], "no temporary file or directory is left"


_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _peak_rss_bytes(*cmd: str) -> int:
    """The peak resident memory of ``cmd``, the only child of a fresh wrapper process."""
    done = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return int(done.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


@pytest.mark.slow
def test_consolidation_memory_stays_far_below_the_model_size(tmp_path: Path) -> None:
    """A 403 MB (fp32) model of 24 groups: the command grows by a few groups beyond its imports, not by the model."""
    torch.manual_seed(0)
    with zinf.Init():
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(24)])
    engine = zinf.initialize(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    group_bytes = max(g.numel * 4 for g in engine.groups)
    assert len(engine.groups) >= 24 and model_bytes > 400e6
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    del engine, model

    baseline = _peak_rss_bytes(sys.executable, "-c", "import zinf, zinf.cli, torch, safetensors")
    out = tmp_path / "out"
    peak = _peak_rss_bytes(sys.executable, "-m", "zinf.cli", "consolidate", str(tmp_path / "ckpt"), str(out),
                           "--max-shard-size", "100MB", "-q")
    grown = peak - baseline
    print(f"consolidate of a {model_bytes / 1e6:.0f} MB model ({group_bytes / 1e6:.0f} MB groups): peak RSS "
          f"{peak / 1e6:.0f} MB, import baseline {baseline / 1e6:.0f} MB, grown {grown / 1e6:.0f} MB")
    assert grown < min(model_bytes / 4, 6 * group_bytes), (peak, baseline, model_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == model_bytes and len(set(index["weight_map"].values())) == 5
    name, expected = next(iter(zinf.checkpoint.iter_state(tmp_path / "ckpt")))  # one group, not the whole model
    with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
        assert name == "0.weight" and torch.equal(f.get_tensor(name), expected)
