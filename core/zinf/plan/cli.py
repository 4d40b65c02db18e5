"""``zinf plan``'s arguments and its run (the ``zinf`` command line wires them in zinf/cli.py)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]

EXAMPLES = """examples:
  zinf plan --params 1.3e9 --layers 24 --hidden 2048 --nvme /mnt/nvme0 --precision bf16
  zinf plan --hf-config llama --hf-kwargs '{"num_hidden_layers": 32, "hidden_size": 4096}' --world 8
  zinf plan --module mypkg.models:build_model --json
  zinf plan --hf-config llama --qlora --nvme /mnt/nvme0 --checkpoint /data/llama-13b --world 2
"""


def _count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 1.3e9, found {text!r}") from None


PARSER_OPTIONS = {"formatter_class": argparse.RawDescriptionHelpFormatter, "epilog": EXAMPLES}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments (build its parser with ``**PARSER_OPTIONS``)."""
    model = p.add_argument_group("the model (exactly one)")
    model.add_argument("--params", type=_count, help="parameter count, e.g. 1.3e9 (a GPT-like stack is assumed)")
    model.add_argument("--layers", type=int, help="layers (with --params, or to override what a module shows)")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--hf-config", help="a transformers model type (gpt2, llama, ...), built on the meta device")
    model.add_argument("--hf-kwargs", default="{}", help="JSON keyword arguments of its config, e.g. '{\"n_layer\": 12}'")
    model.add_argument("--module", help="package.module:factory returning the model (called under the meta device)")
    model.add_argument("--module-kwargs", default="{}", help="JSON keyword arguments of the factory")
    model.add_argument("--qlora", nargs="?", const="4bit", choices=("4bit", "8bit"),
                       help="with --hf-config: QLoRA's base, frozen, its linear layers in 4 bits (the default; "
                       "BitsAndBytesConfig(load_in_4bit=True)) or 8 bits (load_in_8bit=True); the adapters not counted")
    run_ = p.add_argument_group("the run")
    run_.add_argument("--world", type=int, default=1, help="data-parallel ranks (default 1)")
    run_.add_argument("--ranks-per-node", type=int, help="ranks sharing this machine (default: world on CPU, GPUs here)")
    run_.add_argument("--precision", nargs="+", default=["fp32"], help="one or more of fp32 bf16 fp16 (default fp32)")
    run_.add_argument("--nvme", nargs="*", default=[], metavar="PATH", help="directories for offload files")
    run_.add_argument("--batch-tokens", type=int, default=2048, help="tokens per rank per step (default 2048)")
    run_.add_argument("--seq", type=int, help="sequence length (default: the model's, at most --batch-tokens)")
    run_.add_argument("--checkpointing", action="store_true", help="activation checkpointing (recompute)")
    run_.add_argument("--placement", nargs="*", metavar="P/O[/G]", help="only these placements, e.g. device/cpu nvme/nvme")
    run_.add_argument("--pinned-pool-bytes", type=int, help="offload.pinned_pool_bytes (default: the planner picks)")
    run_.add_argument("--max-cpu-bytes", type=int, default=0, help="host memory budget (default: available RAM)")
    run_.add_argument("--allgather-gbps", type=float, help="all-gather GB/s per rank (default: measured or estimated)")
    run_.add_argument("--reshard-after-forward", default="auto",
                      help="overlap.reshard_after_forward, auto, always or never: the groups gathered once a step")
    run_.add_argument("--host-keep", default="auto", help="overlap.host_keep, auto or off: on the CPU, groups kept for "
                      "the backward in a quarter of the free host memory")
    run_.add_argument("--remeasure", action="store_true", help="measure the disks again (not the cached figures)")
    run_.add_argument("--checkpoint", metavar="DIR", help="a pretrained base that stays frozen (LoRA, QLoRA): choose "
                      "whether it is read where it lies or staged to the --nvme swap (offload.frozen_in_place)")
    run_.add_argument("--machine", metavar="JSON", help="plan for the machine described in this file (the \"machine\" "
                      "entry of 'zinf plan --json') instead of measuring this one")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from zinf.plan import Machine, plan
    from zinf.plan.model import PlanError, parse_json_kwargs

    try:
        machine = Machine.load(args.machine) if args.machine else None
        result = plan(
            params=args.params, layers=args.layers, hidden=args.hidden, vocab=args.vocab, hf_config=args.hf_config,
            hf_kwargs=parse_json_kwargs(args.hf_kwargs, "--hf-kwargs") if args.hf_config else None,
            module=args.module, module_kwargs=parse_json_kwargs(args.module_kwargs, "--module-kwargs"),
            world=args.world, precision=args.precision, nvme_paths=args.nvme, batch_tokens=args.batch_tokens,
            seq_len=args.seq, checkpointing=args.checkpointing, placements=args.placement or None,
            remeasure=args.remeasure, ranks_per_node=args.ranks_per_node, pinned_pool_bytes=args.pinned_pool_bytes,
            max_cpu_bytes=args.max_cpu_bytes, allgather_gbps=args.allgather_gbps, machine=machine,
            reshard_after_forward=args.reshard_after_forward, host_keep=args.host_keep, qlora=args.qlora, checkpoint=args.checkpoint)
    except PlanError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    sys.stdout.write((result.json() if args.json else result.table()) + "\n")
    return 0
