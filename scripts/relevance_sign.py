"""Instruction-relevance sign on the shipped synthetic models (its earlier run is in the history of
BENCHMARKS.md, "Instruction relevance sign").

CDPruner accuracy with relevance = -cos (the default) and +cos, on the image and video models;
KeyScore (every frame a candidate) recall@k of the answer frames, k = number of answer frames,
ranking by the relevance term alone and by the full KeyScore, and its accuracy, both signs.
Every figure is pooled over the shipped seeds the bench uses (``bench.seeds_and_families``: each
seed asked the task families it answers, on the same test samples), with the paired 95% interval
of (-cos) - (+cos) over the same samples / clips.

    python scripts/relevance_sign.py                # 15-25 minutes on one thread of the shared 2-core machine
    python scripts/relevance_sign.py --limit 60     # a smoke run
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch

import vlm_prune
from vlm_prune.eval.bench import seeds_and_families
from vlm_prune.eval.bench_stats import mean_ci, paired
from vlm_prune.eval.synthetic import load, make_dataset, shipped_seeds
from vlm_prune.eval.synthetic.evaluate import encode, predict
from vlm_prune.frames.keyscore import KeyScore
from vlm_prune.methods.cdpruner import CDPruner

SIGNS = (True, False)  # negate: -cos, +cos
#: (label, setting) -> negate -> per-sample scores, concatenated seed after seed
RESULTS: dict[tuple[str, str], dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})


def sign(negate: bool) -> str:
    return "-cos" if negate else "+cos"


def hits(model, proc, samples) -> list[float]:
    return [float(p == s.answer.lower()) for p, s in zip(predict(model, proc, samples, batch_size=32), samples)]


def cdpruner_accuracy(kind: str, seed: int, samples, keeps: tuple[float, ...]) -> None:
    model, proc = load(kind, seed)
    for keep in keeps:
        for negate in SIGNS:
            vlm_prune.wrap(model, CDPruner(negate_relevance=negate), keep=keep, processor=proc)
            h = hits(model, proc, samples)
            vlm_prune.unwrap(model)
            RESULTS[(f"{kind} | CDPruner accuracy", f"keep {keep:g}")][negate] += h
            print(f"{kind} seed {seed} cdpruner keep {keep} {sign(negate)}: accuracy {np.mean(h):.3f}", flush=True)


def keyscore_recall_and_accuracy(seed: int, samples, keeps: tuple[float, ...]) -> None:
    model, proc = load("video", seed)
    clips = [s for s in samples if s.answer_frames]
    for weights, label in (((1.0, 0.0, 0.0), "relevance term only"), ((1 / 3, 1 / 3, 1 / 3), "KeyScore (1/3, 1/3, 1/3)")):
        for negate in SIGNS:
            vlm_prune.wrap(model, KeyScore(proposals="all", weights=weights, negate_relevance=negate), keep=0.25, processor=proc)
            recall, chance = [], []
            for i in range(0, len(clips), 16):
                batch = clips[i : i + 16]
                with torch.no_grad():
                    model(**encode(proc, batch))
                videos = [v for r in model.vlm_prune.last_stats["stages"] if r["stage"] == "frames" for v in r["videos"]]
                for s, v in zip(batch, videos):
                    k = len(s.answer_frames)
                    top = torch.argsort(-torch.tensor(v["frame_scores"]), stable=True)[:k].tolist()
                    recall.append(len(set(top) & set(s.answer_frames)) / k)
                    chance.append(k / len(v["frame_scores"]))
            vlm_prune.unwrap(model)
            RESULTS[(f"video | KeyScore {label}, recall@k", f"chance {np.mean(chance):.2f}")][negate] += recall
            print(f"video seed {seed} keyscore {label} {sign(negate)}: recall@k {np.mean(recall):.2f} "
                  f"(chance {np.mean(chance):.2f}, {len(clips)} clips)", flush=True)
    for keep in keeps:
        for negate in SIGNS:
            vlm_prune.wrap(model, KeyScore(proposals="all", negate_relevance=negate), keep=keep, processor=proc)
            h = hits(model, proc, samples)
            vlm_prune.unwrap(model)
            RESULTS[("video | KeyScore accuracy, every frame a candidate", f"keep {keep:g}")][negate] += h
            print(f"video seed {seed} keyscore every frame keep {keep} {sign(negate)}: accuracy {np.mean(h):.3f}", flush=True)


def table() -> str:
    lines = ["| model \\| method | setting | -cos (default) | +cos | (-cos) - (+cos), paired 95% CI | n |",
             "|---|---|---|---|---|---|"]
    for (label, setting), by_sign in RESULTS.items():
        neg, pos = np.array(by_sign[True]), np.array(by_sign[False])
        diff, ci = paired(neg, pos)
        lines.append(f"| {label} | {setting} | {mean_ci(neg)[0]:.3f} | {mean_ci(pos)[0]:.3f} | {diff:+.3f} +- {ci:.3f} | {len(neg)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300, help="test samples per model seed (default 300)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for kind, keeps in (("image", (0.25, 0.11, 0.05)), ("video", (0.5, 0.25))):
        seeds, families = seeds_and_families(kind, shipped_seeds(kind))
        samples = make_dataset(kind, "test", args.limit, qtypes=families)
        print(f"{kind}: seeds {seeds}, families {', '.join(families)}, {len(samples)} test samples per seed", flush=True)
        for seed in seeds:
            cdpruner_accuracy(kind, seed, samples, keeps)
            if kind == "video":
                keyscore_recall_and_accuracy(seed, samples, (0.5, 0.25, 0.125))
    print(table())


if __name__ == "__main__":
    main()
