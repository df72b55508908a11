"""The ``vlm-prune`` command. Each subcommand lives in its own module and registers itself
through an ``add_parser(subparsers)`` function listed in ``SUBCOMMANDS``."""
from __future__ import annotations

import argparse
import importlib
import sys

# module path -> provides add_parser(subparsers) that sets `func` via set_defaults
SUBCOMMANDS = [
    "vlm_prune.cli_methods",
    "vlm_prune.eval.bench",
    "vlm_prune.eval.cli",
    "vlm_prune.frames.cli",
    "vlm_prune.demo.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-prune", description="Prune visual tokens, frames and patches of VLMs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and name.startswith(err.name):
                continue  # that subcommand is not part of this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
