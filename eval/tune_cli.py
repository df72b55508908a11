"""The options of ``vlm-prune tune`` (what the command does: :mod:`vlm_prune.eval.tune`).

Kept apart from the tuner so that ``vlm-prune tune --help`` and a mistyped option answer without
importing torch; :func:`run` imports the tuner once the options are valid.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from vlm_prune.cli import UsageError, method_list, module_doc, plain_doc, positive_float, positive_int
from vlm_prune.eval.bench_cli import _keeps


def _model(text: str) -> str:
    from vlm_prune.cli import checkpoint

    return text if text in ("image", "video") else checkpoint(text)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "tune", help="search methods, budgets and knobs for a quality floor / cost ceiling; write the best as a config",
        description=plain_doc(module_doc("vlm_prune.eval.tune")), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output folder (tune.json, front.md, front.png, recommended.json); "
                   "rerunning into it resumes")
    p.add_argument("--model", type=_model, default="image",
                   help="image or video (the shipped toy models, default image), or a checkpoint folder / hub id")
    p.add_argument("--data", default=None, help="dataset folder in a layout vlm-prune eval reads (default: the synthetic set)")
    p.add_argument("--dataset", default=None, help="the layout of --data (as vlm-prune eval --dataset)")
    goal = p.add_argument_group("goal (default: --min-retention 0.95)")
    goal.add_argument("--min-retention", type=positive_float, default=None,
                      help="accuracy at least this fraction of the unpruned model's, judged by the lower end of its "
                           "paired 95%% interval, e.g. 0.97")
    goal.add_argument("--max-flops", type=positive_float, default=None, help="ideal prefill FLOPs ratio ceiling, e.g. 0.3")
    goal.add_argument("--max-tokens", type=positive_float, default=None,
                      help="visual tokens per sample at the LLM's last layer, ceiling (the front's cost axis then)")
    goal.add_argument("--max-time", type=positive_float, default=None,
                      help="measured prefill time ratio ceiling (TTFT ratio on --data), checked on the front")
    p.add_argument("--methods", type=method_list, default=None, help="search only these methods, e.g. fastv,pact,divprune")
    p.add_argument("--keeps", type=_keeps, default=None, help="keep fractions searched (default 0.5,0.25,0.11)")
    p.add_argument("--max-stages", type=positive_int, default=2,
                   help="video models: pipelines of up to this many stages (frames x vision / llm; 3 adds "
                        "frames x vision x llm); default 2")
    p.add_argument("--samples", type=positive_int, default=None,
                   help="size of the tuning set (default 288; --quick 48), spread over --data")
    p.add_argument("--quick", action="store_true", help="a smoke run: 48 samples (three rungs of 16), keeps 0.5,0.25")
    p.add_argument("--grid", action="store_true",
                   help="every setting on every sample instead of the search (the exhaustive reference)")
    p.add_argument("--frames", type=positive_int, default=32, help="frames per video on --data (default 32)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the sample order and of sampling methods")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if args.data is None and args.dataset is not None:
        raise UsageError("--dataset names the layout of --data; give --data too")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("vlm-prune tune draws its front with matplotlib: pip install 'vlm-prune[eval]'")
    import torch

    from vlm_prune.eval.tune import TuneError, summary_text, tune

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = tune(os.fspath(args.out), args.model, data=args.data, dataset=args.dataset,
                      min_retention=args.min_retention, max_flops=args.max_flops, max_tokens=args.max_tokens,
                      max_time=args.max_time, methods=args.methods.split(",") if args.methods else None,
                      keeps=args.keeps, max_stages=args.max_stages, quick=args.quick, samples=args.samples,
                      frames=args.frames, max_new_tokens=args.max_new_tokens, seed=args.seed, grid=args.grid)
    except TuneError as err:
        raise UsageError(str(err)) from None
    if result is None:  # not rank 0: rank 0 reports
        return 0
    print(summary_text(result))
    print(f"front: {os.path.join(args.out, 'front.md')}, {os.path.join(args.out, 'front.png')}")
    return 0
