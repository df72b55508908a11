"""VisionZip's official variant against the per-slot variant on the synthetic image model
(its earlier run is in the history of BENCHMARKS.md, "VisionZip: official variant").

    python scripts/visionzip_variants.py      # about 30 seconds on one CPU thread
"""
from __future__ import annotations

import torch

import vlm_prune
from vlm_prune.eval.synthetic import load, make_dataset
from vlm_prune.eval.synthetic.evaluate import evaluate
from vlm_prune.methods.visionzip import VisionZip

if __name__ == "__main__":
    torch.set_num_threads(1)
    model, proc = load("image")
    samples = make_dataset("image", "test", 300)
    for keep in (0.25, 0.11, 0.05):
        for variant in ("official", "slots"):
            vlm_prune.wrap(model, VisionZip(variant=variant), keep=keep, processor=proc)
            acc = evaluate(model, proc, samples, batch_size=32)
            tokens = model.vlm_prune.last_stats["visual_tokens_out"][0]
            vlm_prune.unwrap(model)
            print(f"visionzip {variant} keep {keep}: {tokens} tokens, accuracy {acc:.3f}", flush=True)
