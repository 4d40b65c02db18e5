"""``zinf`` command line: inspect the installation and measure drives (``zinf info``), summarise a run's log
(``zinf report``; both in zinf.inspect_cli), consolidate sharded checkpoints or convert earlier ones, launch an Accelerate script on
zinf (``zinf launch``, from the accelerate_zinf package)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from zinf.errors import ConfigError, ZinfError

__all__ = ["main", "report_errors", "traceback_wanted"]


def traceback_wanted(verbose: bool = False) -> bool:
    """Show a traceback instead of the one-line error: ``-v``/``--verbose``, or ZINF_TRACEBACK=1 (for a bug report)."""
    return verbose or os.environ.get("ZINF_TRACEBACK", "") not in ("", "0")


def report_errors(fn: Callable[[], int | None], prog: str, verbose: bool = False) -> int:
    """Run a command: a user's mistake (a zinf error: a setting, a file, a checkpoint; or a path the system refuses)
    ends it with one line on stderr and exit code 2 (a setting) or 1; anything else is a bug and keeps its
    traceback. See :func:`traceback_wanted` for the full traceback of a user's mistake too."""
    try:
        return fn() or 0
    except (ZinfError, OSError) as exc:
        if traceback_wanted(verbose):
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
            text += f": {exc.filename}"
        sys.stderr.write(f"{prog}: error: {text} (-v or ZINF_TRACEBACK=1 shows the traceback)\n")
        return 2 if isinstance(exc, ConfigError) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while argv and argv[0] in ("-v", "--verbose"):
        verbose = True
        argv.pop(0)
    return report_errors(lambda: _main(argv), "zinf", verbose)


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "launch":  # everything after it belongs to accelerate launch and the script
        try:
            from accelerate_zinf.launch import main as launch
        except ImportError as exc:
            sys.stderr.write(f"zinf launch needs Accelerate: pip install 'zinf[accelerate]' ({exc})\n")
            return 2
        return launch(argv[1:])
    parser = argparse.ArgumentParser(prog="zinf", description="ZeRO-Infinity for PyTorch; zinf -v COMMAND shows the "
                                     "traceback of an error (or ZINF_TRACEBACK=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, the native build, and (--nvme) each drive's O_DIRECT speed")
    info.add_argument("--nvme", nargs="+", metavar="PATH", default=[],
                      help="directories to measure (sequential write and read through zinf's AsyncIO)")
    info.add_argument("--size-mib", type=_size_mib, default=256, help="test file size per path, at least 1 (default 256)")
    info.add_argument("--bytes-per-s", type=int, default=0, metavar="N",
                      help="measure under the cap offload.aio_bytes_per_s=N puts on a run's disk traffic (default: none)")
    rep = sub.add_parser("report", help="summarise the 'zinf: step ...' lines of a training log")
    rep.add_argument("logfile")
    _consolidate_arguments(sub)
    upgrade = sub.add_parser("upgrade-checkpoint", help="convert a checkpoint of the earlier, pickled format once, so "
                             "that it loads as data (reads its pickles: only for a checkpoint you trust)",
                             description=_UPGRADE, formatter_class=argparse.RawDescriptionHelpFormatter)
    upgrade.add_argument("checkpoint_dir", metavar="CKPT", help="the checkpoint directory (holding commit.json)")
    sub.add_parser("launch", help="run an Accelerate script on zinf: zinf launch --config run.yaml train.py [args]")
    from zinf.plan.cli import PARSER_OPTIONS as plan_options, add_arguments as plan_arguments, run as run_plan

    plan_arguments(sub.add_parser("plan", help="bytes per tier and step time of each placement on this machine; recommends one",
                                  **plan_options))
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "info":
        from zinf.inspect_cli import info as run_info

        return run_info(sys.stdout, args.nvme, args.size_mib * 2**20, args.bytes_per_s)
    if args.command == "report":
        from zinf.inspect_cli import report

        return report(args.logfile, sys.stdout, sys.stderr)
    if args.command == "upgrade-checkpoint":
        return _upgrade(args)
    return _consolidate(args)


def _size_mib(text: str) -> int:
    """``--size-mib``: a whole number of MiB, at least 1 (a smaller file measures nothing a run would see)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB; give e.g. --size-mib 256") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} MiB is too small to measure a drive; give at least --size-mib 1 "
                                         "(default 256)")
    return value


_CONSOLIDATE = """\
Write the current save of a sharded checkpoint (CKPT) as model files (OUT), from the files alone:

  zinf consolidate CKPT model.pt                       one torch file: a state_dict under the model's names
  zinf consolidate CKPT OUT --config path/to/model     the Hugging Face layout: from_pretrained(OUT) loads it
  zinf consolidate CKPT OUT --format safetensors       model.safetensors, or shards and an index (weights only)
  zinf consolidate CKPT OUT --format torch             pytorch_model.bin, or shards and an index

The tensors stream one group at a time: a directory output holds one group in memory (plus one shard for torch
shards); a single torch file (OUT ending in .pt, .pth or .bin) holds the whole model in memory, so for a large
model write a directory. A directory is built next to OUT and moved into place when complete; OUT is left as it
was when anything fails. A tied weight is written once in safetensors (transformers re-ties it from the config)
and under every name in torch files; tiled layers come out under their untiled names."""


_UPGRADE = """\
Convert the parts of a checkpoint written before checkpoints held data only (format zinf-sharded-v2, whose record
and client state are pickles) to the current format, in place:

  zinf upgrade-checkpoint CKPT

This reads the old pickles, which can run any code: run it only on a checkpoint you trust. Afterwards the
checkpoint loads without checkpoint.allow_pickle, like any checkpoint of this zinf (a client state holding types
outside the allowed ones still needs it). Each part is rewritten beside itself and renamed into place; a run that
stops part way can be run again. On node-local storage run it on every node."""


def _upgrade(args: argparse.Namespace) -> int:
    from zinf.checkpoint.upgrade import upgrade_checkpoint

    done = upgrade_checkpoint(args.checkpoint_dir)
    sys.stdout.write(f"converted {len(done.converted)} part(s), {len(done.current)} already current"
                     + (f", {len(done.absent)} not in this directory (another node's)" if done.absent else "")
                     + f": {args.checkpoint_dir}\n")
    return 0


def _consolidate_arguments(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    cons = sub.add_parser("consolidate", help="write a sharded checkpoint as a state_dict file, safetensors or torch "
                          "shards, or the Hugging Face layout (streamed)", description=_CONSOLIDATE,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    cons.add_argument("checkpoint_dir", metavar="CKPT", help="the checkpoint directory (engine.save_checkpoint's path)")
    cons.add_argument("output", metavar="OUT", help="a file ending in .pt/.pth/.bin, or a directory (created when "
                      "missing; one holding only an earlier export's files is replaced)")
    cons.add_argument("--format", help="torch, safetensors or hf (default: torch for a .pt/.pth/.bin file; for a "
                      "directory, hf with --config, else safetensors)")
    cons.add_argument("--dtype", help="fp32 (default), bf16 or fp16: parameters and floating-point buffers are cast")
    cons.add_argument("--max-shard-size", metavar="SIZE", help="the largest shard of a directory output, e.g. 500MB, "
                      "2GiB (default 5GB)")
    cons.add_argument("--config", metavar="PATH", help="the model's config.json, or a directory holding it (and "
                      "generation_config.json): copied into OUT, its dtype set to the written one (--format hf)")
    cons.add_argument("--allow-pickle", action="store_true", help="read a checkpoint of the earlier, pickled format "
                      "as it is (runs its pickles: only for a checkpoint you trust; 'zinf upgrade-checkpoint' converts "
                      "it once instead)")
    cons.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _consolidate(args: argparse.Namespace) -> int:
    import logging

    from zinf.checkpoint.convert import export_checkpoint

    logger = logging.getLogger("zinf")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    if not args.quiet:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        done = export_checkpoint(args.checkpoint_dir, args.output, format=args.format, dtype=args.dtype,
                                 max_shard_size=args.max_shard_size, config=args.config,
                                 allow_pickle=args.allow_pickle)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    sys.stdout.write(f"wrote {done.num_tensors} tensors ({done.num_bytes} bytes) in {len(done.files)} file(s) to "
                     f"{args.output}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
