"""``vlm-prune eval``: judge a pruning method on a checkpoint and a local dataset.

    vlm-prune eval --model llava-hf/llava-onevision-qwen2-7b-ov-hf --data ~/data/Video-MME \
        --dataset videomme --method none,random,quota+pact --keep 1.0,0.5,0.25,0.11 --frames 32 --out runs/vmme

Multi-GPU: ``accelerate launch --num_processes 8 -m vlm_prune.eval <same arguments>``.
"""
from __future__ import annotations

import argparse
import sys

from vlm_prune.cli import UsageError, checkpoint, hub_model_problem, positive_float, positive_int
from vlm_prune.eval.datasets import LOADERS


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 1.0,0.5,0.25, got {text!r}") from None
    bad = [v for v in values if not 0.0 < v <= 1.0]
    if bad:
        raise argparse.ArgumentTypeError(f"keep fractions must lie in (0, 1], got {bad}")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 4096,2048, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 1 like 4096,2048, got {text!r}")
    return values


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _frames(text: str) -> int | str:
    if text == "quota":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--frames takes a whole number or 'quota', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("--frames must be at least 1")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=checkpoint, help="hub id or local folder of a supported HF VLM")
    p.add_argument("--data", required=True, help="dataset folder (or file, for --dataset jsonl/image)")
    p.add_argument("--dataset", required=True, choices=sorted(LOADERS), help="layout of --data")
    p.add_argument("--method", default="none",
                   help="comma-separated settings; '+' joins stages: none,random,quota+pact (default none)")
    p.add_argument("--config", action="append", default=[], metavar="PATH",
                   help="a config file (docs/config.md; what vlm-prune tune writes): one more setting, methods with "
                        "their knobs and budget; repeatable; evaluated beside --method (default: none, the baseline)")
    p.add_argument("--keep", type=_floats, default=[], help="kept fractions to sweep, e.g. 1.0,0.5,0.25,0.11")
    p.add_argument("--budget", type=_ints, default=[], help="visual tokens kept per image/frame, to sweep")
    p.add_argument("--frames", type=_frames, default=32, help="frames per video, or 'quota' (default 32)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="evaluate N questions spread evenly over the dataset (every task represented)")
    p.add_argument("--split", default=None, help="split where the layout has several (nextqa: val or test)")
    p.add_argument("--skip-missing", action="store_true",
                   help="evaluate the questions whose media exist; the others are counted as skipped")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: each process's GPU when torch sees CUDA, else the CPU (default auto)")
    p.add_argument("--device-map", default=None, help="e.g. auto: spread one large model over the GPUs (overrides --device)")
    p.add_argument("--attn-implementation", default=None, help="sdpa, eager or flash_attention_2")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling methods (random)")
    p.add_argument("--decode-timeout", type=positive_float, default=300.0, help="seconds allowed to decode one video")
    p.add_argument("--sync-timeout", type=positive_float, default=60.0, metavar="MINUTES",
                   help="minutes a rank waits for the others at the end (torchrun / accelerate); default 60")
    p.add_argument("--decode-workers", type=_workers, default=2,
                   help="threads decoding the next videos while the model runs (0: decode in turn; default 2)")
    p.add_argument("--subtitles", default="without", choices=["without", "with", "both"],
                   help="Video-MME: prompt with the subtitles at the sampled frames ('w/ subs'), or both scores")
    p.add_argument("--out", required=True, help="output folder; rerunning into it resumes")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", description=(
        "Evaluate a model unpruned and with pruning methods on a video / image QA dataset: accuracy, "
        "visual tokens, ideal prefill FLOPs and measured time per method and budget, written under --out."))
    configure(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = hub_model_problem(args.model)
    if problem:
        raise UsageError(problem)
    from vlm_prune.eval.datasets import DatasetLayoutError
    from vlm_prune.eval.runner import EvalConfig, EvalConfigError, run_eval

    cfg = EvalConfig(
        model=args.model, data=args.data, dataset=args.dataset, out=args.out,
        methods=[m.strip() for m in args.method.split(",") if m.strip()],
        keeps=args.keep, budgets=args.budget, frames=args.frames, limit=args.limit, split=args.split,
        skip_missing=args.skip_missing, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        device=args.device, device_map=args.device_map, attn_implementation=args.attn_implementation, seed=args.seed,
        decode_timeout=args.decode_timeout, decode_workers=args.decode_workers,
        subtitles=args.subtitles, sync_timeout_min=args.sync_timeout, configs=args.config,
    )
    try:
        rows = run_eval(cfg)
    except (EvalConfigError, DatasetLayoutError) as err:  # the user's: a flag, a path, a method, the model
        raise UsageError(str(err)) from None
    if rows is None:  # not rank 0: rank 0 reports
        return 0
    for row in rows:
        print(summary_line(row))
    print(f"summary: {args.out}/summary.md")
    empty = [row["name"] for row in rows if row["evaluated"] == 0]
    if empty:
        print(f"error: no question was evaluated in {', '.join(empty)} (see the skipped / failed reasons above "
              f"and the records in {args.out}/<setting>/results.jsonl)", file=sys.stderr)
        return 1
    return 0


def summary_line(row: dict) -> str:
    """One setting on the console: the leaderboard figure (lmms-eval's rules) first, the harness's
    lenient reading and how many answers the two read differently, then accuracy and the counts."""
    from vlm_prune.eval.metrics import counts_line

    head = f"{row['name']:28s} {row['official_name']} {row['official']:.3f}"
    if row.get("read_differently") is not None:
        head += f"  {row['lenient_name']} {row['lenient']:.3f} (read differently: {row['read_differently']})"
    if row["official_name"] != "accuracy":
        head += f"  accuracy {row['accuracy']:.3f}"
    return f"{head}  {counts_line(row)}"
