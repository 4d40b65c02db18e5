"""An unchanged QLoRA script (qlora_script.py: NF4 base, or bitsandbytes' 8-bit one, ``prepare_model_for_kbit_training``,
LoRA, ``Trainer``) on two gloo processes under ``zinf launch`` (parameters in memory; parameters on NVMe with the optimizer on the CPU)
and under plain Accelerate DDP with bitsandbytes on the CPU, compared step for step; Trainer's last checkpoint
consolidated by ``zinf consolidate``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from launching import EXAMPLES, accelerate_launch, assert_close, run_launcher, zinf_launch  # noqa: E402
from sft_lora_script import PROMPTS  # noqa: E402
from test_trl_peft import build_model_dir  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("qlora_script.py")
RTOL = 1e-5  # measured 7e-8: bitsandbytes training path and zinf compute F.linear on the same dequantized weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("pretrained"))


def _script():
    spec = importlib.util.spec_from_file_location("qlora_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def reference_logits(model_dir: Path, kind: str) -> torch.Tensor:
    """The next-token logits of the script's first prompt from the quantized model through bitsandbytes' training
    path (``MatMul4Bit``, ``MatMul8bitFp``: its dequantized weight, ``F.linear``), in this process, without zinf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = _script()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=script.quantization(kind))
    model.model.embed_tokens.weight.requires_grad_(True)  # inputs that need a gradient: the 4-bit training path
    model.train()  # the 8-bit training path (no dropout in this model)
    prompt = AutoTokenizer.from_pretrained(model_dir)(PROMPTS[0], return_tensors="pt")
    return model(**prompt).logits[0, -1].detach()


@pytest.fixture(scope="module")
def ddp_runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The script under DDP, once per base kind."""
    runs: dict[str, dict] = {}

    def run(kind: str) -> dict:
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"ddp_{kind}")
            accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, model_dir, out / "output", out / "result.json",
                              kind)
            runs[kind] = json.loads((out / "result.json").read_text())
        return runs[kind]
    return run


def _zinf_config(path: Path, offload: dict | None) -> Path:
    config = yaml.safe_load((EXAMPLES / "zinf_cpu.yaml").read_text())
    config["zinf"] = {**(config.get("zinf") or {}), "collective_timeout_s": 60, **({"offload": offload} if offload else {})}
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("kind,placement", [("nf4", "memory"), ("nf4", "nvme"), ("int8", "memory"), ("int8", "nvme")])
def test_qlora_under_zinf_launch_trains_like_ddp_with_bitsandbytes(model_dir: Path, ddp_runs, tmp_path: Path,
                                                                  kind: str, placement: str) -> None:
    ddp = ddp_runs(kind)
    offload = None
    if placement == "nvme":
        (tmp_path / "nvme").mkdir()
        offload = {"params": "nvme", "optimizer": "cpu", "nvme_paths": [str(tmp_path / "nvme")],
                   "pinned_pool_bytes": 4 << 20}
    config = _zinf_config(tmp_path / "zinf.yaml", offload)
    zinf_launch("--config", config, SCRIPT, model_dir, tmp_path / "output", tmp_path / "result.json", kind)
    ours = json.loads((tmp_path / "result.json").read_text())
    assert (ddp["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "accelerate_zinf.accelerator")
    assert ours["world"] == ddp["world"] == 2
    assert len(ours["losses"]) == 6
    assert_close(ddp["losses"], ours["losses"], RTOL)
    assert ours["trainable"] == ddp["trainable"] and ours["total"] == ddp["total"]
    # the adapter disabled, the frozen base computes what bitsandbytes' training path computes (its dequantized
    # weights, F.linear); bitsandbytes' own inference path on a CPU with AVX512-BF16 repacks the weights and
    # computes in bf16 (measured 1.5e-3 from its training path), and its 8-bit one quantizes the activations to 8
    # bits too (measured 2.3e-3), so DDP's logits are compared within 5e-3
    base, tuned = torch.tensor(ours["base_logits"]), torch.tensor(ours["tuned_logits"])
    assert torch.allclose(base, reference_logits(model_dir, kind), rtol=0, atol=1e-5)
    assert torch.allclose(base, torch.tensor(ddp["base_logits"]), rtol=0, atol=5e-3)
    assert (tuned - base).abs().max() > 1e-2
    assert torch.allclose(tuned, torch.tensor(ddp["tuned_logits"]), rtol=0, atol=5e-3)
    assert ours["adapter"] == ddp["adapter"] and "adapter_model.safetensors" in ours["adapter"]
    if placement == "memory":
        check_consolidated(model_dir, tmp_path / "output", tmp_path / "consolidated", kind)


def _decoded(module) -> torch.Tensor:
    """A bitsandbytes layer's weight as its training path decodes it."""
    import bitsandbytes as bnb

    w = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(w.data, w.quant_state)
    return w.data.to(torch.float32).mul_(w.SCB.unsqueeze(1).mul(1.0 / 127.0))


def check_consolidated(model_dir: Path, output: Path, out: Path, kind: str) -> None:
    """Trainer's last checkpoint, consolidated from zinf's shards: the base's quantized weights as bitsandbytes
    decodes them (bit for bit), and the adapters as saved."""
    import bitsandbytes as bnb
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_launcher([sys.executable, "-m", "zinf.cli", "consolidate", str(output / "checkpoint-6" / "zinf"), str(out),
                  "--format", "safetensors"])
    state = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     quantization_config=_script().quantization(kind))
    quantized = {n: m for n, m in reference.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
    assert len(quantized) == 14
    for name, module in quantized.items():
        key = f"base_model.model.{name}.base_layer.weight" if name.endswith(("q_proj", "v_proj", "down_proj")) \
            else f"base_model.model.{name}.weight"
        assert torch.equal(state[key], _decoded(module)), key
    adapter = load_file(output / "checkpoint-6" / "adapter_model.safetensors")
    for k, v in adapter.items():
        ours = k.replace(".weight", ".default.weight")
        assert torch.equal(state[ours], v), k


BF16_ADAPTERS_RTOL = 5e-4  # TRL casts the adapters of a 4-bit model to bf16: measured 5.9e-5 from DDP's losses


def test_trl_sft_qlora_under_zinf_launch_trains_like_ddp(model_dir: Path, tmp_path: Path) -> None:
    """TRL's ``SFTTrainer`` on the 4-bit base (sft_qlora_script.py), 2 ranks, against DDP with bitsandbytes: the
    losses, and each rank's greedy completion of its own prompt (of different lengths: the ranks generate in
    lockstep over the 4-bit groups)."""
    pytest.importorskip("trl")
    script = SCRIPT.with_name("sft_qlora_script.py")
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", script, model_dir, tmp_path / "ddp", tmp_path / "ddp.json")
    config = _zinf_config(tmp_path / "zinf.yaml", None)
    zinf_launch("--config", config, script, model_dir, tmp_path / "zinf", tmp_path / "zinf.json")
    ddp, ours = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("ddp", "zinf"))
    assert (ddp["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "accelerate_zinf.accelerator")
    assert len(ours["losses"]) == 8
    assert_close(ddp["losses"], ours["losses"], BF16_ADAPTERS_RTOL)
    assert ours["generated"] == ddp["generated"]
    assert ours["trainable"] == ddp["trainable"] and ours["total"] == ddp["total"]
