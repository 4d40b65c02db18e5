"""A user's script, run under torchrun by test_clean_exit.py: a small transformers Llama trained 4 AdamW steps under
DDP and saved, loaded again with ``from_pretrained`` under ``zinf.Init`` and trained 4 steps through the engine, the
mean loss over the ranks printed, then the end.

    torchrun --nproc_per_node 2 exit_script.py CHECKPOINT_DIR {tidy,bare}

``tidy`` ends as examples do (``engine.close()``, ``dist.destroy_process_group()``); ``bare`` calls neither. The DDP
model stays referenced to the end, as in a script that keeps its variables: it holds the process group past a
``destroy_process_group()``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import zinf

VOCAB, SEQ, BATCH = 256, 32, 4


def batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


if __name__ == "__main__":  # at module level, as scripts are: every variable lives until the interpreter ends
    path, ending = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for ids in batches(rank, 4):
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        model.save_pretrained(path)
    dist.barrier()

    zconfig = zinf.ZeroConfig()
    with zinf.Init(config=zconfig):
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = zinf.initialize(loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-3), zconfig)
    for ids in batches(rank, 4):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"mean loss {mean.item() / dist.get_world_size():.4f}", flush=True)
    if ending == "tidy":
        engine.close()
        dist.destroy_process_group()

