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

- ``image-deep``: the LLaVA-1.5-7B shape at 1/64 of its cost with every proportion of 7B kept
  (:func:`proportional`): half the depth, one head, MLPs widened so attention's and the tower's
  shares are as at 7B, pruning layers at the same fraction of the depth.

For every method (ToMe, AS-ViT and QuoTA included; a method that does not apply to a shape is
listed as skipped with the reason) and keep ratio, plus keep=1.0 for a vision-stage and an
in-LLM method (the wrapper with nothing to prune): the median over ``--repeats`` of the
pruned / unpruned prefill time ratio (process CPU time on CPU, the stable measure on a shared
machine with ``--threads 1``; wall-clock on CUDA) with its min-max, the FLOPs ratio (ideal:
language model from ``vlm_prune.eval.metrics`` plus vision tower and projector, the tower
shrunk by what ToMe / AS-ViT report), efficiency = (1/measured - 1) / (1/ideal - 1), overhead
= measured / ideal and the method's own scoring time as a share of the unpruned prefill (process CPU
time on CPU, from ``last_stats["cpu_seconds"]``; wall-clock on CUDA).
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Any, Callable

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
)

import vlm_prune
from vlm_prune.cli import UsageError

LLAVA_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                "image_size": 336, "patch_size": 14}
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32064}
SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16,
                 "image_size": 384, "patch_size": 14}
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152128}
PROMPT_TOKENS = (14, 22)  # text tokens before / after the visual tokens (system prompt, question)
#: methods timed first per model kind, in this order (then every other registered method the shape's
#: adapter runs, :func:`default_methods`; any registered name given to --methods is tried too);
#: keep=1.0 rows time the wrapper with nothing to prune, for a vision-stage and an in-LLM method
SPEED_METHODS = {
    "image": ("pool", "random", "visionzip", "divprune", "cdpruner", "tome", "asvit", "fastv", "pact", "adaptinfer",
              "fastervlm", "vispruner", "dart", "pdrop", "prumerge", "mustdrop"),
    "video": ("uniform", "keyscore", "quota", "vidcom2", "fastvid", "holitom", "dycoke", "framefusion", "prunevid", "pool",
              "random", "divprune", "cdpruner", "tome", "fastv", "pact", "adaptinfer"),
}
SPEED_METHODS["image-deep"] = SPEED_METHODS["image"]
IDENTITY_METHODS = ("random", "fastv")
#: --shapes: the LLaVA-1.5-7B and OneVision-7B shapes divided by --scale, and the depth-proportional
#: LLaVA-1.5-7B shape (:func:`proportional`)
KINDS = ("image", "video", "image-deep")


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


def proportional(shape: dict[str, int], heads: int, depth_div: int, gated: bool) -> dict[str, int]:
    """``shape`` with ``heads`` heads (head size kept) and depth / ``depth_div``, its MLP widened so
    that each token's linear FLOPs per unit of width (q, k, v, o and the MLP) stay as in
    ``shape``: attention's share of a layer is then as at full size for the same token count,
    and the model costs 1 / (depth_div * width ratio) of the full one."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = shape.get("num_key_value_heads", shape["num_attention_heads"])
    mlp = 3 if gated else 2
    per_width = 2 * shape["hidden_size"] + 2 * kv * head_dim + mlp * shape["intermediate_size"]
    out = dict(shape, num_attention_heads=heads, hidden_size=heads * head_dim,
               num_hidden_layers=shape["num_hidden_layers"] // depth_div)
    kv_new = heads * head_dim
    if "num_key_value_heads" in shape:
        out["num_key_value_heads"] = min(heads, kv)
        out["head_dim"] = head_dim
        kv_new = out["num_key_value_heads"] * head_dim
    out["intermediate_size"] = (per_width - 2 * heads * head_dim - 2 * kv_new) // mlp
    return out


def build(kind: str, scale: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A randomly initialised LLaVA-1.5-7B ("image", "image-deep") or LLaVA-OneVision-7B ("video") shape.

    "image-deep" ignores ``scale``: Llama-7B at half depth (16 layers) with one head of 128 and
    CLIP ViT-L at a quarter depth (6 layers) with one head of 64 (:func:`proportional`), both
    1/64 of the real cost, so the tower's share, attention's share and every pruning layer's
    fraction of the depth (FastV K=2 -> 1, PACT L=4 -> 2) are as at 7B.
    """
    if kind in ("image", "image-deep"):
        if kind == "image":
            text, vision = scaled(LLAMA_7B, scale), scaled(LLAVA_VISION, scale)
        else:
            text = proportional(LLAMA_7B, heads=1, depth_div=2, gated=True)
            vision = proportional(LLAVA_VISION, heads=1, depth_div=4, gated=False)
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**vision, projection_dim=768),
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
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
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
    if kind != "video":
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
    """Vision tower + projector FLOPs of one request (full attention, two-matrix MLPs; 2 FLOPs
    per multiply-add). The projector (two linear layers) maps every tower token: 576 per image
    on LLaVA-1.5, the 27 x 27 unpooled map per frame on OneVision (it projects before pooling)."""
    vc = model.config.vision_config
    d_text = metrics.text_config(model.config).hidden_size
    patches = (vc.image_size // vc.patch_size) ** 2
    n = patches + (1 if kind != "video" else 0)  # CLIP adds a CLS token
    h = vc.hidden_size
    layer = 2 * n * h * 4 * h + 2 * 2 * h * n * n + 2 * 2 * n * h * vc.intermediate_size
    projector = 2 * patches * (h * d_text + d_text * d_text)
    return float((layer * vc.num_hidden_layers + projector) * (1 if kind != "video" else frames))


def time_setting(model: torch.nn.Module, wrap: Callable[[torch.nn.Module], Any], inputs: dict[str, torch.Tensor],
                 repeats: int) -> dict[str, Any]:
    """Prefill timings of the wrapped and the unwrapped model, interleaved (load changes hit both).

    One untimed wrapped warm-up (its ``last_stats`` are returned), then ``repeats`` times: a
    wrapped prefill, unwrap, an unwrapped prefill, wrap again. Returns per-repeat lists of
    wall / CPU seconds (keys wall, wall_full, cpu, cpu_full, and scoring / scoring_cpu: the
    method's own selection time, wall-clock / process CPU) and ``stats``.
    """
    out: dict[str, Any] = {k: [] for k in ("wall", "wall_full", "cpu", "cpu_full", "scoring", "scoring_cpu")}
    wrap(model)
    prefill_seconds(model, inputs)
    out["stats"] = model.vlm_prune.last_stats
    for r in range(repeats):
        if r:
            wrap(model)
        wall, cpu = prefill_seconds(model, inputs)
        out["scoring"].append(float(model.vlm_prune.last_stats.get("seconds", 0.0)))
        out["scoring_cpu"].append(float(model.vlm_prune.last_stats.get("cpu_seconds", 0.0)))
        vlm_prune.unwrap(model)
        wall_full, cpu_full = prefill_seconds(model, inputs)
        for key, value in zip(("wall", "wall_full", "cpu", "cpu_full"), (wall, wall_full, cpu, cpu_full)):
            out[key].append(value)
    return out


def efficiency(measured: float, ideal: float) -> float | None:
    """(1/measured - 1) / (1/ideal - 1): the share of the FLOPs-ideal speed-up obtained."""
    return (1 / measured - 1) / (1 / ideal - 1) if ideal < 1 else None


#: prompt tokens QuoTA's default scorer adds to each frame (the chat-templated frame question)
QUOTA_PROMPT_TOKENS = 40


class QuotaScorerCost:
    """The work of QuoTA's default scorer on a model without a tokenizer (the random shapes).

    The default scorer runs the unpruned language model once per frame on the frame's tokens
    resized to ``score_grid`` (7 x 7), the newline and the chat-templated frame prompt, and reads
    the logits of the last position. Here the same rows (random embeddings in place of the
    prompt's, :data:`QUOTA_PROMPT_TOKENS` of them) go through the same language model and head,
    all frames in one batch; p = sigmoid of one logit (timing does not need meaningful scores).
    """

    def __init__(self, model: torch.nn.Module, grid: tuple[int, int] = (7, 7)) -> None:
        self.model = model
        self.rows = grid[0] * grid[1] + 1 + QUOTA_PROMPT_TOKENS

    def __call__(self, pixels: torch.Tensor, prompt: str) -> torch.Tensor:
        hidden = metrics.text_config(self.model.config).hidden_size
        embeds = torch.randn(pixels.shape[0], self.rows, hidden, generator=torch.Generator().manual_seed(0))
        with self.model.vlm_prune.adapter.unpruned(), torch.no_grad():
            logits = self.model(inputs_embeds=embeds.to(self.model.device, self.model.dtype), logits_to_keep=1).logits
        return torch.sigmoid(logits[:, -1, 0].float()).cpu()


def default_methods(kind: str, model: torch.nn.Module) -> list[str]:
    """The methods timed without ``--methods``: :data:`SPEED_METHODS` of the shape in that order,
    then every other registered method the model's adapter runs (``Method.refusal``), so a newly
    registered method is timed without a change here."""
    from vlm_prune.adapters import find_adapter
    from vlm_prune.registry import available_methods, method_class

    adapter = find_adapter(model)
    listed = list(SPEED_METHODS[kind])
    extra = [m for m in available_methods()
             if m not in listed and method_class(m).refusal(adapter.family, adapter.stages) is None]
    return listed + extra


def build_method(method: str, model: torch.nn.Module, n_layers: int, factor: float) -> tuple[Any, str]:
    """The method object for one setting (pruning layers at the real depth's fraction)."""
    if method == "quota":
        from vlm_prune.frames.quota import QuoTA

        return QuoTA(scorer=QuotaScorerCost(model), decouple=False), (
            "scorer cost as the default scorer's (7 x 7 grid + newline + 40 prompt rows per frame), no decoupling")
    return fit_layer(method, n_layers, factor)


def run_kind(kind: str, args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    from tqdm.auto import tqdm

    from vlm_prune.registry import method_class

    model = build(kind, args.scale, dtype, args.device)
    inputs = inputs_for(model, kind, args.frames)
    seq = inputs["input_ids"].shape[1]
    tcfg = metrics.text_config(model.config)
    real_layers = (QWEN2_7B if kind == "video" else LLAMA_7B)["num_hidden_layers"]
    tower = tower_flops(model, kind, args.frames)
    full_flops = tower + metrics.prefill_flops(model.config, [seq] * tcfg.num_hidden_layers)
    name = {"image": f"llava-1.5-7b/{args.scale}", "image-deep": "llava-1.5-7b/64-deep",
            "video": f"llava-onevision-7b/{args.scale} ({args.frames} frames)"}[kind]
    only = args.methods.split(",") if args.methods else None
    methods = default_methods(kind, model) if only is None else only
    for m in methods:
        method_class(m)  # an unknown name is an error, not an empty table
    settings = [(m, k) for m in methods for k in args.speed_keeps]
    settings += [(m, 1.0) for m in IDENTITY_METHODS if (only is None or m in only) and 1.0 not in args.speed_keeps]
    factor = tcfg.num_hidden_layers / real_layers
    rows, skipped = [], []
    for method, keep in tqdm(settings, desc=f"speed {kind}", unit="setting"):
        def wrap(m: torch.nn.Module, method: str = method, keep: float = keep) -> None:
            obj, _ = build_method(method, m, tcfg.num_hidden_layers, factor)
            vlm_prune.wrap(m, obj, keep=keep)

        try:
            _, note = build_method(method, model, tcfg.num_hidden_layers, factor)
            t = time_setting(model, wrap, inputs, args.repeats)
        except (ValueError, ImportError) as err:
            if getattr(model, "vlm_prune", None) is not None:
                vlm_prune.unwrap(model)
            skipped.append({"model": name, "method": method, "keep": keep, "reason": str(err).splitlines()[0]})
            continue
        stats = t["stats"]
        tower_kept = tower * math.prod(r.get("flops_ratio", 1.0) for r in stats["stages"] if r["stage"] == "vit")
        flops = tower_kept + metrics.prefill_flops(model.config, metrics.rows_per_layer(tcfg.num_hidden_layers, seq, stats))
        key = "cpu" if args.device == "cpu" else "wall"
        per_repeat = [a / b for a, b in zip(t[key], t[key + "_full"])]
        measured, ideal = statistics.median(per_repeat), flops / full_flops
        full_s = statistics.median(t[key + "_full"])
        rows.append({
            "model": name, "method": method, "keep": keep,
            "visual_tokens_in": sum(stats["visual_tokens_in"]), "visual_tokens_out": sum(stats["visual_tokens_out"]),
            "ttft_s": statistics.median(t["wall"]), "ttft_unpruned_s": statistics.median(t["wall_full"]),
            "measured_ratio": measured, "ratio_min": min(per_repeat), "ratio_max": max(per_repeat),
            "timer": "process CPU time" if key == "cpu" else "wall-clock",
            "ideal_ratio": ideal, "overhead": measured / ideal, "efficiency": efficiency(measured, ideal),
            # the method's selection time over the unpruned prefill, by the same clock as the ratio
            "scoring_share": statistics.median(t["scoring" if key == "wall" else "scoring_cpu"]) / full_s,
            "unpruned_s": full_s, "llm_flops_ratio": (flops - tower_kept) / (full_flops - tower),
            "tower_flops_share": tower / full_flops, "notes": note,
        })
    return rows, skipped


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> str:
    head = ["model", "method", "keep", "visual tokens", "TTFT ms", "unpruned ms", "measured ratio (min-max)",
            "ideal ratio (FLOPs)", "efficiency", "overhead", "scoring % of prefill", "LLM FLOPs ratio", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], r["method"], f"{r['keep']:g}", f"{r['visual_tokens_out']} / {r['visual_tokens_in']}",
            f"{1000 * r['ttft_s']:.1f}", f"{1000 * r['ttft_unpruned_s']:.1f}",
            f"{r['measured_ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})", f"{r['ideal_ratio']:.3f}",
            fmt(r["efficiency"], ".2f"), f"{r['overhead']:.3f}", f"{100 * r['scoring_share']:.1f}",
            f"{r['llm_flops_ratio']:.2f}", markdown_escape(r["notes"]),
        ]) + " |")
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {s['model']}: {s['method']} - {s['reason']}" for s in skipped]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """The --speed mode of ``vlm-prune bench``."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    kinds = [k for k in args.shapes.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UsageError(f"--shapes: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    if args.methods and "saturation" in args.methods.split(","):
        raise UsageError("--speed times registered methods; 'saturation' is the accuracy bench's model-free baseline")
    return run_and_write("speed", args, (run_kind(kind, args, dtype) for kind in kinds), markdown, plot=False)
