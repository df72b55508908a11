"""The ``vlm-prune`` command.

Each subcommand lives in its own module, which provides ``add_parser(subparsers)`` (setting
``func`` with ``set_defaults``) and is imported only when that subcommand runs, so that
``vlm-prune --help`` answers at once instead of importing torch. A subcommand signals a usage
mistake by raising :class:`UsageError`: one line on stderr, exit code 2, no traceback.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.util
import os
import re
import shutil
import sys
import warnings
from typing import Any, NoReturn

# name -> (module providing add_parser(subparsers), one-line help)
SUBCOMMANDS = {
    "methods": ("vlm_prune.cli_methods", "list the pruning methods: name, stage, what each does, paper"),
    "bench": ("vlm_prune.eval.bench_cli", "every method on the shipped synthetic models: accuracy, tokens, FLOPs, time"),
    "eval": ("vlm_prune.eval.cli", "evaluate a model and pruning methods on a video / image QA dataset"),
    "tune": ("vlm_prune.eval.tune_cli", "search methods and budgets for a quality floor / cost ceiling; write a config"),
    "keyframes": ("vlm_prune.frames.cli", "choose keyframes of videos with KeyScore + STACFP (or uniformly)"),
    "demo": ("vlm_prune.demo.cli", "launch the Gradio demo: what a method prunes, and what it saves"),
    "serve": ("vlm_prune.vllm.serve", "serve a VLM pruned inside vLLM's OpenAI-compatible server (docs/vllm.md)"),
}
EPILOG = "Run `vlm-prune COMMAND --help` for a command's options."


class UsageError(Exception):
    """A mistake in the command line or its inputs; the message says what is wrong and how to fix it."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): what is wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("vlm-prune")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the checkout)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (its options registered), the other
    subcommands are listed by name and help alone."""
    parser = Parser(
        prog="vlm-prune", description="Prune visual tokens, frames and patches of Hugging Face VLMs.", epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"vlm-prune {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                continue  # that subcommand is not part of this build
            raise
        module.add_parser(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    formatwarning, warnings.formatwarning = warnings.formatwarning, warning_line
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"vlm-prune {args.command}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vlm-prune methods | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        warnings.formatwarning = formatwarning


def warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """A warning as the command line prints it: its class and message on one line, without the
    library's source file and line Python's default format adds (``warnings.formatwarning``)."""
    return f"{category.__name__}: {message}\n"


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined, runs of spaces collapsed."""
    return " ".join(text.split())


def cannot_load(model: str, err: BaseException) -> str:
    """The one-line usage error for a ``--model`` that ``from_pretrained`` could not load."""
    why = one_line(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    if isinstance(err, ImportError):  # e.g. SmolVLM's processor without num2words
        return f"--model {model}: its processor or model needs a package that is not installed: {why}"
    return (f"--model {model}: cannot load it ({why}); give a local checkpoint folder (save_pretrained output) or "
            "a Hugging Face hub id that is in the local cache or downloadable from here")


def hub_model_problem(model: str) -> str | None:
    """Why ``--model`` ``model``, a hub id, cannot be loaded here - not in the local cache and the hub
    unreachable (offline), no such repository, gated - or None (a local folder, cached, or available).
    Asks the hub once, without the download retries, before anything heavy is imported."""
    if os.path.isdir(os.path.expanduser(model)):
        return None
    try:
        import huggingface_hub as hub
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

        if isinstance(hub.try_to_load_from_cache(model, "config.json"), str):
            return None
    except Exception:  # noqa: BLE001 - no hub client, or an id it cannot parse: from_pretrained will say
        return None
    fix = "check the id, or give a local checkpoint folder (save_pretrained output)"
    if hub.constants.HF_HUB_OFFLINE:
        return f"--model {model} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {fix}"
    try:
        hub.HfApi().model_info(model, timeout=10)
    except GatedRepoError:
        return f"--model {model} is a gated repository: accept its terms on huggingface.co and log in (hf auth login)"
    except RepositoryNotFoundError:
        return f"--model {model}: no such model on the Hugging Face hub (private ones need hf auth login); {fix}"
    except Exception as err:  # noqa: BLE001 - no network, DNS, proxy, timeout
        why = one_line(str(err)) or type(err).__name__
        return f"--model {model} is not in the local Hugging Face cache and the hub is not reachable ({why}); {fix}"
    return None


def module_doc(module: str) -> str:
    """The docstring of ``module``, read without importing it (so that ``--help`` stays light)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    with open(spec.origin, encoding="utf-8") as fh:
        return ast.get_docstring(ast.parse(fh.read())) or ""


# ---- shared argument helpers ---------------------------------------------------------------
def method_list(text: str) -> str:
    """argparse type of a comma-separated list of registered method names ("a+b" pipelines
    allowed): every name is checked, an unknown one rejected with the closest names."""
    from vlm_prune.registry import available_methods

    known = available_methods()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated method names, e.g. pact,divprune")
    for name in (part.strip() for n in names for part in n.split("+")):
        if name.lower().replace("-", "_") not in known:
            close = difflib.get_close_matches(name.lower(), known, n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise argparse.ArgumentTypeError(f"unknown method {name!r}{hint} (see `vlm-prune methods`)")
    return ",".join(names)


def existing_file(text: str) -> str:
    """argparse type of an input file that must exist."""
    if not os.path.isfile(text):
        what = "is a folder, not a file" if os.path.isdir(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}")
    return text


def _positive(text: str, convert: type, expected: str) -> Any:
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a whole number >= 1."""
    return _positive(text, int, "a whole number >= 1")


def positive_float(text: str) -> float:
    """argparse type of a number > 0."""
    return _positive(text, float, "a number > 0")


def fraction(text: str) -> float:
    """argparse type of a fraction in (0, 1] (``--keep``)."""
    value = _positive(text, float, "a fraction in (0, 1]")
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def checkpoint(text: str) -> str:
    """argparse type of a checkpoint: a hub id ("org/name") or a local folder with config.json;
    a path that is not such a folder is rejected before anything loads."""
    path = os.path.expanduser(text)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1 or os.path.exists(path)
    if looks_local and not os.path.isfile(os.path.join(path, "config.json")):
        what = "does not exist" if not os.path.exists(path) else "is not a checkpoint folder (no config.json)"
        raise argparse.ArgumentTypeError(f"{text} {what}; give a local checkpoint folder or a Hugging Face hub "
                                         "id such as org/name")
    return text


def fresh_output(folder: str, names: list[str], overwrite: bool) -> None:
    """Refuse to replace an earlier run's ``names`` in ``folder`` unless ``overwrite``."""
    found = [n for n in names if os.path.exists(os.path.join(folder, n))]
    if found and not overwrite:
        raise UsageError(f"{folder} already holds {', '.join(found)} from an earlier run; pass --overwrite to "
                         "replace it or choose another --out")


def plain_doc(doc: str | None) -> str:
    """A module docstring for ``--help``: reStructuredText roles and literals as plain text."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def fit_terminal(text: str, width: int | None = None, where: str = "the output files", cell: int = 40) -> str:
    """Markdown ``text`` with every table cut to the terminal's width: cells shortened to
    ``cell`` characters, rightmost columns dropped (they stay in ``where``), a note saying so."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    out: list[str] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            out += _fit_table(block, width, where, cell)
            block = []
        out.append(line)
    return "\n".join(out[:-1])


def _fit_table(lines: list[str], width: int, where: str, cell: int) -> list[str]:
    if max(len(ln) for ln in lines) <= width:
        return lines
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    n_cols = max(len(r) for r in rows)
    widths = [min(cell, max(len(r[i]) if i < len(r) else 0 for r in rows)) for i in range(n_cols)]
    keep = n_cols
    while keep > 1 and sum(widths[:keep]) + 3 * keep + 1 > width:
        keep -= 1
    fitted = []
    for r in rows:
        parts = [(r[i] if i < len(r) else "") for i in range(keep)]
        if "".join(parts) and set("".join(parts)) <= set("-: "):
            parts = ["-" * w for w in widths[:keep]]
        fitted.append("| " + " | ".join(p[:w].ljust(w) for p, w in zip(parts, widths)) + " |")
    dropped = n_cols - keep
    if dropped:
        fitted.append(f"({dropped} more column{'s' * (dropped > 1)} in {where})")
    return fitted


if __name__ == "__main__":  # run as the installed module, so that UsageError is the one subcommands raise
    from vlm_prune.cli import main as installed_main

    sys.exit(installed_main())
