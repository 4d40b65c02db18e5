"""zinf.load_pretrained in one process: every source kind, key matching like load_state_dict, and bad input refused
before anything is written (zinf/checkpoint/pretrained.py, tensor_files.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zinf
from zinf.errors import CheckpointError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 12)
        self.body = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 12))
        self.norm = nn.BatchNorm1d(12)  # persistent buffers
        self.head = nn.Linear(12, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two names


def _values(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net()
    net.norm.running_mean.uniform_()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _partitioned() -> Net:
    torch.manual_seed(123)
    with zinf.Init(zinf.ZeroConfig()):
        return Net()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zinf.GatheredParameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_loaded(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    full = _full(model)
    for k, v in values.items():
        assert torch.equal(full[k], v.to(full[k].dtype)), k


def test_safetensors_file_torch_file_state_dict_and_sharded_dir(tmp_path: Path) -> None:
    values = _values(1)
    stored = {k: v for k, v in values.items() if k != "head.weight"}  # tied: saved once, as save_pretrained does
    save_file(stored, tmp_path / "w.safetensors")
    torch.save(stored, tmp_path / "w.bin")
    shards = tmp_path / "sharded"
    shards.mkdir()
    keys = sorted(stored)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: stored[k] for k in part}, shards / name)
        weight_map.update({k: name for k in part})
    (shards / "model.safetensors.index.json").write_text(__import__("json").dumps({"metadata": {}, "weight_map": weight_map}))
    for source in (tmp_path / "w.safetensors", tmp_path / "w.bin", stored, shards, [str(tmp_path / "w.safetensors")]):
        model = _partitioned()
        report = zinf.load_pretrained(model, source)
        assert not report.missing_keys and not report.unexpected_keys, source
        assert {"emb.weight", "head.weight"} <= set(report.loaded_keys)
        _assert_loaded(model, values)


def test_a_tied_weight_saved_under_both_names_loads_strictly(tmp_path: Path) -> None:
    values = _values(4)  # the state dict holds the tied weight as emb.weight and as head.weight, as torch.save does
    torch.save(values, tmp_path / "w.bin")
    model = _partitioned()
    report = zinf.load_pretrained(model, tmp_path / "w.bin")
    assert not report.missing_keys and not report.unexpected_keys
    _assert_loaded(model, values)


def test_bf16_files_into_fp32_masters_are_exact(tmp_path: Path) -> None:
    values = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _values(2).items() if k != "head.weight"}
    save_file(values, tmp_path / "w.safetensors")
    model = _partitioned()
    zinf.load_pretrained(model, tmp_path / "w.safetensors")
    _assert_loaded(model, values)


@pytest.mark.parametrize("placeholders", [True, False], ids=["placeholders", "initialised"])
def test_a_bf16_file_into_bf16_shards_built_on_nvme_is_read_as_it_is(tmp_path: Path, monkeypatch,
                                                                      placeholders: bool) -> None:
    """[Note: reading at the storage width]: no fp32 master is written (no widening, comparing, narrowing), and
    the values are the file's, before the engine and in the masters the placement makes from the shards; also for a
    model whose fp32 initial values bf16 could not hold (their masters go: the file's values need none)."""
    import contextlib

    from zinf.param.flat_group import FlatParamGroup

    values = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in _values(3).items()
              if k != "head.weight"}
    save_file(values, tmp_path / "w.safetensors")
    cfg = zinf.ZeroConfig.from_dict({"precision": "bf16", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path / "nvme")], "pinned_pool_bytes": 16 << 20}})
    (tmp_path / "nvme").mkdir()
    torch.manual_seed(123)
    with zinf.Init(cfg) as init, (init.placeholders() if placeholders else contextlib.nullcontext()):
        model = Net()  # with placeholders: as transformers' from_pretrained builds it under zinf
    widened: list[str] = []
    write_master = FlatParamGroup.write_master
    monkeypatch.setattr(FlatParamGroup, "write_master", lambda g, m: (widened.append(g.name), write_master(g, m))[1])
    zinf.load_pretrained(model, tmp_path / "w.safetensors")
    assert widened == []
    _assert_loaded(model, values)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    full = engine.full_state_dict()
    assert all(torch.equal(full[k].to(v.dtype), v) for k, v in values.items())
    engine.close()


def test_strict_refuses_missing_unexpected_and_mismatched_before_writing(tmp_path: Path) -> None:
    values = _values(3)
    model = _partitioned()
    before = _full(model)
    cases = {
        "missing keys": {k: v for k, v in values.items() if k not in ("body.0.bias", "head.weight")},
        "unexpected keys": {**values, "extra.weight": torch.zeros(3)},
        "size mismatch for body.0.weight": {**values, "body.0.weight": torch.zeros(20, 13)},
    }
    for message, state in cases.items():
        with pytest.raises(CheckpointError, match=message) as err:
            zinf.load_pretrained(model, state)
        assert "Nothing was loaded" in str(err.value)
        after = _full(model)
        assert all(torch.equal(after[k], v) for k, v in before.items()), f"{message}: something was written"
    # strict=False loads what matches and reports the rest, keeping the missing parameter's values
    report = zinf.load_pretrained(model, cases["missing keys"], strict=False)
    assert report.missing_keys == ["body.0.bias"], report.missing_keys
    full = _full(model)
    assert torch.equal(full["body.0.bias"], before["body.0.bias"])
    assert torch.equal(full["body.0.weight"], values["body.0.weight"])


def test_base_model_prefix_added_or_removed(tmp_path: Path) -> None:
    class Head(nn.Module):
        base_model_prefix = "base"

        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
            self.out = nn.Linear(6, 2)

    torch.manual_seed(0)
    ref = Head()
    base_only = {k.removeprefix("base."): v for k, v in ref.state_dict().items() if k.startswith("base.")}
    with zinf.Init(zinf.ZeroConfig()):
        model = Head()
    report = zinf.load_pretrained(model, base_only, strict=False)
    assert sorted(report.missing_keys) == ["out.bias", "out.weight"]
    full = _full(model)
    assert all(torch.equal(full[f"base.{k}"], v) for k, v in base_only.items())


def test_bad_files_are_named(tmp_path: Path) -> None:
    model = _partitioned()
    with pytest.raises(CheckpointError, match="does not exist"):
        zinf.load_pretrained(model, tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no weight files"):
        zinf.load_pretrained(model, tmp_path)
    save_file({k: v for k, v in _values(4).items()}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        zinf.load_pretrained(model, tmp_path / "cut.safetensors")
    (tmp_path / "foreign.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        zinf.load_pretrained(model, tmp_path / "foreign.safetensors")
    (tmp_path / "foreign.bin").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="cannot read"):
        zinf.load_pretrained(model, tmp_path / "foreign.bin")
    index = tmp_path / "idx"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    with pytest.raises(CheckpointError, match="incomplete"):
        zinf.load_pretrained(model, index)


def test_meta_parameters_under_init_are_refused_with_the_fix() -> None:
    with pytest.raises(zinf.UnsupportedModelError, match="load_pretrained"):
        with torch.device("meta"), zinf.Init(zinf.ZeroConfig()):
            nn.Sequential(nn.Linear(4, 4))  # the child is partitioned as it is attached
