"""The `torchloom` command line (`torchloom --version`; more subcommands arrive with later features)."""

from __future__ import annotations

import argparse
import sys

import torchloom


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchloom", description=torchloom.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"torchloom {torchloom.__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
