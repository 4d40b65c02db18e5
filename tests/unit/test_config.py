import pytest
from omegaconf import OmegaConf

import zinf
from zinf import ConfigError, ZeroConfig


def test_defaults_and_nested_from_dict() -> None:
    cfg = ZeroConfig.from_dict({"precision": "bf16", "overlap": {"prefetch_bytes": 1024}})
    assert cfg.precision == "bf16" and cfg.overlap.prefetch_bytes == 1024 and cfg.overlap.prefetch_modules == 4
    assert ZeroConfig().compute_dtype.is_floating_point


def test_unknown_key_names_key_and_suggests() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'precison'.*Did you mean 'precision'"):
        ZeroConfig.from_dict({"precison": "bf16"})
    with pytest.raises(ConfigError, match=r"unknown key 'overlap.prefetch_byte'.*'overlap.prefetch_bytes'"):
        ZeroConfig.from_dict({"overlap": {"prefetch_byte": 1}})


@pytest.mark.parametrize("key,value,allowed", [
    ("precision", "fp8", "one of"), ("reduce_dtype", "fp64", "one of"), ("gradient_clipping", -1.0, ">= 0"),
    ("detect_external_params", "yes", "true or false"),
])
def test_bad_value_names_key_value_and_allowed(key: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' = {value!r} is not allowed; expected .*{allowed}"):
        ZeroConfig.from_dict({key: value})


def test_nested_bad_value() -> None:
    with pytest.raises(ConfigError, match=r"'loss_scale.backoff_factor' = 2.0"):
        ZeroConfig.from_dict({"loss_scale": {"backoff_factor": 2.0}})


def test_omegaconf_structured_and_dictconfig() -> None:
    structured = OmegaConf.structured(ZeroConfig)
    merged = OmegaConf.merge(structured, OmegaConf.create({"precision": "fp16", "loss_scale": {"initial_scale": 1024.0}}))
    cfg = ZeroConfig.from_dict(merged)
    assert cfg.precision == "fp16" and cfg.loss_scale.initial_scale == 1024.0
    assert ZeroConfig.from_dict(OmegaConf.create(cfg.to_dict())) == cfg


def test_initialize_accepts_dict() -> None:
    import torch

    model = torch.nn.Linear(3, 2)
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"gradient_clipping": 1.0})
    assert engine.config.gradient_clipping == 1.0
