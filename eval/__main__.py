"""``python -m vlm_prune.eval`` (and ``accelerate launch -m vlm_prune.eval``): the eval command."""
import sys

from vlm_prune.cli import Parser, UsageError, one_line
from vlm_prune.eval.cli import configure, run


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m vlm_prune.eval", description=__doc__)
    configure(parser)
    try:
        return run(parser.parse_args(argv))
    except UsageError as err:  # one line and exit code 2, as `vlm-prune eval`
        print(f"{parser.prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
