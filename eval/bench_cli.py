"""The options of ``vlm-prune bench`` (what the command does: :mod:`vlm_prune.eval.bench`).

Kept apart from the bench itself so that ``vlm-prune bench --help`` and a mistyped option answer
without importing torch or transformers; :func:`run` imports the bench only once the options are valid.
"""
from __future__ import annotations

import argparse
from typing import Any

from vlm_prune.cli import UsageError, checkpoint, hub_model_problem, method_list, module_doc, plain_doc, positive_int


def _keeps(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 0.5,0.25, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"keep fractions must lie in (0, 1], got {text!r}")
    return values


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds or set(kinds) - {"image", "video", "vit-real"}:
        raise argparse.ArgumentTypeError(f"expected image, video or image,video (or vit-real alone), got {text!r}")
    if "vit-real" in kinds and len(kinds) > 1:
        raise argparse.ArgumentTypeError("--kinds vit-real runs alone (a real pretrained ViT, not the shipped VLMs)")
    return kinds


#: model-free baselines ``--methods`` names beside the registered methods (vlm_prune.eval.synthetic.baselines)
BENCH_BASELINES = ("saturation",)


def bench_methods(text: str) -> str:
    """``--methods``: registered method names (:func:`vlm_prune.cli.method_list`) and the bench's
    model-free baselines (``saturation``), so a chosen set can stand against the required baseline."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    registered = [n for n in names if n.lower() not in BENCH_BASELINES]
    if registered:
        method_list(",".join(registered))
    elif not names:
        method_list(text)  # the usual message for an empty list
    return ",".join(n.lower() if n.lower() in BENCH_BASELINES else n for n in names)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="every method on the shipped synthetic models: accuracy, kept tokens, prefill time",
        description=plain_doc(module_doc("vlm_prune.eval.bench")), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: the first seed only, fewer samples (96 image / 48 video) and keep ratios "
                        "(0.25, 0.05 / 0.25), one torch thread and one prefill timing per setting; a row per "
                        "method, no spread over seeds")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="test samples per model kind, split over the shipped seeds (default 900; --quick 96 image / 48 video)")
    p.add_argument("--kinds", type=_kinds, default=("image", "video"), help="shipped model kinds to bench (default image,video); vit-real: AS-ViT and ToMe in a "
                        "real pretrained ViT on Fashion-MNIST (the real extra, docs/real-vit.md)")
    p.add_argument("--seeds", type=positive_int, default=None, help="bench only the first N shipped training seeds (default all; --quick 1)")
    p.add_argument("--keep", type=_keeps, default=None, help="keep ratios for every model, e.g. 0.5,0.25")
    p.add_argument("--methods", type=bench_methods, default=None,
                   help="comma-separated method names to run, 'saturation' for the model-free baseline "
                        "(default: all registered and saturation)")
    p.add_argument("--model", type=checkpoint, default=None, metavar="PATH_OR_HUB_ID",
                   help="bench a supported checkpoint with its own processor instead of the shipped models")
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="prefill timings per batch, the median counts (default 3; --quick on the shipped models: 1)")
    p.add_argument("--time-batches", type=positive_int, default=1, help="batches timed per setting (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling methods (random; default 0)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; --quick on the shipped models: 1); 1 gives stable "
                        "timings on a shared machine")
    s = p.add_argument_group("--speed: time-to-first-token on random models of real shapes")
    s.add_argument("--speed", action="store_true", help="time LLaVA-1.5-7B / OneVision-7B shapes instead")
    s.add_argument("--serve", action="store_true",
                   help="vLLM serving throughput with / without pruning (vLLM environment, docs/vllm.md; --limit = requests)")
    s.add_argument("--scale", type=positive_int, default=8,
                   help="divide hidden sizes, heads and layers by S (default 8; 1 = the real 7B shapes)")
    p.add_argument("--train-per-class", type=positive_int, default=None,
                   help="--kinds vit-real: train images per class and probe draw (default 60; --quick 4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (float32) or cuda (bfloat16) for --model and --speed; the shipped models run on CPU")
    s.add_argument("--frames", type=positive_int, default=32, help="video frames of the OneVision shape (default 32)")
    s.add_argument("--speed-keeps", type=_keeps, default=(0.25, 0.11), help="keep ratios timed (default 0.25,0.11)")
    s.add_argument("--shapes", default="image,video,image-deep",
                   help="model shapes timed: image, video, image-deep (default all three)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = args.model and hub_model_problem(args.model)
    if problem:
        raise UsageError(problem)
    if "vit-real" in args.kinds:
        from vlm_prune.eval.vit_real_bench import run as run_real

        return run_real(args)
    from vlm_prune.eval.bench import run as run_bench

    return run_bench(args)
