"""[Note: frozen shards in place] in zinf/offload/in_place.py, on real gloo processes: a bf16 Llama checkpoint
loaded under ``zinf.Init`` with parameters on NVMe in bf16 storage, most of it frozen (LoRA's shape):

- on 2 ranks, reading the frozen shards from the checkpoint's files trains exactly as copying them to the swap files
  (``offload.frozen_in_place: false``): the same losses and final values bit for bit; the swap holds only the
  trained groups, the report counts the frozen bytes as read from the checkpoint, and the files are not written;
- a checkpoint file changed under a run (rewritten, rewritten with its old modification time restored, truncated) is
  refused at the next read, naming the file;
- new values loaded into a built engine give a frozen group a swap record of its own (the files stay as they were).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import llama_config, token_batches
from training import lm_step_global
from zinf.offload.in_place import CheckpointChangedError

pytestmark = pytest.mark.distributed

STEPS = 3
TRAINED = ("model.layers.1.mlp.", "model.norm.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_bf16")
    torch.manual_seed(5)
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    return path


def _files(path: Path) -> dict[str, tuple[str, int]]:
    return {f.name: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for f in sorted(path.glob("*.safetensors"))}


def _build(path: str, nvme: str, in_place: bool):
    from transformers import AutoModelForCausalLM

    os.makedirs(nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({
        "precision": "fp32", "param_storage": "bf16",
        "offload": {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20,
                    "frozen_in_place": in_place}})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINED))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, zinf.initialize(model, opt, config)


def _train(rank: int, world: int, path: str, nvme: str, in_place: bool) -> dict:
    model, engine = _build(path, nvme, in_place)
    nvme_bytes = engine.resident_bytes()["nvme"]
    model.train()
    losses = []
    for x in token_batches(STEPS, 4):
        losses.append(lm_step_global(engine, x, rank, world))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state, "nvme": nvme_bytes}


def _both(rank: int, world: int, path: str, root: str) -> list[dict]:
    return [_train(rank, world, path, os.path.join(root, f"nvme_{flag}"), flag) for flag in (True, False)]


def test_frozen_shards_read_in_place_train_exactly_as_copied(checkpoint: Path, tmp_path: Path) -> None:
    before = _files(checkpoint)
    in_place, copied = zip(*run_distributed(_both, 2, str(checkpoint), str(tmp_path)))
    assert _files(checkpoint) == before, "a checkpoint file was written"
    for rank, (a, b) in enumerate(zip(in_place, copied)):
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert set(a["state"]) == set(b["state"])
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), (rank, k)
        # the swap holds the trained groups only; the frozen bytes are counted as read from the checkpoint
        assert "frozen_in_checkpoint" not in b["nvme"], b["nvme"]
        frozen = a["nvme"]["frozen_in_checkpoint"]
        assert frozen > 0 and a["nvme"]["param_shards"] + frozen <= b["nvme"]["param_shards"], (a["nvme"], b["nvme"])
        assert a["nvme"]["param_shards"] < b["nvme"]["param_shards"] / 4, (a["nvme"], b["nvme"])
    assert in_place[0]["losses"] == in_place[1]["losses"]


def _first_file(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _step(engine, x: torch.Tensor) -> None:
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()


def _changed(rank: int, world: int, path: str, nvme: str, how: str) -> str:
    _, engine = _build(path, nvme, True)
    target = _first_file(Path(path))
    raw = bytearray(target.read_bytes())
    seen = target.stat()
    if how == "truncated":
        target.write_bytes(raw[: len(raw) - 4096])
    else:
        raw[-64] ^= 0xFF  # inside the last tensor's bytes
        target.write_bytes(raw)
        if how == "same_mtime":  # only the checksum can tell
            os.utime(target, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    try:
        _step(engine, token_batches(1, 2)[0])
    except CheckpointChangedError as exc:
        return str(exc)
    finally:
        engine.placement.store.flush()
    return "no error"


@pytest.mark.parametrize("how", ["rewritten", "same_mtime", "truncated"])
def test_a_checkpoint_changed_under_a_run_is_refused(checkpoint: Path, tmp_path: Path, how: str) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (message,) = run_distributed(_changed, 1, str(copy), str(tmp_path / "nvme"), how)
    assert _first_file(copy).name in message and "Refusing to train" in message, message
    if how == "same_mtime":
        assert "CRC32C" in message, message


def _load_into(rank: int, world: int, path: str, nvme: str) -> dict:
    model, engine = _build(path, nvme, True)
    state = engine.full_state_dict()
    new = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    engine.load_full_state_dict(new)
    got = engine.full_state_dict()
    bytes_after = engine.resident_bytes()["nvme"]
    engine.close()
    return {"new": new, "got": got, "nvme": bytes_after}


def test_new_values_for_a_frozen_group_go_to_swap(checkpoint: Path, tmp_path: Path) -> None:
    before = _files(checkpoint)
    (res,) = run_distributed(_load_into, 1, str(checkpoint), str(tmp_path / "nvme"))
    assert _files(checkpoint) == before
    for k, v in res["new"].items():  # a frozen group's values are its bf16 shard's
        expect = v if k.startswith(TRAINED) or not v.is_floating_point() else v.to(torch.bfloat16).float()
        assert torch.equal(res["got"][k], expect), k
    assert "frozen_in_checkpoint" not in res["nvme"], res["nvme"]
