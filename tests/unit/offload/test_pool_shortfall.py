"""A pinned pool too small for a placement is refused with the settings that would fix that case: a lower
``offload.sub_group_numel`` only where the optimizer's sub-groups are what the pool cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.offload import OffloadSpaceError


def _refusal(tmp_path: Path, **offload: object) -> str:
    cfg = zinf.ZeroConfig.from_dict({"offload": {"nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 1 << 20,
                                                 **offload}})
    model = nn.Linear(1024, 1024)
    with pytest.raises(OffloadSpaceError, match=r"offload.pinned_pool_bytes = 1048576 is too small") as ei:
        zinf.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    return str(ei.value)


def test_parameter_shards_alone_do_not_suggest_sub_groups(tmp_path: Path) -> None:
    text = _refusal(tmp_path, params="nvme", optimizer="device")  # no optimizer sub-group is staged at all
    assert "sub_group_numel" not in text
    assert "Raise offload.pinned_pool_bytes to at least" in text and "offload.params" in text


def test_optimizer_sub_groups_suggest_a_smaller_sub_group(tmp_path: Path) -> None:
    text = _refusal(tmp_path, params="cpu", optimizer="nvme", grads="cpu")
    assert "lower offload.sub_group_numel" in text and "offload.params" not in text


def test_sub_groups_are_not_named_where_the_parameter_shards_alone_overflow(tmp_path: Path) -> None:
    text = _refusal(tmp_path, params="nvme", optimizer="nvme", grads="cpu")  # a 4 MiB shard: 8 MiB blocks
    assert "sub_group_numel" not in text and "Raise offload.pinned_pool_bytes to at least" in text


def test_a_smaller_sub_group_fits_where_the_message_says_so(tmp_path: Path) -> None:
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "cpu", "optimizer": "nvme", "grads": "cpu",
                                                 "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 1 << 20,
                                                 "sub_group_numel": 4096}})
    model = nn.Linear(1024, 1024)
    zinf.initialize(model, torch.optim.AdamW(model.parameters()), cfg).close()
