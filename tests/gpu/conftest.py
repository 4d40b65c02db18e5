"""What the GPU tests share: deterministic CUDA kernels for the tests that compare runs bit for bit or closely."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts here or in a spawned rank


@pytest.fixture
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
