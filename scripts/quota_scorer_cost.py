"""QuoTA's default frame scorer: its cost against the prefill it prunes, before and after re-using
the frame features (measured on CPU at a scaled LLaVA-OneVision-7B shape, and counted in FLOPs at
the real 7B shape).

    OMP_NUM_THREADS=1 python scripts/quota_scorer_cost.py --scale 8 --frames 8 --repeats 3

"before": the scorer as it was up to this change - every frame run again through the vision
tower (pixels), full-sequence logits, one batch. "after": QuoTA's default scorer now - the frames'
already computed tokens resized to ``score_grid`` (7 x 7), logits of the last position only.
A word-level tokenizer stands in for the model's (random weights, no checkpoint); it covers the
official frame prompt, so the prompts have their real length in words.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm_prune.eval import metrics
from vlm_prune.eval.speed import QWEN2_7B, SIGLIP_SO400M, build, inputs_for, tower_flops
from vlm_prune.frames.quota import QuoTA, frame_prompt, scorer_flops

import vlm_prune

QUERY = "What is the man holding in his left hand at the end of the video ?"
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {% for part in m['content'] %}"
            "{% if part['type'] == 'video' %} <video>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
            "{% endfor %} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")


def word_tokenizer(video_token_id: int):
    """A whitespace word-level tokenizer with a chat template whose "<video>" is ``video_token_id``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set((frame_prompt(QUERY, []) + " " + frame_prompt(QUERY, ["man", "hand"]) + " user assistant A").split()))
    vocab = {"<pad>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<video>": video_token_id}
    vocab.update({w: 10 + i for i, w in enumerate(words)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                   chat_template=TEMPLATE)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.process_time()
        with torch.no_grad():
            fn()
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


def old_scorer(model, tok, pixels: torch.Tensor, prompt: str) -> None:
    """The scorer before this change: pixels through the tower again, logits of every row."""
    rows = 14 * 14 + 1
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    vid = model.config.video_token_id
    ids = torch.tensor([[x for i in ids for x in ([vid] * rows if i == vid else [i])]] * pixels.shape[0])
    model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=pixels[:, None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build("video", args.scale, torch.float32, "cpu")
    tok = word_tokenizer(model.config.video_token_id)
    inputs = inputs_for(model, "video", args.frames)
    prompt = frame_prompt(QUERY, [])
    pixels = inputs["pixel_values_videos"][0]

    prefill = median_seconds(lambda: model(**inputs, logits_to_keep=1), args.repeats)
    before = median_seconds(lambda: old_scorer(model, tok, pixels, prompt), args.repeats)
    vlm_prune.wrap(model, QuoTA(decouple=False), keep=0.25, processor=tok)
    adapter = model.vlm_prune.adapter
    with torch.no_grad():
        feats = model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output[0]
    frames = feats[:-1].reshape(args.frames, -1, feats.shape[-1])
    after = median_seconds(lambda: adapter.score_frames(frames, feats[-1:], [prompt], ["A"], (7, 7)), args.repeats)
    pruned = median_seconds(lambda: model(**inputs, logits_to_keep=1), args.repeats)  # QuoTA at keep 0.25, scoring included
    vlm_prune.unwrap(model)
    print(f"CPU, one thread, onevision-7b/{args.scale}, {args.frames} frames, process CPU seconds (median of {args.repeats}):")
    print(f"  unpruned prefill {prefill:.3f} s; scorer before {before:.3f} s = {before / prefill:.2f}x the prefill; "
          f"after {after:.3f} s = {after / prefill:.2f}x; QuoTA keep 0.25 end to end {pruned / prefill:.2f}x")

    # FLOPs at the real 7B shape (32 frames): the prompt rows from this tokenizer and template
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    cfg = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**SIGLIP_SO400M), text_config=Qwen2Config(**QWEN2_7B))
    layers, t = QWEN2_7B["num_hidden_layers"], 32
    seq = 14 + t * 196 + 1 + 22
    text_rows = len(adapter_rows(tok, prompt)) - 1
    full = tower_flops(_Shape(cfg), "video", t) + metrics.prefill_flops(cfg, [seq] * layers)
    head_all = 2 * QWEN2_7B["hidden_size"] * QWEN2_7B["vocab_size"]
    old = tower_flops(_Shape(cfg), "video", t) + t * (metrics.prefill_flops(cfg, [197 + text_rows] * layers)
                                                     + (197 + text_rows - 1) * head_all)
    new = scorer_flops(cfg, t, 49 + 1 + text_rows)
    kept = tower_flops(_Shape(cfg), "video", t) + metrics.prefill_flops(cfg, [14 + t * 49 + 1 + 22] * layers)
    print(f"FLOPs at 7B, {t} frames, frame prompt {text_rows} text rows: unpruned prefill {full / 1e12:.1f} TFLOPs; "
          f"scorer before {old / full:.2f}x, after {new / full:.2f}x the prefill; keep 0.25 prefill {kept / full:.2f}x; "
          f"QuoTA end to end at keep 0.25 {(kept + new) / full:.2f}x, at keep 0.5 "
          f"{(tower_flops(_Shape(cfg), 'video', t) + metrics.prefill_flops(cfg, [14 + t * 98 + 1 + 22] * layers) + new) / full:.2f}x")


class _Shape:
    """Just enough of a model for tower_flops (its config)."""

    def __init__(self, config) -> None:
        self.config = config


def adapter_rows(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                   add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


if __name__ == "__main__":
    main()
