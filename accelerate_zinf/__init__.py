"""Accelerate front end of zinf (ZeRO-Infinity for PyTorch).

Two ways in:

- one changed import: ``from accelerate_zinf import Accelerator`` in the script, launched with
  ``accelerate launch --config_file <an ordinary Accelerate config> train.py``; engine settings from
  ``Accelerator(zinf_config=...)``, the YAML named by ``ZINF_CONFIG``, or the defaults;
- no change at all: ``zinf launch --config run.yaml train.py`` with one YAML holding Accelerate's keys
  and a ``zinf:`` section (see :mod:`accelerate_zinf.launch`).
"""

import logging

from accelerate_zinf.accelerator import Accelerator
from accelerate_zinf.settings import ENV_CONFIG, engine_config
from accelerate_zinf.wrappers import ZinfModel, ZinfOptimizer

logging.getLogger(__name__).addHandler(logging.NullHandler())

ZinfAccelerator = Accelerator

__all__ = ["Accelerator", "ZinfAccelerator", "ZinfModel", "ZinfOptimizer", "ENV_CONFIG", "engine_config"]
