"""The `torchloom` command line: `inspect` and `consolidate` checkpoints (more subcommands arrive later)."""

from __future__ import annotations

import argparse
import json
import sys

import torchloom
from torchloom.errors import TorchloomError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchloom", description=torchloom.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"torchloom {torchloom.__version__}")
    sub = parser.add_subparsers(dest="command")

    inspect = sub.add_parser("inspect", help="show what a checkpoint holds (format, tensors, sizes, entries)")
    inspect.add_argument("checkpoint", help="a checkpoint file (full) or directory (sharded)")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")

    consolidate = sub.add_parser(
        "consolidate", help="turn a sharded checkpoint directory into one file, without a process group"
    )
    consolidate.add_argument("checkpoint", help="the sharded checkpoint directory")
    consolidate.add_argument("out_file", help="the file to write")
    consolidate.add_argument("--model-only", action="store_true", help="write only the model weights")
    consolidate.add_argument(
        "--format", choices=("torch", "safetensors"), default="torch",
        help="file format (safetensors needs the safetensors package and --model-only)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "inspect":
            from torchloom.checkpointing.tools import format_inspection, inspect

            info = inspect(args.checkpoint)
            print(json.dumps(info, indent=2) if args.json else format_inspection(info))
            return 0
        if args.command == "consolidate":
            from torchloom.checkpointing.tools import consolidate

            consolidate(args.checkpoint, args.out_file, model_only=args.model_only, fmt=args.format)
            print(f"wrote {args.out_file}", file=sys.stderr)
            return 0
    except TorchloomError as error:
        print(f"torchloom: error: {error}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
