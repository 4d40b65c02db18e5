"""Every front end, with its trust setting off (the default), refuses a checkpoint crafted to run code if unpickled
(see tests/crafted_checkpoints.py) and runs none of it; what it stores itself round-trips without the setting; the
setting reaches the engine from each front end's own config. Lightning, Fabric and Accelerate in this process on
one rank; transformers' Trainer as a script run on zinf (``python -m accelerate_zinf.run``), one process."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from crafted_checkpoints import craft
from zinf.checkpoint import read_client_state
from zinf.errors import CheckpointError

HERE = Path(__file__).parent
REFUSED = "client state holds io.open"


def _data(n: int = 24) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _copy_crafted(source: Path, into: Path, how: str = "client") -> Path:
    shutil.copytree(source, into)
    craft(into, how, into.parent / f"ran-{into.name}")
    return into


def test_lightning_trainer_round_trips_its_state_untrusted_and_refuses_a_crafted_checkpoint(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import OmegaConf

    import lightning_zinf  # registers "zero_infinity"

    class Net(L.LightningModule):
        def __init__(self, cfg) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)  # a Hydra/OmegaConf config: Lightning stores it and its type
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.body(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}

    def trainer(steps: int, ckpt_dir: Path | None = None, strategy: object = "zero_infinity") -> L.Trainer:
        callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2,
                                     save_top_k=-1)] if ckpt_dir else []
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False)

    cfg = OmegaConf.create({"lr": 0.01, "name": "net"})
    trainer(4, tmp_path / "ckpt").fit(Net(cfg), _data())
    saved = tmp_path / "ckpt" / "step=2.ckpt"
    state = read_client_state(saved)  # untrusted: everything Lightning stored
    assert {"epoch", "global_step", "loops", "callbacks", "lr_schedulers", "hyper_parameters", "hparams_type"} <= set(state)
    assert state["global_step"] == 2 and OmegaConf.to_container(state["hyper_parameters"]) == {"lr": 0.01, "name": "net"}
    resumed = trainer(4)
    resumed.fit(Net(cfg), _data(), ckpt_path=saved)
    assert resumed.global_step == 4
    crafted = _copy_crafted(saved, tmp_path / "crafted.ckpt")
    with pytest.raises(CheckpointError, match=REFUSED):
        trainer(4).fit(Net(cfg), _data(), ckpt_path=crafted)
    with pytest.raises(CheckpointError, match=REFUSED):
        lightning_zinf.convert_to_lightning_checkpoint(crafted)
    assert not (tmp_path / "ran-crafted.ckpt").exists()
    # the strategy's config reaches the engine (fit's weights_only does not reach a strategy that restores after
    # setup: Lightning drops it there)
    trusted = trainer(4, strategy=lightning_zinf.ZeroInfinityStrategy(config={"checkpoint": {"allow_pickle": True}}))
    trusted.fit(Net(cfg), _data(), ckpt_path=crafted)
    assert trusted.global_step == 4 and (tmp_path / "ran-crafted.ckpt").exists()


def test_fabric_round_trips_its_state_untrusted_and_refuses_a_crafted_checkpoint(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")

    import lightning_zinf  # noqa: F401

    def setup() -> tuple:
        fabric = L.Fabric(strategy="zero_infinity", accelerator="cpu", devices=1)
        fabric.launch()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = fabric.setup(model, opt)
        return fabric, model, opt

    fabric, model, opt = setup()
    for x, y in _data(8):
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    extra = {"step": 2, "scores": [0.5, 0.25], "best": torch.tensor(0.25), "dir": Path("/runs")}
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, **extra})
    fabric, model, opt = setup()
    state = {"model": model, "optimizer": opt, "step": 0, "scores": None, "best": None, "dir": None}
    fabric.load(tmp_path / "ckpt", state)
    assert state["step"] == 2 and state["scores"] == [0.5, 0.25] and state["dir"] == Path("/runs")
    assert torch.equal(state["best"], torch.tensor(0.25))
    for how, expected in (("client", REFUSED), ("earlier", "zinf-sharded-v2")):
        crafted = _copy_crafted(tmp_path / "ckpt", tmp_path / f"crafted-{how}", how)
        with pytest.raises(CheckpointError, match=expected):
            fabric.load(crafted, {"model": model, "optimizer": opt})
        assert not (tmp_path / f"ran-crafted-{how}").exists()
    # Fabric's own trust switch reaches the engine
    fabric.load(tmp_path / "crafted-client", {"model": model, "optimizer": opt}, strict=False, weights_only=False)
    assert (tmp_path / "ran-crafted-client").exists()


def test_accelerate_round_trips_untrusted_refuses_a_crafted_checkpoint_and_takes_the_setting(
        tmp_path: Path, fresh_state) -> None:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_zinf import Accelerator

    def prepared(**kwargs) -> tuple:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, **kwargs)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return accelerator, model, opt

    accelerator, model, opt = prepared()
    for x, y in _data(8):
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    accelerator, model, opt = prepared()
    accelerator.load_state(str(tmp_path / "state"))  # untrusted: what Accelerate's engine stores loads
    assert model.engine.global_step == 2
    crafted = tmp_path / "crafted"
    shutil.copytree(tmp_path / "state", crafted)
    craft(crafted / "zinf_model", "client", tmp_path / "ran")
    with pytest.raises(CheckpointError, match=REFUSED):
        accelerator.load_state(str(crafted))
    assert not (tmp_path / "ran").exists()
    accelerator, model, opt = prepared(zinf_config={"checkpoint": {"allow_pickle": True}})
    assert model.engine.config.checkpoint.allow_pickle
    accelerator.load_state(str(crafted))
    assert (tmp_path / "ran").exists()  # trusted: the file's pickle ran


@pytest.mark.slow
def test_transformers_trainer_resume_refuses_a_crafted_checkpoint(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # left by the one-rank front ends above: the script runs alone
    from launching import run_launcher

    script = HERE / "trainer_resume_script.py"
    out, outdir = tmp_path / "out.json", tmp_path / "run"

    def run(*args: str, config: dict | None = None) -> dict:
        env = {"ACCELERATE_USE_CPU": "1"}
        if config is not None:
            (tmp_path / "zinf.json").write_text(json.dumps(config))
            env["ZINF_CONFIG"] = str(tmp_path / "zinf.json")
        run_launcher([sys.executable, "-m", "accelerate_zinf.run", str(script), str(out), str(outdir), *args], env=env)
        return json.loads(out.read_text())

    assert run("save") == {"steps": 2}
    assert run("resume", "checkpoint-2") == {"steps": 4}  # untrusted: what the Trainer stores loads
    crafted = outdir / "checkpoint-crafted"
    shutil.copytree(outdir / "checkpoint-2", crafted)
    craft(crafted / "zinf", "client", tmp_path / "ran")
    assert REFUSED in run("resume", "checkpoint-crafted")["error"]
    assert not (tmp_path / "ran").exists()
    assert run("resume", "checkpoint-crafted", config={"checkpoint": {"allow_pickle": True}}) == {"steps": 4}
    assert (tmp_path / "ran").exists()  # the zinf launch config's setting reached the engine
