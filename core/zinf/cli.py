"""``zinf`` command line: inspect the native build, consolidate sharded checkpoints, launch an Accelerate
script on zinf (``zinf launch``, from the accelerate_zinf package)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":  # everything after it belongs to accelerate launch and the script
        try:
            from accelerate_zinf.launch import main as launch
        except ImportError as exc:
            sys.stderr.write(f"zinf launch needs Accelerate: pip install 'zinf[accelerate]' ({exc})\n")
            return 2
        return launch(argv[1:])
    parser = argparse.ArgumentParser(prog="zinf", description="ZeRO-Infinity for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the native extension was built with")
    cons = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one state_dict file")
    cons.add_argument("checkpoint_dir")
    cons.add_argument("output")
    sub.add_parser("launch", help="run an Accelerate script on zinf: zinf launch --config run.yaml train.py [args]")
    args = parser.parse_args(argv)
    if args.command == "info":
        from zinf import native

        sys.stdout.write(f"{native.info()}\n")
        return 0
    import torch

    from zinf.checkpoint import consolidate

    state = consolidate(args.checkpoint_dir)
    torch.save(state, args.output)
    sys.stdout.write(f"wrote {len(state)} tensors to {args.output}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
