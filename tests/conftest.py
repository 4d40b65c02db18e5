import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py and tests/dist_utils.py

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves the process's environment as it found it. A run in this process (Lightning, Accelerate)
    sets a launch's variables (LOCAL_RANK, MASTER_PORT, PL_GLOBAL_SEED...): kept, they would reach the launches of
    later tests, and dist_utils would spawn fresh interpreters for every later run instead of forking its server."""
    from dist_utils import PER_TEST_ENV

    before = {k: v for k, v in os.environ.items() if k not in PER_TEST_ENV}
    yield
    for key in [k for k in os.environ if k not in before and k not in PER_TEST_ENV]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    """[Note: reaping] in tests/processes.py: nothing a test started outlives the run, Ctrl-C included."""
    import processes

    processes.kill_leftovers()
