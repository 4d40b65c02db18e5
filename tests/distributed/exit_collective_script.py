"""A script that ends right after a collective, run under torchrun by test_clean_exit.py: a zinf engine over a small
torch model trains 4 steps, the last loss is summed over the ranks, and the script ends with no other line. A gloo
worker thread may still be releasing that collective when the interpreter finalizes: the end where the abort of
[Note: the end of a run] (zinf/shutdown.py) is most likely.

    torchrun --nproc_per_node 2 exit_collective_script.py {memory,nvme} [NVME_DIR]

``nvme``: parameters and optimizer states on NVMe, the CPU-Adam stepping in the background, so that zinf's own worker
threads (the background step, the asynchronous I/O) are running when the script ends.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import zinf

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
config = ({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [sys.argv[2]], "overlap_optimizer": True,
                       "pinned_pool_bytes": 8 * 2**20}} if sys.argv[1] == "nvme" else {})
engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
generator = torch.Generator().manual_seed(rank)
for _ in range(4):
    x = torch.randn(16, 32, generator=generator)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
total = loss.detach().clone()
dist.all_reduce(total)
