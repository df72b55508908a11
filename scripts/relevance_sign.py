"""Instruction-relevance sign on the synthetic models (BENCHMARKS.md, "Instruction relevance sign").

CDPruner accuracy with relevance = -cos (the default) and +cos, on the image and video models;
KeyScore (every frame a candidate) recall@k of the answer frames, k = number of answer frames,
ranking by the relevance term alone and by the full KeyScore, and its accuracy, both signs.

    python scripts/relevance_sign.py      # about 2 minutes on one CPU thread
"""
from __future__ import annotations

import torch

import vlm_prune
from vlm_prune.eval.synthetic import load, make_dataset
from vlm_prune.eval.synthetic.evaluate import encode, evaluate
from vlm_prune.frames.keyscore import KeyScore
from vlm_prune.methods.cdpruner import CDPruner


def sign(negate: bool) -> str:
    return "-cos" if negate else "+cos"


def cdpruner_accuracy() -> None:
    for kind, n, keeps in (("image", 300, (0.25, 0.11, 0.05)), ("video", 150, (0.5, 0.25))):
        model, proc = load(kind)
        samples = make_dataset(kind, "test", n)
        for keep in keeps:
            for negate in (True, False):
                vlm_prune.wrap(model, CDPruner(negate_relevance=negate), keep=keep, processor=proc)
                print(f"cdpruner {kind} keep {keep} {sign(negate)}: accuracy {evaluate(model, proc, samples, batch_size=32):.3f}", flush=True)
                vlm_prune.unwrap(model)


def keyscore_recall_and_accuracy() -> None:
    model, proc = load("video")
    samples = make_dataset("video", "test", 150)
    clips = [s for s in samples if s.answer_frames]
    for weights, label in (((1.0, 0.0, 0.0), "relevance term"), ((1 / 3, 1 / 3, 1 / 3), "KeyScore")):
        for negate in (True, False):
            vlm_prune.wrap(model, KeyScore(proposals="all", weights=weights, negate_relevance=negate), keep=0.25, processor=proc)
            hits = chance = 0.0
            for i in range(0, len(clips), 16):
                batch = clips[i : i + 16]
                with torch.no_grad():
                    model(**encode(proc, batch))
                videos = [v for r in model.vlm_prune.last_stats["stages"] if r["stage"] == "frames" for v in r["videos"]]
                for s, v in zip(batch, videos):
                    k = len(s.answer_frames)
                    top = torch.argsort(-torch.tensor(v["frame_scores"]), stable=True)[:k].tolist()
                    hits += len(set(top) & set(s.answer_frames)) / k
                    chance += k / len(v["frame_scores"])
            vlm_prune.unwrap(model)
            print(f"keyscore {label} {sign(negate)}: recall@k {hits / len(clips):.2f} (chance {chance / len(clips):.2f}, {len(clips)} clips)", flush=True)
    for negate in (True, False):
        for keep in (0.5, 0.25, 0.125):
            vlm_prune.wrap(model, KeyScore(proposals="all", negate_relevance=negate), keep=keep, processor=proc)
            print(f"keyscore every frame keep {keep} {sign(negate)}: accuracy {evaluate(model, proc, samples, batch_size=32):.3f}", flush=True)
            vlm_prune.unwrap(model)


if __name__ == "__main__":
    torch.set_num_threads(1)
    cdpruner_accuracy()
    keyscore_recall_and_accuracy()
