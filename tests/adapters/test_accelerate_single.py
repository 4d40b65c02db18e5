"""The Accelerate front end in one process: launch-config checks (every refusal names the key and the
fix), where the engine config comes from, and the Accelerator's methods against plain PyTorch."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import zinf  # noqa: E402
from accelerate_zinf import Accelerator, ZinfModel  # noqa: E402
from accelerate_zinf.launch import build_command  # noqa: E402
from accelerate_zinf.settings import ENV_CONFIG, engine_config  # noqa: E402
from zinf.errors import ConfigError, UnsupportedModelError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "accelerate"
TRAIN = str(EXAMPLES / "train.py")  # zinf launch checks that the script is a file
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from failing import Fail, FailingBackward, armed  # noqa: E402


# -- zinf launch: what is refused, and what is built ----------------------------------------------------
def _config(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load((EXAMPLES / "zinf_cpu.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD = {
    "misspelt zinf key": ({"zinf": {"ofload": {"params": "cpu"}}}, ["unknown key 'ofload'", "Did you mean 'offload'"]),
    "bad zinf value": ({"zinf": {"precision": "fp64"}}, ["'precision' = 'fp64'", "one of ['bf16', 'fp16', 'fp32']"]),
    "bad nested value": ({"zinf": {"offload": {"params": "disk"}}}, ["'offload.params' = 'disk'"]),
    "nvme without paths": ({"zinf": {"offload": {"optimizer": "nvme"}}}, ["offload.nvme_paths"]),
    "deepspeed section": ({"deepspeed_config": {"zero_stage": 3}}, ["'deepspeed_config'", "DeepSpeed", "zinf: section"]),
    "fsdp section": ({"fsdp_config": {"fsdp_version": 2}}, ["'fsdp_config'", "FSDP"]),
    "megatron section": ({"megatron_lm_config": {"megatron_lm_tp_degree": 2}}, ["'megatron_lm_config'", "Megatron-LM"]),
    "deepspeed type": ({"distributed_type": "DEEPSPEED"}, ["distributed_type", "'DEEPSPEED'", "MULTI_GPU"]),
    "fsdp type": ({"distributed_type": "FSDP"}, ["'FSDP'", "hands the model to FSDP"]),
    "xla type": ({"distributed_type": "XLA"}, ["'XLA'", "not multi-process data parallel"]),
    "multi_cpu without mpirun": ({"distributed_type": "MULTI_CPU"}, ["starts one process", "use_cpu: true"]),
    "fp8": ({"mixed_precision": "fp8"}, ["mixed_precision='fp8'"]),
    "precision conflict": ({"mixed_precision": "fp16", "zinf": {"precision": "bf16"}}, ["disagree"]),
    "unknown accelerate key": ({"num_proceses": 2}, ["Accelerate refuses", "num_proceses"]),
    "num_processes a word": ({"num_processes": "two"}, ["num_processes: 'two'", "an integer >= 1"]),
    "num_processes zero": ({"num_processes": 0}, ["num_processes: 0", "an integer >= 1"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_zinf_launch_refuses_bad_configs_with_the_key_and_the_fix(tmp_path: Path, case: str) -> None:
    changes, expected = BAD[case]
    path = _config(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        build_command(["--config", str(path), TRAIN], str(tmp_path))
    for text in expected:
        assert text in str(err.value), f"{case}: {text!r} not in {err.value}"


def test_zinf_launch_builds_accelerate_launch_with_both_config_files(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    cmd, env = build_command(["--config_file", str(EXAMPLES / "zinf_nvme.yaml"), "--main_process_port", "29533",
                              TRAIN, "--config", "mine.yaml", "--lr", "3e-4"], str(work))
    i = cmd.index("-m", 3)
    assert cmd[1:5] == ["-m", "accelerate.commands.launch", "--config_file", str(work / "accelerate.yaml")]
    assert cmd[5:i] == ["--main_process_port", "29533"]  # the launcher's own options pass through
    assert cmd[i:] == ["-m", "accelerate_zinf.run", TRAIN, "--config", "mine.yaml", "--lr", "3e-4"]  # the script's too
    assert env["ACCELERATE_USE_CPU"] == "true" and env[ENV_CONFIG] == str(work / "zinf.yaml")
    assert "zinf" not in yaml.safe_load((work / "accelerate.yaml").read_text())
    engine = yaml.safe_load((work / "zinf.yaml").read_text())
    assert engine["offload"]["optimizer"] == "nvme" and engine["offload"]["nvme_paths"] == [os.environ.get("ZINF_NVME_DIR", "/tmp")]


def test_zinf_launch_takes_config_after_the_launchers_own_options(tmp_path: Path) -> None:
    """``--config`` after options that take a value (``--num_processes 2``) is still the zinf config, not the
    script's: the launcher's options and their values are stepped over."""
    work = tmp_path / "work"
    work.mkdir()
    cmd, env = build_command(["--num_processes", "2", "--config", str(EXAMPLES / "zinf_nvme.yaml"), TRAIN,
                              "--config", "mine.yaml"], str(work))
    i = cmd.index("-m", 3)
    assert cmd[3:5] == ["--config_file", str(work / "accelerate.yaml")] and "--num_processes" in cmd[5:i]
    assert cmd[i:] == ["-m", "accelerate_zinf.run", TRAIN, "--config", "mine.yaml"]
    assert env[ENV_CONFIG] == str(work / "zinf.yaml")


def test_zinf_launch_refuses_a_missing_script_before_starting_processes(tmp_path: Path) -> None:
    missing = str(tmp_path / "nonexist.py")
    with pytest.raises(ConfigError) as err:
        build_command(["--config", str(EXAMPLES / "zinf_cpu.yaml"), missing, "--lr", "3e-4"], str(tmp_path))
    assert f"the script {missing!r} is not a file" in str(err.value) and "--module" in str(err.value)
    cmd, _ = build_command(["--config", str(EXAMPLES / "zinf_cpu.yaml"), "-m", "pkg.train"], str(tmp_path))
    assert cmd[-3:] == ["accelerate_zinf.run", "--module", "pkg.train"]  # a module is named, not a file


def test_zinf_launch_accepts_num_processes_from_an_environment_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ZINF_TEST_NPROC", "3")
    path = _config(tmp_path, num_processes="${oc.env:ZINF_TEST_NPROC,2}")
    work = tmp_path / "work"
    work.mkdir()
    build_command(["--config", str(path), TRAIN], str(work))
    assert yaml.safe_load((work / "accelerate.yaml").read_text())["num_processes"] == 3


def test_zinf_launch_passes_a_dynamo_config_to_accelerate(tmp_path: Path) -> None:
    """A compile setting reaches the processes (Accelerate's dynamo plugin, which the zinf Accelerator applies in
    place: [Note: compiled modules] in zinf/schedule/hooks.py)."""
    path = _config(tmp_path, dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True})
    work = tmp_path / "work"
    work.mkdir()
    build_command(["--config", str(path), TRAIN], str(work))
    written = yaml.safe_load((work / "accelerate.yaml").read_text())
    assert written["dynamo_config"] == {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}


def test_engine_config_comes_from_the_script_then_the_environment_then_defaults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    assert engine_config() == zinf.ZeroConfig()
    monkeypatch.setenv(ENV_CONFIG, str(EXAMPLES / "zinf_cpu_offload.yaml"))  # a combined file: its zinf: section
    assert engine_config().offload.optimizer == "cpu"
    assert engine_config({"gradient_clipping": 2.0}).gradient_clipping == 2.0  # the script wins
    (tmp_path / "e.yaml").write_text("precision: bf16\n")  # a plain engine config
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "e.yaml"))
    assert engine_config().precision == "bf16"
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="does not exist"):
        engine_config()


# -- one process: the Accelerator's methods against plain PyTorch ------------------------------------------
def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, block=16, n_embd=32, n_head=4, n_layer=2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 64, (n, 4, 17), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seq]


def test_single_process_training_matches_pytorch_with_accumulation_and_clipping(fresh_state) -> None:
    ref = _gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = _gpt()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(model, ZinfModel) and accelerator.unwrap_model(model) is model.module
    got, want = [], []
    for i, (x, y) in enumerate(_batches(8)):
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                got.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
        (ref(x, y) / 2).backward()
        if i % 2 == 1:
            want.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
            ref_opt.step()
            ref_opt.zero_grad()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    state = accelerator.get_state_dict(model)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_partitioned_state_dict_and_partial_clipping_are_refused(fresh_state) -> None:
    accelerator = Accelerator(cpu=True)
    model = _gpt()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="get_state_dict"):
        accelerator.unwrap_model(model).state_dict()  # what Trainer.save_model on rank 0 would write
    with model.engine.gathered_parameters():
        assert accelerator.unwrap_model(model).state_dict()["blocks.0.fc.weight"].shape == (128, 32)
    with pytest.raises(UnsupportedModelError, match="whole model"):
        accelerator.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(UnsupportedModelError, match="clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)


def test_a_model_prepared_alone_gets_its_engine_with_its_optimizer(fresh_state) -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_gpt())
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # built from the prepared model, as usual
    x, y = _batches(1)[0]
    before = copy.deepcopy(accelerator.get_state_dict(model))
    accelerator.backward(model(x, y))
    opt.step()
    after = accelerator.get_state_dict(model)
    assert not torch.equal(before["blocks.0.fc.weight"], after["blocks.0.fc.weight"])
    with pytest.raises(UnsupportedModelError, match="one call"):
        accelerator.prepare(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_checkpointing_and_tiling_from_zinf_config_train_like_pytorch(fresh_state) -> None:
    settings = {"activation_checkpointing": {"modules": ["Block"], "offload": True},
                "tiling": {"min_numel": 4000, "tiles": [2, 2]}}
    accelerator = Accelerator(cpu=True, zinf_config=settings)
    ref = _gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = _gpt()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert len(model.engine.checkpointing.blocks) == 2
    assert sum(type(m).__name__ == "TiledLinear" for m in model.module.modules()) == 4  # fc, out of 2 blocks
    for x, y in _batches(4):
        loss = model(x, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
    state = accelerator.get_state_dict(model)
    assert set(state) == set(ref.state_dict())  # the untiled names
    for name, p in ref.state_dict().items():  # relative norm: the key bias's gradient is ~0 (Adam scales noise)
        assert state[name].shape == p.shape and float((state[name] - p).norm() / p.norm().clamp_min(1e-12)) < 1e-3, name


def _two_models(fail: bool) -> list[float]:
    """Two models, each with its optimizer, trained on one summed loss; ``fail``: before steps 1 and 3, a backward on
    another batch raises inside the second model's first block (after its later blocks gave their gradients)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    first, second = _gpt(), _gpt()
    second.blocks[0].register_forward_hook(lambda module, args, out: FailingBackward.apply(out))
    prepared = accelerator.prepare(first, torch.optim.AdamW(first.parameters(), lr=1e-2),
                                   second, torch.optim.AdamW(second.parameters(), lr=1e-2))
    first, opt_first, second, opt_second = prepared
    losses = []
    for step, ((x, y), (ox, oy)) in enumerate(zip(_batches(4), _batches(5)[1:])):
        if fail and step in (1, 3):
            with armed(), pytest.raises(Fail):
                accelerator.backward(first(ox, oy) + second(ox, oy))
        loss = first(x, y) + second(x, y)
        accelerator.backward(loss)
        for opt in (opt_first, opt_second):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_several_models_on_one_loss_train_like_pytorch_and_drop_a_backward_that_raised(fresh_state) -> None:
    """Each engine frames the one backward as its own (``engine.backward_scope``): a backward that raised leaves no
    partial gradient in either model for the next step to train on."""
    clean = _two_models(fail=False)
    assert _two_models(fail=True) == clean  # bit for bit
    first, second = _gpt(), _gpt()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (first, second)]
    want = []
    for x, y in _batches(4):
        loss = first(x, y) + second(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(clean), torch.tensor(want), rtol=1e-5, atol=0)
