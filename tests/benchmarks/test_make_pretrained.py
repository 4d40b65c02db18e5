"""benchmarks/make_pretrained.py: the streamed checkpoint is what transformers writes and loads, value for value and
byte for byte, and bad output directories are refused before anything is written."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import make_pretrained as mp  # noqa: E402

SHARD_BYTES = 20_000  # the tiny bf16 model is 181 kB: a dozen shards


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1000 elements, so tensors span several chunks and end on a partial one."""
    monkeypatch.setattr(mp, "CHUNK_NUMEL", 1000)


def tiny(tie: bool = False):
    return mp.llama_config("tiny", tie_word_embeddings=tie)


def written(tmp_path: Path, tie: bool = False, **kwargs: object) -> tuple[Path, mp.WriteSummary]:
    out = tmp_path / "ckpt"
    summary = mp.write_pretrained(tiny(tie), out, max_shard_bytes=SHARD_BYTES, seed=3, progress=False, **kwargs)
    return out, summary


def shard_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_loads_with_the_written_values(tmp_path: Path, tie: bool) -> None:
    out, summary = written(tmp_path, tie)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info

    on_disk = shard_tensors(out)
    specs = mp.tensor_specs(tiny(tie))
    assert on_disk.keys() == {s.name for s in specs}
    state = model.state_dict()
    for spec in specs:
        regenerated = mp.tensor_values(spec, seed=3)
        assert on_disk[spec.name].dtype == torch.bfloat16 and torch.equal(on_disk[spec.name], regenerated)
        assert torch.equal(state[spec.name], regenerated.float()), spec.name
    if tie:
        assert "lm_head.weight" not in on_disk
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    else:
        assert not torch.equal(state["lm_head.weight"][:, :64], state["model.embed_tokens.weight"][:, :64])
    assert {s.init for s in specs} == {"normal", "ones"}
    assert all(torch.all(state[s.name] == 1) for s in specs if s.name.endswith("norm.weight"))
    assert 0.015 < float(state["model.embed_tokens.weight"].std()) < 0.025

    assert summary.num_parameters == sum(p.numel() for p in model.parameters())
    assert summary.tensor_bytes == 2 * summary.num_parameters
    assert len([f for f in summary.files if f.endswith(".safetensors")]) > 5
    assert sorted(summary.files) == sorted(p.name for p in out.iterdir())  # no temporaries left
    assert summary.seconds > 0 and summary.peak_rss_bytes > 0


def from_config_with_values(out: Path, tie: bool) -> torch.nn.Module:
    """A model built from its config (not from_pretrained) holding the written values, in bf16."""
    model = AutoModelForCausalLM.from_config(tiny(tie)).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(shard_tensors(out), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tie else [])
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_same_files_as_save_pretrained(tmp_path: Path, tie: bool) -> None:
    """transformers' own save of a model built from the config and holding those values gives the same files,
    byte for byte: shard names and contents, index, configs."""
    out, _ = written(tmp_path, tie)
    reference = tmp_path / "reference"
    from_config_with_values(out, tie).save_pretrained(reference, max_shard_size=SHARD_BYTES)

    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for f in sorted(reference.iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_same_tensors_as_save_pretrained_after_from_pretrained(tmp_path: Path) -> None:
    """A model that came from from_pretrained is saved by transformers 5 with its keys in natural sort order
    (revert_weight_conversion sorts them), so lm_head.weight lands in the first shard: other shards, same tensors."""
    out, _ = written(tmp_path)
    reference = tmp_path / "reference"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    model.save_pretrained(reference, max_shard_size=SHARD_BYTES)

    index, ref_index = (json.loads((d / mp.INDEX_FILE).read_text()) for d in (out, reference))
    assert index["metadata"] == ref_index["metadata"] and index["weight_map"].keys() == ref_index["weight_map"].keys()
    ours, theirs = shard_tensors(out), shard_tensors(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(ours[k].dtype == theirs[k].dtype == torch.bfloat16 for k in ours)


def test_one_file_when_it_fits(tmp_path: Path) -> None:
    out = tmp_path / "one"
    summary = mp.write_pretrained(tiny(), out, max_shard_bytes=10**9, progress=False)
    assert summary.files == ("model.safetensors", "generation_config.json", "config.json")
    from_config_with_values(out, tie=False).save_pretrained(tmp_path / "ref")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = mp.write_pretrained(tiny(), tmp_path / "a", max_shard_bytes=SHARD_BYTES, seed=1, progress=False)
    mp.write_pretrained(tiny(), tmp_path / "b", max_shard_bytes=SHARD_BYTES, seed=1, progress=False)
    mp.write_pretrained(tiny(), tmp_path / "c", max_shard_bytes=SHARD_BYTES, seed=2, progress=False)
    shard = a.files[0]
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


def test_forward_gives_a_finite_loss(tmp_path: Path) -> None:
    out, _ = written(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and 3.0 < float(loss) < 7.0  # about log(128) = 4.85 for near-random weights


def test_an_interrupted_run_leaves_no_complete_looking_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = mp.chunk_values

    def failing(spec: mp.TensorSpec, seed: int, chunk_index: int) -> torch.Tensor:
        if spec.name == "model.layers.1.self_attn.q_proj.weight" and chunk_index == 2:
            raise RuntimeError("interrupted")
        return real(spec, seed, chunk_index)

    monkeypatch.setattr(mp, "chunk_values", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        written(tmp_path)
    assert not any(t.name == "make_pretrained-generate" for t in threading.enumerate())  # the generator stopped
    out = tmp_path / "ckpt"
    left = sorted(p.name for p in out.iterdir())
    assert left == [f"model-0000{i}-of-00012.safetensors" for i in range(1, 7)]  # the shards completed before
    with pytest.raises(ValueError, match="Unrecognized model"):  # no config.json: not a checkpoint
        AutoModelForCausalLM.from_pretrained(out)
    monkeypatch.setattr(mp, "chunk_values", real)
    written(tmp_path, overwrite=True)
    AutoModelForCausalLM.from_pretrained(out)


def test_non_empty_directory_refused(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not empty \(1 entries: notes.txt\); pass --overwrite"):
        mp.write_pretrained(tiny(), out, progress=False)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    # --overwrite replaces a checkpoint: stale shards of a bigger one go, the user's other files stay
    mp.write_pretrained(tiny(), out, max_shard_bytes=SHARD_BYTES // 2, overwrite=True, progress=False)
    summary = mp.write_pretrained(tiny(), out, max_shard_bytes=SHARD_BYTES, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(summary.files + ("notes.txt",))
    AutoModelForCausalLM.from_pretrained(out)


def test_not_enough_disk_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    out = tmp_path / "new" / "ckpt"
    needed = sum(s.file_bytes for s in mp.plan_shards(mp.tensor_specs(tiny()), SHARD_BYTES)) + (1 << 20)
    with pytest.raises(OSError, match=rf"needs {needed} bytes \(.* GB\) and 1000 bytes \(0.00 GB\) are free"):
        mp.write_pretrained(tiny(), out, max_shard_bytes=SHARD_BYTES, progress=False)
    assert not (tmp_path / "new").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert mp.main([str(out), "--size", "tiny", "--layers", "1", "--shard-size", "20kB", "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert "parameters (tiny, bf16)" in capsys.readouterr().out
    assert mp.main([str(out), "--size", "tiny"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert mp.parse_size("5GB") == 5 * 10**9 and mp.parse_size("2GiB") == 2 << 30 and mp.parse_size("1000") == 1000
    with pytest.raises(ValueError, match="write e.g. 5GB"):
        mp.parse_size("5 gigs")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_four_bit_checkpoint_is_what_bitsandbytes_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        quant_type: str) -> None:
    """``--four-bit``: transformers with bitsandbytes loads the files as a 4-bit model, and each weight is
    bitsandbytes' own quantization of the values the bf16 checkpoint would hold (chunks of 1024 elements: blocks
    never straddle one)."""
    bnb = pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(mp, "CHUNK_NUMEL", 1024)
    out, summary = written(tmp_path, four_bit=quant_type)
    plain = mp.tensor_specs(tiny())
    assert summary.num_parameters == sum(t.numel for t in plain)
    model = AutoModelForCausalLM.from_pretrained(out)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 14 and model.is_loaded_in_4bit
    for spec in plain:
        name = spec.name.removesuffix(".weight")
        if name in layers:
            w = layers[name].weight
            codes, state = bnb.functional.quantize_4bit(mp.tensor_values(spec, 3), blocksize=64, quant_type=quant_type)
            assert torch.equal(w.data.reshape(-1), codes.reshape(-1)), spec.name
            assert torch.equal(w.quant_state.absmax, state.absmax), spec.name
        else:
            assert torch.equal(model.state_dict()[spec.name], mp.tensor_values(spec, 3)), spec.name
