import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py and tests/dist_utils.py

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    """[Note: reaping] in tests/processes.py: nothing a test started outlives the run, Ctrl-C included."""
    import processes

    processes.kill_leftovers()
