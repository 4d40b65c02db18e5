"""``zinf`` command line: inspect the native build, consolidate sharded checkpoints."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zinf", description="ZeRO-Infinity for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the native extension was built with")
    cons = sub.add_parser("consolidate", help="turn a sharded checkpoint directory into one state_dict file")
    cons.add_argument("checkpoint_dir")
    cons.add_argument("output")
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
