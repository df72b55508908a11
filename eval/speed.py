"""``vlm-prune bench --speed``: time to first token and prefill FLOPs, pruned vs unpruned.

Models of real shapes with random weights (timing does not need trained weights), built from
the real config classes, no download:
- LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px (24 x 1024, 576 visual tokens from layer -2) + Llama-7B
  (32 x 4096, 32 heads, MLP 11008).
- LLaVA-OneVision-7B, video: SigLIP-so400m at 384 px (26 x 1152; 27 x 27 patches pooled to
  14 x 14 = 196 tokens per frame, 32 frames + a newline token) + Qwen2-7B (28 x 3584, 28 heads,
  4 KV heads, MLP 18944).
``--scale S`` divides the heads (head size kept), MLP widths and layer counts by S for CPU runs;
visual token counts stay (``--frames`` sets the video length). The pruning layer of FastV / PACT
moves with the depth (layer * scaled depth / real depth).

For every applicable method and keep ratio: median prefill seconds of the wrapped and the
unwrapped model (interleaved), their ratio (measured; on CPU also the process CPU-time ratio,
the stable one on a shared machine with ``--threads 1``), the FLOPs ratio (ideal: language model
from ``vlm_prune.eval.metrics`` plus the vision tower, which token pruning leaves unchanged) and
overhead = measured / ideal.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
)
from vlm_prune.eval import metrics
from vlm_prune.eval.bench import (
    fit_layer,
    fmt,
    markdown_escape,
    prefill_seconds,
    run_and_write,
    time_pair,
)

import vlm_prune

LLAVA_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                "image_size": 336, "patch_size": 14}
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32064}
SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16,
                 "image_size": 384, "patch_size": 14}
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152128}
PROMPT_TOKENS = (14, 22)  # text tokens before / after the visual tokens (system prompt, question)
#: methods timed per model kind; quota is left out: its scorer prompts the model once per frame
#: through the processor's chat template, which a random model without a tokenizer does not have
SPEED_METHODS = {
    "image": ("pool", "random", "visionzip", "divprune", "cdpruner", "fastv", "pact", "adaptinfer"),
    "video": ("uniform", "keyscore", "pool", "random", "divprune", "cdpruner", "fastv", "pact", "adaptinfer"),
}


def scaled(shape: dict[str, int], scale: int) -> dict[str, int]:
    """``shape`` with heads (head size kept), MLP width and depth divided by ``scale``."""
    heads = shape["num_attention_heads"]
    head_dim = shape["hidden_size"] // heads
    out = dict(shape)
    out["num_attention_heads"] = max(1, heads // scale)
    if "num_key_value_heads" in shape:
        kv = max(1, shape["num_key_value_heads"] // scale)
        while out["num_attention_heads"] % kv:
            kv -= 1
        out["num_key_value_heads"] = kv
        out["head_dim"] = head_dim
    out["hidden_size"] = out["num_attention_heads"] * head_dim
    out["intermediate_size"] = max(1, shape["intermediate_size"] // scale)
    out["num_hidden_layers"] = max(2, shape["num_hidden_layers"] // scale)
    return out


def build(kind: str, scale: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A randomly initialised LLaVA-1.5-7B ("image") or LLaVA-OneVision-7B ("video") shape."""
    if kind == "image":
        text = scaled(LLAMA_7B, scale)
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**scaled(LLAVA_VISION, scale), projection_dim=768),
            text_config=LlamaConfig(**text, max_position_embeddings=4096),
            image_token_id=LLAMA_7B["vocab_size"] - 64, vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
        cls = LlavaForConditionalGeneration
    elif kind == "video":
        text = scaled(QWEN2_7B, scale)
        vocab = QWEN2_7B["vocab_size"]
        config = LlavaOnevisionConfig(
            vision_config=SiglipVisionConfig(**scaled(SIGLIP_SO400M, scale)),
            text_config=Qwen2Config(**text, max_position_embeddings=32768),
            image_token_id=vocab - 482, video_token_id=vocab - 481,
        )
        cls = LlavaOnevisionForConditionalGeneration
    else:
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    torch.manual_seed(0)
    config.text_config._attn_implementation = "sdpa"
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place: a full-scale 7B never passes through float32 on the CPU
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def inputs_for(model: torch.nn.Module, kind: str, frames: int) -> dict[str, torch.Tensor]:
    """One request: text tokens around the placeholders, random pixels."""
    cfg = model.config
    vc = cfg.vision_config
    side = vc.image_size // vc.patch_size
    g = torch.Generator().manual_seed(0)
    before, after = (torch.randint(10, 1000, (n,), generator=g) for n in PROMPT_TOKENS)
    if kind == "image":
        visual = torch.full((side * side,), cfg.image_token_id)
        pixels = {"pixel_values": torch.randn(1, 3, vc.image_size, vc.image_size, generator=g)}
    else:
        pooled = math.ceil(side / 2)
        visual = torch.full((frames * pooled * pooled + 1,), cfg.video_token_id)
        pixels = {"pixel_values_videos": torch.randn(1, frames, 3, vc.image_size, vc.image_size, generator=g)}
    ids = torch.cat([before, visual, after])[None]
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels}
    return {k: v.to(model.device, dtype=model.dtype if v.is_floating_point() else v.dtype) for k, v in out.items()}


def tower_flops(model: torch.nn.Module, kind: str, frames: int) -> float:
    """Vision tower FLOPs of one request (full attention, two-matrix MLP; 2 FLOPs per multiply-add)."""
    vc = model.config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2 + (1 if kind == "image" else 0)  # CLIP adds a CLS token
    h = vc.hidden_size
    layer = 2 * n * h * 4 * h + 2 * 2 * h * n * n + 2 * 2 * n * h * vc.intermediate_size
    return float(layer * vc.num_hidden_layers * (1 if kind == "image" else frames))


def run_kind(kind: str, args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    from tqdm.auto import tqdm

    model = build(kind, args.scale, dtype, args.device)
    inputs = inputs_for(model, kind, args.frames)
    seq = inputs["input_ids"].shape[1]
    tcfg = metrics.text_config(model.config)
    real_layers = (LLAMA_7B if kind == "image" else QWEN2_7B)["num_hidden_layers"]
    tower = tower_flops(model, kind, args.frames)
    full_flops = tower + metrics.prefill_flops(model.config, [seq] * tcfg.num_hidden_layers)
    name = f"llava-1.5-7b/{args.scale}" if kind == "image" else f"llava-onevision-7b/{args.scale} ({args.frames} frames)"
    only = set(args.methods.split(",")) if args.methods else None
    methods = [m for m in SPEED_METHODS[kind] if only is None or m in only]
    skipped = [{"model": name, "method": "quota", "reason": "its scorer prompts the model per frame through a "
                "processor; the random models have no tokenizer"}] if kind == "video" and (only is None or "quota" in only) else []
    rows = []
    for method, keep in tqdm([(m, k) for m in methods for k in args.speed_keeps], desc=f"speed {kind}", unit="setting"):
        _, note = fit_layer(method, tcfg.num_hidden_layers, tcfg.num_hidden_layers / real_layers)

        def wrap(m: torch.nn.Module, method: str = method, keep: float = keep) -> None:
            obj, _ = fit_layer(method, tcfg.num_hidden_layers, tcfg.num_hidden_layers / real_layers)
            vlm_prune.wrap(m, obj, keep=keep)

        try:
            wrap(model)
        except ValueError as err:
            skipped.append({"model": name, "method": method, "keep": keep, "reason": str(err)})
            continue
        prefill_seconds(model, inputs)
        stats = model.vlm_prune.last_stats
        vlm_prune.unwrap(model)
        t = time_pair(model, wrap, [inputs], args.repeats)
        rows_per_layer = metrics.rows_per_layer(tcfg.num_hidden_layers, seq, stats)
        flops = tower + metrics.prefill_flops(model.config, rows_per_layer)
        measured, ideal = t["wall"] / t["wall_full"], flops / full_flops
        cpu = t["cpu"] / t["cpu_full"] if args.device == "cpu" else None
        rows.append({
            "model": name, "method": method, "keep": keep,
            "visual_tokens_in": sum(stats["visual_tokens_in"]), "visual_tokens_out": sum(stats["visual_tokens_out"]),
            "ttft_s": t["wall"], "ttft_unpruned_s": t["wall_full"], "measured_ratio": measured,
            "cpu_ratio": cpu, "ideal_ratio": ideal, "overhead": measured / ideal,
            "cpu_overhead": cpu / ideal if cpu is not None else None,
            "llm_flops_ratio": (flops - tower) / (full_flops - tower), "notes": note,
        })
    return rows, skipped


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> str:
    head = ["model", "method", "keep", "visual tokens", "TTFT ms", "unpruned ms", "measured ratio",
            "CPU-time ratio", "ideal ratio (FLOPs)", "overhead", "CPU-time overhead", "LLM FLOPs ratio", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], r["method"], f"{r['keep']:g}", f"{r['visual_tokens_out']} / {r['visual_tokens_in']}",
            f"{1000 * r['ttft_s']:.1f}", f"{1000 * r['ttft_unpruned_s']:.1f}", f"{r['measured_ratio']:.2f}",
            fmt(r["cpu_ratio"], ".2f"), f"{r['ideal_ratio']:.2f}", f"{r['overhead']:.2f}", fmt(r["cpu_overhead"], ".2f"),
            f"{r['llm_flops_ratio']:.2f}", markdown_escape(r["notes"]),
        ]) + " |")
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {s['model']}: {s['method']} - {s['reason']}" for s in skipped]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """The --speed mode of ``vlm-prune bench``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch; use --device cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return run_and_write("speed", args, (run_kind(kind, args, dtype) for kind in ("image", "video")), markdown, plot=False)
