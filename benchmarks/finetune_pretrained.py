"""Fine-tune a pretrained Hugging Face checkpoint larger than this machine's RAM: LoRA (default) or every parameter,
on N ranks, with the base on NVMe. Every figure is measured on each rank and printed by rank 0.

    python benchmarks/make_pretrained.py /data/llama13b --size 13b            # writes the checkpoint (26 GB, bf16)
    torchrun --nproc_per_node 2 benchmarks/finetune_pretrained.py /data/llama13b --nvme /data/zinf_swap --steps 3
    torchrun --nproc_per_node 2 benchmarks/finetune_pretrained.py /data/llama1b --nvme /data/zinf_swap --full
    torchrun --nproc_per_node 2 benchmarks/finetune_pretrained.py /data/llama13b --nvme /data/zinf_swap --qlora nf4

What it reports, per rank: peak RSS over the whole run (the kernel's high-water mark, VmHWM, and the largest of the
samples taken every 0.2 s), the time to build and load the model against the bytes read from the disk (from
/proc/self/io) and the disk's read bandwidth, each step's time against the NVMe bytes it moved (the engine's
report), each step against two bounds: the disk (every rank's NVMe bytes at the speed ``zinf info --nvme`` measured,
the engine's ``nvme_floor``, summed: the ranks share one disk) and the compute (4 x parameters x tokens per rank for
LoRA, forward and input gradients; 6 x for a full fine-tune; 2 x more with ``--checkpointing``, the recomputation;
at the matmul FLOP/s each rank measures while the others do, before and after the steps), and against the step's
linear-layer products timed at their own shapes with the weights in memory (what a step reaches at best when the
weights' bytes, not the FLOPs, set the pace: a few tokens a rank), the engine's own bytes
per tier, and with ``--qlora`` the bytes per parameter of the quantized base (QLoRA: docs/qlora.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import zinf
from zinf.integrations.quantized import quantized_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness.machine import best_seconds, matmul_peak_flops  # noqa: E402
from harness.rss import RssSampler, proc_field as _proc  # noqa: E402


def _rank_peak(dtype: torch.dtype) -> float:
    """This rank's matmul FLOP/s with the other ranks measuring at the same moment: the share of the machine's peak
    one rank gets while every rank computes (a bf16 product on a CPU without bf16 units is far slower: a smaller
    one keeps the measurement short)."""
    dist.barrier()
    return matmul_peak_flops(n=2048 if dtype == torch.float32 else 512, repeats=3, dtype=dtype)


def _linears_in_memory(model: torch.nn.Module, tokens: int, dtype: torch.dtype, full: bool, checkpointing: bool
                       ) -> float:
    """The seconds this rank's step spends in its linear layers' products when their weights lie in memory in
    ``dtype`` and nothing else runs: for each distinct layer shape, the best of 3 timings of its forward product and
    its input gradient's (and its weight gradient's for a full fine-tune; the forward twice with the recomputation),
    times the layers of that shape, with the other ranks measuring at the same moment. Unlike the square product of
    :func:`_rank_peak`, these run at the step's own shapes (``tokens`` rows), where the weights' bytes rather than the
    FLOPs may set the pace: what a step can reach at best on this machine."""
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(m.in_features, m.out_features)] = shapes.get((m.in_features, m.out_features), 0) + 1
    dist.barrier()
    total = 0.0
    for (n_in, n_out), count in sorted(shapes.items()):
        w = torch.randn(n_out, n_in).to(dtype)  # not in any cache: a layer's weights are read once per product
        x, g = torch.randn(tokens, n_in).to(dtype), torch.randn(tokens, n_out).to(dtype)
        seconds = (1 + checkpointing) * best_seconds(partial(torch.mm, x, w.t()), 3) \
            + best_seconds(partial(torch.mm, g, w), 3)
        if full:
            seconds += best_seconds(partial(torch.mm, g.t(), x), 3)
        total += count * seconds
        del w
    return total


def _batches(args: argparse.Namespace, vocab: int, rank: int) -> list[torch.Tensor]:
    """This rank's token ids for every step, the same for zinf and for ``--ddp``."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a save_pretrained directory (make_pretrained.py writes one)")
    p.add_argument("--nvme", required=True, help="directory for zinf's swap files")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--full", action="store_true", help="train every parameter (default: LoRA on q_proj, v_proj)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--storage", default="precision", choices=["precision", "bf16"],
                   help="param_storage: 'bf16' with --precision fp32 computes in fp32 from bf16 shards (for a CPU "
                        "without bf16 units, where bf16 matmuls are far slower than fp32)")
    p.add_argument("--pool-mib", type=int, default=1024, help="offload.pinned_pool_bytes, in MiB")
    p.add_argument("--sub-group-numel", type=int, default=8 << 20, help="offload.sub_group_numel (optimizer pipeline unit)")
    p.add_argument("--copy-frozen", action="store_true",
                   help="offload.frozen_in_place: false (copy the frozen base to the swap files instead of reading it "
                        "from the checkpoint's files)")
    p.add_argument("--frozen-reads", default="gathered", choices=["gathered", "whole"],
                   help="offload.frozen_reads: each rank reads its own shards of the frozen base, all-gathered, or "
                        "the whole base (ranks on one host)")
    p.add_argument("--prefetch-mib", type=int, default=64,
                   help="overlap.prefetch_bytes, in MiB: gathered ahead, and (reshard 'auto') kept from the forward "
                   "for the backward")
    p.add_argument("--persistent-numel", type=int, default=0,
                   help="overlap.persistent_numel: modules with fewer parameters stay gathered for the run (LoRA "
                        "adapters, norms)")
    p.add_argument("--reshard-after-forward", default="auto", choices=["auto", "always", "never"],
                   help="overlap.reshard_after_forward")
    p.add_argument("--host-keep", default="auto", choices=["auto", "off"],
                   help="overlap.host_keep: on the CPU, groups kept for the backward in a room of host memory")
    p.add_argument("--shared-memory", default="auto", choices=["auto", "chunks", "off"],
                   help="overlap.shared_memory: 'auto' gathers shards from the ranks' shared staging pools, 'chunks' "
                        "copies them through the chunk buffers, 'off' sends them through gloo")
    p.add_argument("--frozen-tile-kib", type=int, default=0,
                   help="tiling.frozen_tile_bytes, in KiB (0: off): frozen 16-bit linears multiplied in fp32 tiles")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer (transformers' gradient_checkpointing_enable, "
                        "non-reentrant): the compute bound counts the recomputed forward")
    p.add_argument("--qlora", default=None, choices=["nf4", "fp4", "int8"],
                   help="load the base in 4 bits (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=...)), or "
                        "in 8 bits (int8: load_in_8bit=True)")
    p.add_argument("--double-quant", action="store_true", help="bnb_4bit_use_double_quant=True (with --qlora)")
    p.add_argument("--trim-heap-bytes", type=int, default=None,
                   help="trim_heap_bytes (default: the engine's; 0: the heap is never trimmed during the step)")
    p.add_argument("--ddp", action="store_true",
                   help="the same steps under plain PyTorch DDP instead, every rank holding the whole model in memory "
                        "in the compute dtype (no zinf): the baseline a step on NVMe is compared with")
    p.add_argument("--out", default=None, help="write the figures as JSON here (rank 0)")
    args = p.parse_args()

    sampler = RssSampler()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.ddp:
        mine = _ddp(args, rank, world, sampler)
        _finish(args, rank, world, mine, "ddp", mine.pop("parameters"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.makedirs(args.nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({
        "precision": args.precision, "param_storage": args.storage,
        "offload": {"params": "nvme", "optimizer": "nvme" if args.full else "cpu",
                    "grads": "nvme" if args.full else "auto", "nvme_paths": [args.nvme],
                    "pinned_pool_bytes": args.pool_mib << 20, "sub_group_numel": args.sub_group_numel,
                    "frozen_in_place": not args.copy_frozen, "frozen_reads": args.frozen_reads},
        "overlap": {"prefetch_bytes": args.prefetch_mib << 20, "reshard_after_forward": args.reshard_after_forward,
                    "host_keep": args.host_keep, "shared_memory": args.shared_memory,
                    "persistent_numel": args.persistent_numel},
        "tiling": {"frozen_tile_bytes": args.frozen_tile_kib << 10},
        **({} if args.trim_heap_bytes is None else {"trim_heap_bytes": args.trim_heap_bytes}),
    })
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(args.model)
    io_before, t0 = _proc("read_bytes:", "/proc/self/io"), time.perf_counter()
    dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[args.precision])
    quantization = {}
    if args.qlora:
        from transformers import BitsAndBytesConfig

        quantization["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True) if args.qlora == "int8" else \
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.qlora,
                               bnb_4bit_use_double_quant=args.double_quant, bnb_4bit_compute_dtype=dtype)
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **quantization)
    load_s, load_read = time.perf_counter() - t0, _proc("read_bytes:", "/proc/self/io") - io_before
    quantized = quantized_bytes(model)  # (this rank's 4-bit or 8-bit shard bytes, the elements they hold)
    rss_after_load = _proc("VmHWM:")
    _checkpointing(args, model)
    if not args.full:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the adapters' initial values: the same on every rank and in every run
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    trainable = [q for q in model.parameters() if q.requires_grad]
    engine = zinf.initialize(model, torch.optim.AdamW(trainable, lr=1e-4), config)
    init_s = time.perf_counter() - t0 - load_s
    model.train()
    compute_dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    peak_before = _rank_peak(compute_dtype)
    n_params = sum(q.numel() for q in dict.fromkeys(model.parameters()))  # a tied weight once
    step_flops = ((6 if args.full else 4) + 2 * args.checkpointing) * n_params * args.batch * args.seq
    compute_bound = step_flops / peak_before  # the same for every step: the rate is measured once, before them
    linears_s = _linears_in_memory(model, args.batch * args.seq, compute_dtype, args.full, args.checkpointing)
    steps = []
    for step, x in enumerate(_batches(args, hf_config.vocab_size, rank)):
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t
        report = engine.report()
        # [floor, ranks without one]: the floor needs the disk's speed, which `zinf info --nvme PATH` measures
        floor = torch.tensor([report.seconds.get("nvme_floor", 0.0), "nvme_floor" not in report.seconds],
                             dtype=torch.float64)
        dist.all_reduce(floor)
        disk_bound = floor[0].item() if floor[1].item() == 0 else None
        steps.append({"seconds": seconds, "loss": loss.item(),
                      "nvme_read": report.counts.get("nvme_read_bytes", 0),
                      "nvme_written": report.counts.get("nvme_written_bytes", 0),
                      "disk_bound_s": disk_bound,
                      "breakdown_s": {k: round(v, 2) for k, v in report.seconds.items()},
                      "counts": dict(report.counts)})
        if rank == 0:
            rec = steps[-1]
            disk = (f"disk {disk_bound:.1f} s" if disk_bound is not None
                    else f"disk not measured (run `zinf info --nvme {args.nvme}` first)")
            slowest, which = max((disk_bound or 0.0, "disk"), (compute_bound, "compute"))
            print(f"step {step + 1}/{args.steps}: loss {loss.item():.4f}, {rec['seconds']:.1f} s, NVMe read "
                  f"{rec['nvme_read'] / 1e9:.2f} GB, written {rec['nvme_written'] / 1e9:.2f} GB; bounds: {disk}, "
                  f"compute {compute_bound:.1f} s ({step_flops / 1e12:.2f} TFLOP at {peak_before / 1e9:.1f} "
                  f"GFLOP/s a rank): {rec['seconds'] / slowest:.1f}x the {which} bound; the linear layers' "
                  f"products with the weights in memory {linears_s:.1f} s ({rec['seconds'] / linears_s:.1f}x); "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in rec["breakdown_s"].items()), flush=True)
    peak_after = _rank_peak(compute_dtype) if args.steps else None
    resident = engine.resident_bytes()
    read_whole = len(engine.placement.whole)  # frozen groups read whole, without a collective
    in_tiles = len(engine.from_storage)  # frozen linears computed from their stored weights (--frozen-tile-kib)
    engine.close()
    mine = {"rank": rank, "peak_rss": _proc("VmHWM:"), "sampled_peak_rss": sampler.stop(), "rss_after_load": rss_after_load,
            "load_s": load_s, "load_read_bytes": load_read, "init_s": init_s, "matmul_flops_before": peak_before,
            "matmul_flops_after": peak_after, "step_flops": step_flops, "compute_bound_s": compute_bound,
            "linears_in_memory_s": linears_s, "steps": steps, "resident": resident, "frozen_groups_read_whole": read_whole,
            "frozen_linears_in_tiles": in_tiles,
            "quantized_bytes_per_parameter": quantized[0] * world / quantized[1] if quantized[1] else None}
    _finish(args, rank, world, mine, "zinf", sum(q.numel() for q in engine.params))


def _finish(args: argparse.Namespace, rank: int, world: int, mine: dict, system: str, parameters: int) -> None:
    """Every rank's figures to rank 0, printed and written as JSON; then the processes end."""
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        summary = {"model": args.model, "system": system, "parameters": parameters, "world": world,
                   "mode": "full" if args.full else "lora", "ranks": every}
        print(json.dumps(summary, indent=1, default=str))
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _checkpointing(args: argparse.Namespace, model: torch.nn.Module) -> None:
    """``--checkpointing``: every decoder layer recomputed in the backward, as transformers does it."""
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _ddp(args: argparse.Namespace, rank: int, world: int, sampler: RssSampler) -> dict:
    """The same model, adapters, data and steps under DistributedDataParallel, the whole model in memory on every
    rank (``--ddp``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from torch.nn.parallel import DistributedDataParallel

    if args.qlora or args.full:
        raise SystemExit("--ddp compares the LoRA run: drop --qlora and --full")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    hf_config = AutoConfig.from_pretrained(args.model)
    dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[args.precision])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    load_s = time.perf_counter() - t0
    _checkpointing(args, model)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    model.train()
    peak_before = _rank_peak(dtype)
    n_params = sum(q.numel() for q in dict.fromkeys(model.parameters()))
    step_flops = (4 + 2 * args.checkpointing) * n_params * args.batch * args.seq
    linears_s = _linears_in_memory(model, args.batch * args.seq, dtype, False, args.checkpointing)
    steps = []
    for step, x in enumerate(_batches(args, hf_config.vocab_size, rank)):
        t = time.perf_counter()
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"seconds": time.perf_counter() - t, "loss": loss.item()})
        if rank == 0:
            print(f"step {step + 1}/{args.steps} (DDP): loss {loss.item():.4f}, {steps[-1]['seconds']:.1f} s, "
                  f"{steps[-1]['seconds'] / (step_flops / peak_before):.1f}x the compute bound, "
                  f"{steps[-1]['seconds'] / linears_s:.1f}x the linear layers' products ({linears_s:.1f} s)", flush=True)
    return {"rank": rank, "peak_rss": _proc("VmHWM:"), "sampled_peak_rss": sampler.stop(), "load_s": load_s,
            "matmul_flops_before": peak_before, "step_flops": step_flops, "compute_bound_s": step_flops / peak_before,
            "linears_in_memory_s": linears_s, "steps": steps, "parameters": n_params}


if __name__ == "__main__":
    main()
