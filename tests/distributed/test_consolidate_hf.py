"""``zinf consolidate --format hf``: a transformers Llama with tied embeddings, trained a step under zinf on 2 gloo
ranks and checkpointed, comes out as files that ``AutoModelForCausalLM.from_pretrained`` loads with no missing,
unexpected or mismatched keys, holding the engine's weights: fp32 exactly, bf16 as the fp32 weights cast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zinf
from dist_utils import run_distributed
from models import save_llama, token_batches
from zinf.cli import main

pytestmark = pytest.mark.distributed


def _train_and_save(rank: int, world: int, source: str, ckpt: str) -> dict[str, torch.Tensor] | None:
    from transformers import AutoModelForCausalLM

    config = zinf.ZeroConfig()
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    x = token_batches(1, 4)[0].chunk(world)[rank]
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(ckpt)
    full = engine.full_state_dict()
    engine.close()
    return full if rank == 0 else None


def _load(out: Path) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype="auto", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied again from the config"
    return model.state_dict(), model.model.embed_tokens.weight.dtype


@pytest.mark.slow
def test_hf_export_of_a_trained_llama_loads_with_from_pretrained(tmp_path: Path) -> None:
    source = save_llama(tmp_path / "source", tied=True)
    ckpt = tmp_path / "ckpt"
    full = run_distributed(_train_and_save, 2, str(source), str(ckpt))[0]
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    initial = load_file(source / index["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    assert not torch.equal(full["model.embed_tokens.weight"], initial), "the export must show trained values"

    fp32 = tmp_path / "hf32"  # the real command line, one file
    done = subprocess.run([sys.executable, "-m", "zinf.cli", "consolidate", str(ckpt), str(fp32), "--format", "hf",
                           "--config", str(source / "config.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "zinf consolidate: wrote 2 file(s)" in done.stderr and f"to {fp32}" in done.stdout
    assert sorted(p.name for p in fp32.iterdir()) == ["config.json", "model.safetensors"]
    state, dtype = _load(fp32)
    assert dtype == torch.float32 and set(state) == set(full)
    for k, v in full.items():
        assert torch.equal(state[k], v), k

    bf16 = tmp_path / "hf16"  # sharded, the config directory (config.json and generation_config.json)
    assert main(["consolidate", str(ckpt), str(bf16), "--dtype", "bf16", "--max-shard-size", "20KB",
                 "--config", str(source), "-q"]) == 0
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in bf16.iterdir()) == sorted([*shards, "model.safetensors.index.json", "config.json",
                                                             "generation_config.json"])
    assert "lm_head.weight" not in index["weight_map"], "a tied weight is written once, as save_pretrained does"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for k, v in full.items() if k != "lm_head.weight")
    state, dtype = _load(bf16)
    assert dtype == torch.bfloat16
    for k, v in full.items():
        assert torch.equal(state[k], v.to(torch.bfloat16)), k
