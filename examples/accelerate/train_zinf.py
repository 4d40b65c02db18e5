"""The same loop as train.py with one changed import: ``from accelerate_zinf import Accelerator``.

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/accelerate_cpu.yaml examples/accelerate/train_zinf.py

Engine settings come from ``Accelerator(zinf_config=...)``, else the YAML named by ZINF_CONFIG (e.g.
ZINF_CONFIG=examples/accelerate/zinf_cpu_offload.yaml, whose zinf: section is used), else the defaults.
"""

import os
import sys

from accelerate_zinf import Accelerator  # the one changed line

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import main  # noqa: E402

if __name__ == "__main__":
    main(Accelerator)
