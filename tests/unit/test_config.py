import pytest
import torch
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
    with pytest.raises(ConfigError, match=r"'offload.aio_bytes_per_s' = -1 .*0: no cap"):
        ZeroConfig.from_dict({"offload": {"aio_bytes_per_s": -1}})


def test_shared_memory_names_its_values() -> None:
    assert ZeroConfig().overlap.shared_memory == "auto"
    with pytest.raises(ConfigError, match=r"'overlap.shared_memory' = 'on' .*'auto', 'chunks', 'off'"):
        ZeroConfig.from_dict({"overlap": {"shared_memory": "on"}})
    assert ZeroConfig().overlap.bucket_bytes("gloo", same_host=True) == 0
    assert ZeroConfig.from_dict({"overlap": {"reduce_bucket_bytes": 1 << 20}}).overlap.bucket_bytes("gloo", True) == 1 << 20


def test_reshard_after_forward_names_its_values() -> None:
    assert ZeroConfig().overlap.reshard_after_forward == "auto"
    with pytest.raises(ConfigError, match=r"'overlap.reshard_after_forward' = 'no' .*'auto', 'always', 'never'"):
        ZeroConfig.from_dict({"overlap": {"reshard_after_forward": "no"}})
    with pytest.raises(ConfigError, match=r"'overlap.reshard_after_forward' = False .*a string"):
        ZeroConfig.from_dict({"overlap": {"reshard_after_forward": False}})


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


# -- types checked at the boundary (see [Note: config types] in zinf/config_types.py) -------------------------
WRONG_TYPES = {
    "string for a list of paths": ({"offload": {"nvme_paths": "/mnt/a"}},
                                   ["'offload.nvme_paths' = '/mnt/a'", "a list of strings (list[str])", "got str",
                                    'Write it as a list, e.g. ["/mnt/a"]']),
    "numeric string for a float": ({"gradient_clipping": "1.0"},
                                   ["'gradient_clipping' = '1.0'", "a number (float)", "got str", "Write 1.0 without quotes"]),
    "string for the offload section": ({"offload": "nvme"},
                                       ["'offload' = 'nvme'", "a mapping of offload settings (OffloadConfig)", "got str",
                                        "'params', 'optimizer', 'grads', 'nvme_paths'"]),
    "fraction for an int": ({"offload": {"sub_group_numel": 5000.5}},
                            ["'offload.sub_group_numel' = 5000.5", "an integer (int)", "got float", "e.g. 5000"]),
    "fraction for a count": ({"overlap": {"prefetch_modules": 2.5}},
                             ["'overlap.prefetch_modules' = 2.5", "an integer (int)", "got float"]),
    "bool for an int": ({"overlap": {"prefetch_bytes": True}},
                        ["'overlap.prefetch_bytes' = True", "an integer (int)", "got bool", "true/false is not a number"]),
    "whole float for an int": ({"log_every_n_steps": 10.0},
                               ["'log_every_n_steps' = 10.0", "an integer (int)", "got float", "Write 10 (no decimal point)"]),
    "numeric string for an int": ({"loss_scale": {"growth_interval": "1000"}},
                                  ["'loss_scale.growth_interval' = '1000'", "an integer (int)", "got str",
                                   "Write 1000 without quotes"]),
    "bool for a float": ({"collective_timeout_s": False},
                         ["'collective_timeout_s' = False", "a number (float)", "got bool"]),
    "string for a bool": ({"offload": {"overlap_optimizer": "false"}},
                          ["'offload.overlap_optimizer' = 'false'", "true or false (bool)", "got str",
                           "Write true or false without quotes"]),
    "int for a bool": ({"cast_forward_inputs": 1}, ["'cast_forward_inputs' = 1", "true or false (bool)", "got int"]),
    "int for a string": ({"precision": 16}, ["'precision' = 16", "a string (str)", "got int"]),
    "string for a list": ({"unit_modules": "MoE"},
                          ["'unit_modules' = 'MoE'", "a list of strings (list[str])", "got str", '["MoE"]']),
    "non-string item in unit_modules": ({"unit_modules": ["MoE", 3]},
                                        ["'unit_modules[1]' = 3", "a string (str)", "got int"]),
    "string item in a list of ints": ({"tiling": {"min_numel": 1, "tiles": [2, "2"]}},
                                      ["'tiling.tiles[1]' = '2'", "an integer (int)", "got str", "Write 2 without quotes"]),
    "string for a whole section": ({"activation_checkpointing": "Block"},
                                   ["'activation_checkpointing' = 'Block'", "(CheckpointingConfig)", "got str",
                                    "'modules', 'offload'"]),
    "empty section": ({"overlap": None}, ["'overlap' = None", "(OverlapConfig)", "got NoneType", "or leave it out"]),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_type_names_key_value_type_and_fix(case: str) -> None:
    settings, expected = WRONG_TYPES[case]
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_dict(settings)
    for text in expected:
        assert text in str(err.value), f"{case}: {text!r} not in {err.value}"


def test_types_are_checked_on_direct_construction_too() -> None:
    with pytest.raises(ConfigError, match=r"'gradient_clipping' = '1.0' is not allowed; expected a number \(float\), got str"):
        ZeroConfig(gradient_clipping="1.0")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'offload.sub_group_numel' = 5000.5 .* got float"):
        zinf.config.OffloadConfig(sub_group_numel=5000.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'offload' = 'nvme' is not allowed; expected a mapping of offload settings"):
        ZeroConfig(offload="nvme")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown key 'offload.param'. Did you mean 'offload.params'"):
        ZeroConfig(offload={"param": "cpu"})  # type: ignore[arg-type]
    built = ZeroConfig(offload={"params": "cpu", "optimizer": "cpu"})  # type: ignore[arg-type]
    assert built == ZeroConfig.from_dict({"offload": {"params": "cpu", "optimizer": "cpu"}})


def test_lossless_conversions_only() -> None:
    cfg = ZeroConfig.from_dict({"gradient_clipping": 1, "tiling": {"min_numel": 1, "tiles": (2, 2)}})
    assert type(cfg.gradient_clipping) is float and cfg.gradient_clipping == 1.0
    assert cfg.tiling.tiles == [2, 2]
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_wrong_type_in_a_yaml_file_names_the_key(tmp_path) -> None:
    path = tmp_path / "zinf.yaml"
    path.write_text("offload:\n  optimizer: nvme\n  nvme_paths: /mnt/a\n")
    with pytest.raises(ConfigError, match=r"'offload.nvme_paths' = '/mnt/a' is not allowed"):
        zinf.config.load_config_file(str(path))


def test_collective_timeout_s() -> None:
    assert ZeroConfig().collective_timeout_s == 0.0
    assert ZeroConfig.from_dict({"collective_timeout_s": 30}).collective_timeout_s == 30.0
    with pytest.raises(ConfigError, match=r"'collective_timeout_s' = -1.0 is not allowed; expected a number of seconds >= 0"):
        ZeroConfig.from_dict({"collective_timeout_s": -1.0})


def test_numpy_numbers_are_taken_as_the_numbers_they_are() -> None:
    import numpy as np

    cfg = zinf.ZeroConfig.from_dict({"offload": {"pinned_pool_bytes": np.int64(4 << 20)}, "gradient_clipping": np.float32(1.0),
                                     "detect_external_params": np.bool_(True)})
    assert type(cfg.offload.pinned_pool_bytes) is int and cfg.gradient_clipping == 1.0
    assert cfg.detect_external_params is True
    with pytest.raises(ConfigError, match=r"'overlap.prefetch_modules' = np.float64\(2.5\) is not allowed"):
        zinf.ZeroConfig.from_dict({"overlap": {"prefetch_modules": np.float64(2.5)}})
    with pytest.raises(ConfigError, match="'gradient_clipping' = np.True_ is not allowed"):
        zinf.ZeroConfig.from_dict({"gradient_clipping": np.bool_(True)})


def test_broadcast_buffers() -> None:
    assert ZeroConfig().broadcast_buffers is True  # DDP's default
    assert ZeroConfig.from_dict({"broadcast_buffers": False}).broadcast_buffers is False
    structured = OmegaConf.merge(OmegaConf.structured(ZeroConfig), OmegaConf.from_dotlist(["broadcast_buffers=false"]))
    assert ZeroConfig.from_dict(structured).broadcast_buffers is False
    with pytest.raises(ConfigError, match=r"'broadcast_buffers' = 'no' is not allowed; expected true or false \(bool\), got str"):
        ZeroConfig.from_dict({"broadcast_buffers": "no"})
    with pytest.raises(ConfigError, match=r"'broadcast_buffers' = 0 is not allowed; expected true or false \(bool\), got int"):
        ZeroConfig.from_dict({"broadcast_buffers": 0})
    with pytest.raises(ConfigError, match=r"unknown key 'broadcast_buffer'. Did you mean 'broadcast_buffers'"):
        ZeroConfig.from_dict({"broadcast_buffer": True})


def test_trim_heap_bytes() -> None:
    assert ZeroConfig().trim_heap_bytes == 64 * 2**20
    assert ZeroConfig.from_dict({"trim_heap_bytes": 0}).trim_heap_bytes == 0
    with pytest.raises(ConfigError, match=r"'trim_heap_bytes' = -1 is not allowed; expected an integer >= 0 \(0 turns it off\)"):
        ZeroConfig.from_dict({"trim_heap_bytes": -1})


def test_optimizer_storage_names_its_values_and_its_tier() -> None:
    assert ZeroConfig.from_dict({"optimizer_storage": "bf16", "offload": {"optimizer": "cpu"}}).moment_dtype \
        == torch.bfloat16
    with pytest.raises(ConfigError, match=r"'optimizer_storage' = 'fp16' is not allowed; expected one of \['fp32', 'bf16', 'int8'\]"):
        ZeroConfig.from_dict({"optimizer_storage": "fp16", "offload": {"optimizer": "cpu"}})
    with pytest.raises(ConfigError, match=r"'optimizer_storage' = 'bf16' .*offload.optimizer to 'cpu' or 'nvme'"):
        ZeroConfig.from_dict({"optimizer_storage": "bf16"})
