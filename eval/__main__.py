"""``python -m vlm_prune.eval`` (and ``accelerate launch -m vlm_prune.eval``): the eval command."""
import argparse
import sys

from vlm_prune.eval.cli import configure, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_prune.eval", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
