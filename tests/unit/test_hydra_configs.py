"""The engine config and the front ends as Hydra structured configs (zinf.hydra_configs).

Two layers refuse bad settings, each naming the key: Hydra/OmegaConf when the config is composed (unknown
keys, wrong types, from the command line or from the app's own YAML), the engine in ZeroConfig.from_dict
(values outside the allowed ones, a ??? left unset).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hydra")
from hydra import compose, initialize, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import MissingMandatoryValue  # noqa: E402

from zinf import ConfigError, ZeroConfig  # noqa: E402
from zinf.hydra_configs import PRESETS, preset_node, register_configs  # noqa: E402
import processes

REPO = Path(__file__).resolve().parents[2]
PATHS = "zinf.offload.nvme_paths=[/mnt/a,/mnt/b]"

# what each preset must come to, written out here rather than read from PRESETS
EXPECTED: dict[str, dict[str, Any]] = {
    "schema": {},
    "default": {},
    "cpu_offload": {"offload": {"optimizer": "cpu"}},
    "cpu_offload_all": {"offload": {"params": "cpu", "optimizer": "cpu"}},
    "nvme": {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": ["/mnt/a", "/mnt/b"]}},
    "bf16": {"precision": "bf16"},
}

APP_YAML = """\
defaults:
  - zinf: default
  - strategy: zero_infinity
  - _self_
zinf:
  overlap:
    prefetch_modules: 2
"""


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_configs()


def compose_bare(*overrides: str) -> DictConfig:
    """A user's app with no primary config of its own: only what register_configs stored."""
    with initialize(version_base=None, config_path=None):
        return compose(config_name=None, overrides=list(overrides))


def compose_app(tmp_path: Path, *overrides: str, app: str = APP_YAML, files: dict[str, str] | None = None) -> DictConfig:
    """A user's app with a config.yaml (and maybe YAML files of its own) in a config directory."""
    (tmp_path / "config.yaml").write_text(app)
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def error_text(exc: BaseException) -> str:
    """An exception's message with the messages of its causes (Hydra wraps OmegaConf's errors)."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def test_without_hydra_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hydra.core.config_store", None)  # as if hydra-core were not installed
    with pytest.raises(ImportError, match=r"pip install 'zinf\[hydra\]'"):
        register_configs()


def test_presets_are_the_documented_set() -> None:
    assert set(PRESETS) | {"schema"} == set(EXPECTED)
    with pytest.raises(KeyError, match="the presets are"):
        preset_node("nvme_fast")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_preset_composes_to_its_zero_config(name: str) -> None:
    cfg = compose_bare(f"+zinf={name}", *([PATHS] if name == "nvme" else []))
    assert OmegaConf.get_type(cfg.zinf) is ZeroConfig  # typed by the schema, so overrides are checked
    assert ZeroConfig.from_dict(cfg.zinf) == ZeroConfig.from_dict(EXPECTED[name])
    assert OmegaConf.to_object(cfg.zinf) == ZeroConfig.from_dict(EXPECTED[name])  # the other way to the object


def test_overrides_apply_on_top_of_a_preset() -> None:
    cfg = compose_bare("+zinf=cpu_offload", "zinf.precision=bf16", "zinf.overlap.prefetch_modules=2",
                       "zinf.unit_modules=[blocks.*.mlp]", "zinf.gradient_clipping=1")
    got = ZeroConfig.from_dict(cfg.zinf)
    assert got == ZeroConfig.from_dict({"precision": "bf16", "overlap": {"prefetch_modules": 2},
                                        "unit_modules": ["blocks.*.mlp"], "gradient_clipping": 1.0,
                                        "offload": {"optimizer": "cpu"}})
    assert type(got.gradient_clipping) is float


def test_app_config_with_defaults_list(tmp_path: Path) -> None:
    cfg = compose_app(tmp_path, "zinf=nvme", "zinf.offload.nvme_paths=[/mnt/a]")
    assert ZeroConfig.from_dict(cfg.zinf) == ZeroConfig.from_dict(
        {"overlap": {"prefetch_modules": 2}, "offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": ["/mnt/a"]}})


@pytest.mark.parametrize("override,key", [
    ("zinf.offlaod.params=cpu", "zinf.offlaod"),
    ("zinf.precison=bf16", "zinf.precison"),
    ("zinf.offload.param=cpu", "zinf.offload.param"),
])
def test_misspelt_key_is_refused_when_composing(override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_bare("+zinf=default", override)
    assert key in error_text(err.value)


@pytest.mark.parametrize("override,key", [
    ("zinf.gradient_clipping=abc", "zinf.gradient_clipping"),
    ("zinf.overlap.prefetch_modules=2.5", "zinf.overlap.prefetch_modules"),
    ("zinf.offload.nvme_paths=/mnt/a", "zinf.offload.nvme_paths"),
    ("zinf.offload.overlap_optimizer=maybe", "zinf.offload.overlap_optimizer"),
    ("zinf.offload=nvme", "zinf.offload"),
])
def test_wrong_type_is_refused_when_composing(override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_bare("+zinf=nvme", override)
    assert key in error_text(err.value)


def test_misspelt_key_or_wrong_type_in_the_apps_own_yaml(tmp_path: Path) -> None:
    typo = APP_YAML.replace("prefetch_modules: 2", "prefetch_module: 2")
    with pytest.raises(ConfigCompositionException) as err:
        compose_app(tmp_path, app=typo)
    assert "zinf.overlap.prefetch_module" in error_text(err.value)
    wrong = APP_YAML.replace("prefetch_modules: 2", "prefetch_modules: two")
    with pytest.raises(ConfigCompositionException) as err:
        compose_app(tmp_path, app=wrong)
    assert "zinf.overlap.prefetch_modules" in error_text(err.value)


def test_the_apps_own_preset_is_checked_against_the_schema(tmp_path: Path) -> None:
    mine = "defaults:\n  - schema\n  - _self_\nprecision: bf16\noffload:\n  optimizer: cpu\n"
    cfg = compose_app(tmp_path, "zinf=mine", files={"zinf/mine.yaml": mine})
    assert ZeroConfig.from_dict(cfg.zinf) == ZeroConfig.from_dict(
        {"precision": "bf16", "overlap": {"prefetch_modules": 2}, "offload": {"optimizer": "cpu"}})
    with pytest.raises(ConfigCompositionException) as err:
        compose_app(tmp_path, "zinf=mine", files={"zinf/mine.yaml": mine.replace("optimizer:", "optimiser:")})
    assert "optimiser" in error_text(err.value)


@pytest.mark.parametrize("override,message", [
    ("zinf.offload.params=gpu", r"'offload.params' = 'gpu' is not allowed; expected one of \['device', 'cpu', 'nvme'\]"),
    ("zinf.precision=fp8", r"'precision' = 'fp8' is not allowed"),
    ("zinf.gradient_clipping=-1", r"'gradient_clipping' = -1.0 is not allowed; expected a number >= 0"),
])
def test_allowed_values_are_the_engines_to_check(override: str, message: str) -> None:
    cfg = compose_bare("+zinf=default", override)  # a string or a number: OmegaConf's types let it through
    with pytest.raises(ConfigError, match=message):
        ZeroConfig.from_dict(cfg.zinf)
    with pytest.raises(ConfigError, match=message):
        OmegaConf.to_object(cfg.zinf)


def test_nvme_preset_without_paths_fails_naming_the_setting() -> None:
    cfg = compose_bare("+zinf=nvme")  # composes: ??? is only an error when it is read
    assert OmegaConf.is_missing(cfg.zinf.offload, "nvme_paths")
    with pytest.raises(MissingMandatoryValue, match="zinf.offload.nvme_paths"):
        OmegaConf.to_object(cfg.zinf)
    with pytest.raises(ConfigError, match=r"'zinf.offload.nvme_paths' has no value \(\?\?\? in the config"):
        ZeroConfig.from_dict(cfg.zinf)
    with pytest.raises(ConfigError, match=r"'offload.nvme_paths' has no value"):
        ZeroConfig.from_dict(preset_node("nvme"))


def test_strategy_node_builds_the_lightning_strategy(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from hydra.utils import instantiate

    from lightning_zinf import ZeroInfinityFabricStrategy, ZeroInfinityStrategy

    cfg = compose_app(tmp_path, "zinf=cpu_offload", "zinf.precision=bf16")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, ZeroInfinityStrategy)
    assert strategy.zero_config == ZeroConfig.from_dict(cfg.zinf)
    assert strategy.zero_config.offload.optimizer == "cpu" and strategy.zero_config.overlap.prefetch_modules == 2
    fabric_cfg = compose_app(tmp_path, "zinf=bf16", "strategy=zero_infinity_fabric")
    fabric_strategy = instantiate(fabric_cfg.strategy)
    assert isinstance(fabric_strategy, ZeroInfinityFabricStrategy)
    assert fabric_strategy.zero_config == ZeroConfig.from_dict({"precision": "bf16", "overlap": {"prefetch_modules": 2}})


def test_accelerator_node_hands_the_zinf_node_to_accelerate_zinf() -> None:
    pytest.importorskip("accelerate")
    from hydra.utils import get_class

    import accelerate_zinf

    cfg = compose_bare("+zinf=nvme", PATHS, "+accelerator=zinf")
    assert get_class(cfg.accelerator._target_) is accelerate_zinf.Accelerator
    # what Accelerator(zinf_config=...) does with it
    assert accelerate_zinf.engine_config(cfg.accelerator.zinf_config) == ZeroConfig.from_dict(EXPECTED["nvme"])


# -- the example, end to end ---------------------------------------------------------------------------------
def _example(tmp_path: Path, *overrides: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = processes.env_without_launch()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "core"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return processes.run([sys.executable, str(REPO / "examples/hydra/train.py"), f"hydra.run.dir={tmp_path / 'run'}",
                           *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_example_refuses_bad_settings_before_training(tmp_path: Path) -> None:
    typo = _example(tmp_path, "zinf.offlaod.params=cpu", timeout=120)
    assert typo.returncode != 0 and "zinf.offlaod" in typo.stderr
    no_paths = _example(tmp_path, "zinf=nvme", timeout=120)
    assert no_paths.returncode != 0 and "'zinf.offload.nvme_paths' has no value" in no_paths.stderr


def test_example_refuses_a_bad_value_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZINF_TRACEBACK", raising=False)
    run = _example(tmp_path, "zinf.precision=fp64", timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(lines) == 1, run.stderr
    assert "'precision' = 'fp64'" in lines[0]


@pytest.mark.slow
def test_example_trains_with_a_preset_and_overrides(tmp_path: Path) -> None:
    start = time.monotonic()
    # fp32 compute with bf16 parameter storage: bf16 compute is hundreds of times slower on CPUs without bf16 units
    run = _example(tmp_path, "zinf=cpu_offload", "zinf.param_storage=bf16", "trainer.max_steps=3", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final train loss" in run.stdout
    assert time.monotonic() - start < 300
