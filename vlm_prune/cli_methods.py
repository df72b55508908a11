"""``vlm-prune methods``: list the registered methods with stage and paper."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", help="list the available pruning methods")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlm_prune.registry import available_methods, method_class

    for name in available_methods():
        cls = method_class(name)
        print(f"{name:12s} {cls.stage:7s} {cls.paper}")
    return 0
