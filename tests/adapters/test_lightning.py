"""Lightning and Fabric front ends against their own DDP, with real Trainers on 2 gloo ranks.

Each run is a driver script started as a process (see ``lightning_runs.Runs``: under torchrun, or as a
user starts it, with Lightning's and Fabric's own launchers starting the second rank); every rank writes its
per-step losses to a JSON file that the tests compare.
Runs are cached per pytest session so that one reference run serves several tests.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_runs import WORLD, Runs, records, worst

EXACT = 1e-5  # relative, fp32 vs DDP
BF16 = 2e-2  # relative, bf16-mixed vs fp32 DDP (measured: ~1e-4)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _accelerators() -> list:
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not enough_gpus,
                                                                                      reason="needs 2 CUDA devices")])]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("lightning_zinf"))


GPT_EVAL = ("--kind", "gpt", "--steps", "20", "--eval", "--ckpt-every", "10")


def lightning(runs: Runs, strategy: str, *args: str, accelerator: str = "cpu") -> list[dict]:
    """The GPT runs with eval loops start as a user starts a script (``python driver.py``, Lightning's launcher
    starts the second rank); the others under torchrun (see ``Runs``)."""
    launcher = "lightning" if args == GPT_EVAL else "torchrun"
    return records(runs("lightning_driver.py", "--strategy", strategy, "--accelerator", accelerator, *args,
                        launcher=launcher))


@pytest.mark.parametrize("accelerator", _accelerators())
def test_gpt_matches_ddp_with_eval_loops(runs: Runs, accelerator: str) -> None:
    ours = lightning(runs, "zero_infinity", *GPT_EVAL, accelerator=accelerator)
    ref = lightning(runs, "ddp", *GPT_EVAL, accelerator=accelerator)
    assert len(ours[0]["train"]) == 20 and ours[0]["global_step"] == 20
    assert worst(ours, ref) < EXACT
    assert worst(ours, ref, "val") < EXACT  # validation each epoch, logged with sync_dist
    assert worst(ours, ref, "predict") < EXACT
    assert abs(ours[0]["test_loss"] - ref[0]["test_loss"]) / ref[0]["test_loss"] < EXACT
    assert ours[0]["lr"] == ref[0]["lr"]  # the LR scheduler drives the same optimizer object


def test_cnn_built_in_init_matches_ddp(runs: Runs) -> None:
    ours = lightning(runs, "zero_infinity", "--kind", "cnn", "--steps", "20", "--build-in", "init")
    ref = lightning(runs, "ddp", "--kind", "cnn", "--steps", "20")
    assert worst(ours, ref) < EXACT


ACCUM_CLIP = ("--kind", "gpt", "--steps", "20", "--accum", "2", "--clip", "0.5")


def test_accumulation_and_clipping_match_ddp(runs: Runs) -> None:
    ours = lightning(runs, "zero_infinity", *ACCUM_CLIP)
    ref = lightning(runs, "ddp", *ACCUM_CLIP)
    assert len(ours[0]["train"]) == 40 and ours[0]["global_step"] == 20
    assert worst(ours, ref) < EXACT


def test_an_optimizer_step_override_stepping_every_other_batch_matches_ddp(runs: Runs) -> None:
    """The batches that do not step make gradients that Lightning zeroes through the optimizer it holds: the engine's
    gradient shards are zeroed with it, as DDP's parameters' are."""
    args = ("--kind", "gpt", "--steps", "10", "--step-every", "2")
    ours, ref = lightning(runs, "zero_infinity", *args), lightning(runs, "ddp", *args)
    assert len(ours[0]["train"]) == len(ref[0]["train"]) >= 6
    assert worst(ours, ref) < EXACT


def test_manual_optimization_matches_automatic_ddp(runs: Runs) -> None:
    ours = lightning(runs, "zero_infinity", *ACCUM_CLIP, "--manual")
    ref = lightning(runs, "ddp", *ACCUM_CLIP)
    # automatic optimization reports the loss divided by accumulate_grad_batches
    assert worst(ours, ref, scale=1 / 2) < EXACT


def test_resume_matches_uninterrupted_and_converts(runs: Runs) -> None:
    full_dir = runs("lightning_driver.py", "--strategy", "zero_infinity", "--accelerator", "cpu", *GPT_EVAL,
                    launcher="lightning")
    ckpt = full_dir / "ckpt" / "step=10.ckpt"
    committed = json.loads((ckpt / "commit.json").read_text())["files"]  # one file per rank, made current together
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["commit.json", "commit.lock", *committed])
    assert len(committed) == 2
    resumed = lightning(runs, "zero_infinity", "--kind", "gpt", "--steps", "20", "--resume", str(ckpt))
    full = records(full_dir)
    assert resumed[0]["global_step"] == 20 and len(resumed[0]["train"]) == 10
    assert worst(resumed, full, start=10) < EXACT

    # the single-file conversion holds the same weights as DDP's own checkpoint at step 20
    converted = torch.load(full_dir / "converted.ckpt", weights_only=False)
    ddp_dir = runs("lightning_driver.py", "--strategy", "ddp", "--accelerator", "cpu", *GPT_EVAL, launcher="lightning")
    ddp = torch.load(ddp_dir / "ckpt" / "step=20.ckpt", weights_only=False)
    assert converted["global_step"] == ddp["global_step"] == 20
    assert converted["state_dict"].keys() == ddp["state_dict"].keys()
    for k, v in ddp["state_dict"].items():
        torch.testing.assert_close(converted["state_dict"][k], v, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_trains_close_to_fp32(runs: Runs) -> None:
    ours = lightning(runs, "zero_infinity", "--kind", "gpt", "--steps", "20", "--precision", "bf16-mixed",
                     "--build-in", "init_module")
    ref = lightning(runs, "ddp", *GPT_EVAL)
    losses = ours[0]["train"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])
    assert worst(ours, ref) < BF16


def test_fabric_matches_fabric_ddp_and_resumes(runs: Runs) -> None:
    args = ("--kind", "gpt", "--steps", "20", "--accum", "2", "--clip", "0.5")
    ours_dir = runs("fabric_driver.py", "--strategy", "zero_infinity", *args, "--save-at", "10", launcher="lightning")
    ref = records(runs("fabric_driver.py", "--strategy", "ddp", *args))
    ours = records(ours_dir)
    assert worst(ours, ref) < EXACT
    resumed = records(runs("fabric_driver.py", "--strategy", "zero_infinity", *args, "--resume", str(ours_dir / "ckpt")))
    assert worst(resumed, ours, start=10) < EXACT


def test_checkpointing_and_tiling_set_in_the_strategy_config_match_ddp(runs: Runs) -> None:
    settings = {"activation_checkpointing": {"modules": ["Block"], "offload": True},
                "tiling": {"min_numel": 4000, "tiles": [2, 2]}}
    ref = lightning(runs, "ddp", "--kind", "gpt", "--steps", "20")
    ours = lightning(runs, "zero_infinity", "--kind", "gpt", "--steps", "20", "--zinf-config", json.dumps(settings))
    assert worst(ours, ref) <= EXACT
    assert all(r["checkpointed_blocks"] == 2 and r["tiled_layers"] == 4 for r in ours)  # fc and out of 2 blocks


def test_compiled_model_matches_compiled_ddp(runs: Runs) -> None:
    """``self.model = torch.compile(self.model)`` in ``configure_model`` (Lightning) and
    ``fabric.setup(torch.compile(model))`` (Fabric, which compiles the module the strategy returns): both compile
    under zinf and give the losses of the same compiled script under DDP."""
    args = ("--kind", "gpt", "--steps", "6", "--compile")
    ours = lightning(runs, "zero_infinity", *args)
    ref = lightning(runs, "ddp", *args)
    assert worst(ours, ref) < EXACT
    fabric_ours = records(runs("fabric_driver.py", "--strategy", "zero_infinity", *args))
    fabric_ref = records(runs("fabric_driver.py", "--strategy", "ddp", *args))
    assert worst(fabric_ours, fabric_ref) < EXACT
    for record in ours + fabric_ours:
        assert record["graphs"] > 0, record
