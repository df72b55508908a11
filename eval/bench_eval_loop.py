"""Seconds per question of ``vlm-prune eval``: video decoding versus the model, on a sweep.

    python -m vlm_prune.eval.bench_eval_loop --videos 12 --out /tmp/bench_eval_loop

Writes ``--videos`` real MP4 clips (OpenCV, mp4v, 640x360, 10 s at 30 fps), one question each,
and runs the shipped tiny synthetic video model (eval/synthetic/models/video) over them with a
3-setting sweep (none, random keep 0.5, random keep 0.25; 16 frames). Prints, per question and
setting: wall seconds, model seconds (mean ``generate_s``), and the rest (decoding and the
loop's own overhead), plus the decode seconds the results record when the runner records them.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic", "models", "video")


def write_clips(root: str, n: int) -> str:
    """n clips of moving noise and a question file in the generic jsonl layout; returns the file."""
    import cv2

    os.makedirs(os.path.join(root, "clips"), exist_ok=True)
    rng = np.random.default_rng(0)
    table = os.path.join(root, "qa.jsonl")
    with open(table, "w", encoding="utf-8") as f:
        for i in range(n):
            path = os.path.join(root, "clips", f"v{i}.mp4")
            if not os.path.exists(path):
                writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (640, 360))
                base = rng.integers(0, 255, (360, 640, 3), dtype=np.uint8)
                for t in range(300):
                    writer.write(np.roll(base, 4 * t, axis=1))
                writer.release()
            f.write(json.dumps({"id": f"q{i}", "video": f"clips/v{i}.mp4", "question": "what colour is the shape?",
                                "options": ["red", "green", "blue", "yellow"], "answer": "A"}) + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    import torch

    from vlm_prune.eval.runner import EvalConfig, load_model, run_eval
    from vlm_prune.eval.sharding import current

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=12)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--out", default="/tmp/bench_eval_loop")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    table = write_clips(os.path.join(args.out, "data"), args.videos)
    run_dir = os.path.join(args.out, f"run{time.time_ns()}")
    cfg = EvalConfig(model=MODEL, data=table, dataset="jsonl", out=run_dir, methods=["none", "random"],
                     keeps=[0.5, 0.25], frames=args.frames, max_new_tokens=2)
    model, processor = load_model(cfg, current())
    start = time.perf_counter()  # the sweep alone: model loading is not counted
    rows = run_eval(cfg, model, processor)
    wall = time.perf_counter() - start
    n = args.videos * len(rows)
    model_s = decode_s = 0.0
    for row in rows:
        with open(os.path.join(run_dir, row["name"], "results.jsonl"), encoding="utf-8") as f:
            recs = [json.loads(line) for line in f]
        model_s += sum(r.get("generate_s") or 0.0 for r in recs)
        decode_s += sum(r.get("decode_s") or 0.0 for r in recs)
    print(f"{n} questions ({args.videos} videos x {len(rows)} settings), {args.frames} frames each")
    print(f"wall s/question {wall / n:.4f}  model s/question {model_s / n:.4f}  "
          f"rest (decode + loop) s/question {(wall - model_s) / n:.4f}  recorded decode s/question {decode_s / n:.4f}")


if __name__ == "__main__":
    main()
