"""``vlm-prune bench --serve``: serving throughput of vLLM with and without vlm_prune (issue 19).

One vLLM engine per model shape (the tiny test shape, and LLaVA-1.5-7B scaled down ``--scale``
times: the same 576 visual tokens per image), randomly initialised, float32 on CPU / bfloat16 on
CUDA. The same batch of requests (one random image each, a short question, ``MAX_TOKENS`` greedy
tokens, EOS ignored) runs unpruned and with DivPrune at keep 0.25 and 0.11 (per-request settings,
one engine); each setting is timed ``--repeats`` times after a warm-up, the median counts.
Reported: requests/s, output tokens/s, the speed-up over unpruned, and the FLOPs-ideal speed-up
(tower + projector + language-model FLOPs of the batch, prefill and decode, unpruned over pruned);
efficiency = speed-up / ideal. Writes serve.json and serve.md to ``--out``. Runs in the vLLM
environment (docs/vllm.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

KEEPS = (1.0, 0.25, 0.11)
METHOD = "divprune"
PROMPT = "<s> user : <image> w5 w6 w7 w8 w9 w10 assistant :"
TEXT_TOKENS = 11  # PROMPT's tokens besides the image
MAX_TOKENS = 16
REQUESTS = 16


def llm_flops(shape: Any, visual: int, text: int, new: int) -> float:
    """Multiply-adds x 2 of the language model for one request: linear layers on every prompt and
    generated token, attention scores and values against the growing context."""
    d, f, layers = shape.hidden, shape.intermediate, shape.layers
    kv = d * shape.kv_heads // shape.heads
    per_token = layers * (2 * d * (2 * d + 2 * kv) + 2 * 3 * d * f) + 2 * d * shape.vocab
    prompt = visual + text
    tokens = prompt + new
    context = prompt * (prompt + 1) / 2 + sum(prompt + i for i in range(1, new + 1))
    return per_token * tokens + layers * 4 * d * context


def tower_flops(shape: Any) -> float:
    n = shape.image_tokens + 1
    c, f = shape.vision_hidden, shape.vision_intermediate
    per_layer = n * 2 * (4 * c * c + 2 * c * f) + 4 * n * n * c
    return shape.vision_layers * per_layer + shape.image_tokens * 2 * (c * shape.hidden + shape.hidden * shape.hidden)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import numpy as np
    from PIL import Image
    from vllm import SamplingParams

    import vlm_prune.vllm as vp
    from vlm_prune.vllm.tiny import LlavaShape, llava15_scaled, write_llava

    requests = args.limit or REQUESTS
    shapes = {"tiny": LlavaShape(), f"llava-1.5-7b/{args.scale}": llava15_scaled(args.scale)}
    cuda = args.device == "cuda"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in shapes.items():
            folder = write_llava(Path(tmp) / name.replace("/", "_"), shape)
            llm = vp.LLM(str(folder), METHOD, keep=1.0, enforce_eager=not cuda, dtype="bfloat16" if cuda else "float32",
                         max_model_len=shape.image_tokens + 64, max_num_seqs=requests, seed=args.seed)
            rng = np.random.RandomState(args.seed)
            size = shape.image_size
            images = [Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8")) for _ in range(requests)]
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            base = None
            for keep in KEEPS:
                kwargs = vp.request_kwargs(METHOD, keep=keep, seed=args.seed)
                batch = [{"prompt": PROMPT, "multi_modal_data": {"image": im}, "mm_processor_kwargs": kwargs}
                         for im in images]
                llm.generate(batch[:2], params, use_tqdm=False)  # warm-up (first-call costs)
                wall, cpu = [], []
                for _ in range(args.repeats):
                    w0, c0 = time.perf_counter(), time.process_time()
                    outs = llm.generate(batch, params, use_tqdm=False)
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                visual = vp.method_spec(METHOD, keep=keep) and (
                    shape.image_tokens if keep == 1.0 else max(1, int(keep * shape.image_tokens + 1e-9)))
                flops = requests * (tower_flops(shape) + llm_flops(shape, visual, TEXT_TOKENS, MAX_TOKENS))
                row = {"shape": name, "method": "none" if keep == 1.0 else METHOD, "keep": keep,
                       "visual_tokens": visual, "requests": requests, "output_tokens": tokens,
                       "seconds_wall": statistics.median(wall), "seconds_cpu": statistics.median(cpu), "flops": flops}
                row["requests_per_s"] = requests / row["seconds_wall"]
                row["output_tokens_per_s"] = tokens / row["seconds_wall"]
                if base is None:
                    base = row
                row["speedup"] = base["seconds_wall"] / row["seconds_wall"]
                row["speedup_cpu"] = base["seconds_cpu"] / row["seconds_cpu"]
                row["ideal"] = base["flops"] / row["flops"]
                row["efficiency"] = row["speedup"] / row["ideal"]
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            del llm
    meta = {"command": "vlm-prune bench --serve " + " ".join(f"--{k} {v}" for k, v in
                                                                (("scale", args.scale), ("repeats", args.repeats),
                                                                 ("limit", requests), ("device", args.device))),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "max_tokens": MAX_TOKENS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "serve.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"`{meta['command']}`, {meta['machine']}, {meta['date']}; {rows[0]['requests'] if rows else 0} requests "
             f"x {meta['max_tokens']} tokens, median of the repeats", "",
             "| shape | method | keep | visual tokens / image | requests/s | output tokens/s | speed-up (wall) | speed-up (CPU time) | FLOPs-ideal | efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['method']} | {r['keep']} | {r['visual_tokens']} | {r['requests_per_s']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['speedup_cpu']:.2f} | {r['ideal']:.2f} | "
                     f"{r['efficiency']:.2f} |")
    return "\n".join(lines) + "\n"
