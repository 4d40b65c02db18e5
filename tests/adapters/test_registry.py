"""Names, precision conversion and configuration, without starting processes."""

from __future__ import annotations

import pytest

import lightning_zinf
import zinf
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry


@pytest.mark.parametrize("registry", [StrategyRegistry, STRATEGY_REGISTRY], ids=["pytorch", "fabric"])
def test_names_registered(registry) -> None:
    for name in ("zero_infinity", "zero_infinity_offload", "zero_infinity_nvme"):
        assert name in registry


def test_offload_presets_configure_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    trainer = Trainer(strategy="zero_infinity_offload", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.zero_config.offload.params == "cpu" and trainer.strategy.zero_config.offload.optimizer == "cpu"
    monkeypatch.delenv("ZINF_NVME_PATHS", raising=False)
    with pytest.raises(ValueError, match="set ZINF_NVME_PATHS"):
        Trainer(strategy="zero_infinity_nvme", accelerator="cpu", devices=2, logger=False)
    monkeypatch.setenv("ZINF_NVME_PATHS", str(tmp_path))
    fabric = Fabric(strategy="zero_infinity_nvme", accelerator="cpu", devices=2)
    assert fabric.strategy.zero_config.offload.nvme_paths == [str(tmp_path)]
    assert fabric.strategy.zero_config.offload.optimizer == "nvme"


def test_a_whole_config_on_a_preset_changes_only_what_it_sets() -> None:
    """A ZeroConfig (or a typed Hydra node) carries every default; only the settings it changes go on top of the
    preset, so the offload the preset names stays."""
    from lightning_zinf._shared import offload_preset

    for config in (zinf.ZeroConfig.from_dict({"precision": "bf16"}), {"precision": "bf16"}):
        cfg = offload_preset("zero_infinity_offload", config)
        assert cfg["offload"]["params"] == cfg["offload"]["optimizer"] == "cpu" and cfg["precision"] == "bf16"
    cfg = offload_preset("zero_infinity_offload", zinf.ZeroConfig.from_dict({"offload": {"overlap_optimizer": False}}))
    assert cfg["offload"]["params"] == "cpu" and cfg["offload"]["overlap_optimizer"] is False


@pytest.mark.parametrize("flag,expected", [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"),
                                           ("16-mixed", "fp16")])
def test_precision_flags_become_engine_precision(flag: str, expected: str) -> None:
    strategy = lightning_zinf.ZeroInfinityStrategy()
    Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=flag, logger=False)
    assert isinstance(strategy.precision_plugin, lightning_zinf.ZeroInfinityPrecision)
    # "16-mixed" on CPU: Lightning itself switches to bf16-mixed before the strategy sees it
    assert strategy.zero_config.precision == ("bf16" if flag == "16-mixed" else expected)
    fabric_strategy = lightning_zinf.ZeroInfinityFabricStrategy()
    if flag != "16-mixed":
        Fabric(strategy=fabric_strategy, accelerator="cpu", devices=2, precision=flag)
        assert isinstance(fabric_strategy.precision, lightning_zinf.ZeroInfinityFabricPrecision)
        assert fabric_strategy.zero_config.precision == expected


def test_config_precision_and_conflicts() -> None:
    strategy = lightning_zinf.ZeroInfinityStrategy({"precision": "bf16"})
    Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # default "32-true": config wins
    assert strategy.zero_config.precision == "bf16"
    with pytest.raises(ValueError, match="Set only one of them"):
        Trainer(strategy=lightning_zinf.ZeroInfinityStrategy({"precision": "fp16"}), accelerator="cpu", devices=2,
                precision="bf16-mixed", logger=False)
    with pytest.raises(ValueError, match="not supported"):
        Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, precision="64-true", logger=False)
    with pytest.raises(zinf.ConfigError, match="gradient_clipping"):
        lightning_zinf.ZeroInfinityStrategy({"gradient_clip": 1.0})


def test_usable_by_class_path() -> None:
    hydra_utils = pytest.importorskip("hydra.utils")
    strategy = hydra_utils.instantiate({"_target_": "lightning_zinf.ZeroInfinityStrategy",
                                        "config": {"precision": "bf16", "overlap": {"prefetch_modules": 2}}})
    assert isinstance(strategy, lightning_zinf.ZeroInfinityStrategy)
    assert strategy.zero_config.overlap.prefetch_modules == 2


def test_usable_by_path_from_hydra_and_lightning_cli() -> None:
    from hydra.utils import instantiate
    from lightning.pytorch.cli import instantiate_class

    from lightning_zinf import ZeroInfinityStrategy

    hydra_made = instantiate({"_target_": "lightning_zinf.ZeroInfinityStrategy",
                              "config": {"precision": "bf16", "overlap": {"prefetch_modules": 2}}})
    assert isinstance(hydra_made, ZeroInfinityStrategy)
    assert hydra_made.zero_config.precision == "bf16" and hydra_made.zero_config.overlap.prefetch_modules == 2
    cli_made = instantiate_class((), {"class_path": "lightning_zinf.ZeroInfinityStrategy",
                                      "init_args": {"config": {"gradient_clipping": 1.0}}})
    assert isinstance(cli_made, ZeroInfinityStrategy) and cli_made.zero_config.gradient_clipping == 1.0
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="unknown key 'precison'. Did you mean 'precision'"):  # ours, inside Hydra's
        instantiate({"_target_": "lightning_zinf.ZeroInfinityStrategy", "config": {"precison": "bf16"}})
