"""``vlm-prune keyframes``: score and choose keyframes of videos, one JSON line per video.

    vlm-prune keyframes a.mp4 b.mp4 --captions captions.txt --encoder ./clip-vit-b32 \\
        --budget 8 --out scores.jsonl

--captions is a text file with one caption per video, in the order of the videos (a single
line applies to all), or a .json file mapping a video path or file name to its caption.
--encoder is a CLIP / SigLIP checkpoint (local folder or hub id, loaded with from_pretrained,
processor included); KeyScore needs it, method uniform does not.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

from vlm_prune.cli import UsageError, checkpoint, existing_file, plain_doc, positive_float, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keyframes", description=plain_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("videos", nargs="+", metavar="VIDEO", help="video files (a missing one is reported in its line)")
    p.add_argument("--captions", metavar="FILE", type=existing_file,
                   help="captions: one line per video, or a .json mapping")
    p.add_argument("--encoder", metavar="PATH_OR_ID", type=checkpoint, help="CLIP / SigLIP checkpoint for KeyScore")
    p.add_argument("--method", choices=("keyscore", "uniform"), default="keyscore")
    p.add_argument("--budget", type=positive_int, default=8, help="frames to keep per video (default 8)")
    p.add_argument("--proposals", choices=("stacfp", "all"), default="stacfp",
                   help="candidate frames: STACFP cluster medoids (default) or every decoded frame")
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--fps", type=positive_float, default=1.0, help="decode this many frames a second (default 1)")
    sampling.add_argument("--num-frames", type=positive_int, help="decode this many frames uniformly instead of --fps")
    p.add_argument("--device", default="cpu", help="device of the encoder (default cpu)")
    p.add_argument("--out", metavar="FILE", default="-", help="JSON lines output (default: stdout)")
    p.set_defaults(func=run)


def read_captions(path: str, videos: list[str]) -> list[str]:
    """One caption per video from a line-per-video text file or a JSON mapping."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json"):
        table = json.loads(text)
        if not isinstance(table, dict):
            raise ValueError("a .json captions file maps video paths or file names to captions")
        out = []
        for v in videos:
            caption = table.get(v, table.get(os.path.basename(v)))
            if caption is None:
                raise ValueError(f"{path} has no caption for {v} (keys are video paths or file names)")
            out.append(str(caption))
        return out
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) == 1:
        return lines * len(videos)
    if len(lines) != len(videos):
        raise ValueError(f"{path} has {len(lines)} captions for {len(videos)} videos; give one per video or one for all")
    return lines


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from vlm_prune.frames.keyscore import load_encoder
    from vlm_prune.frames.select import select_frames
    from vlm_prune.video import VideoError, native_stderr_silenced

    if not any(os.path.isfile(v) for v in args.videos):
        raise UsageError(f"no video file among {', '.join(args.videos)}; give paths of existing video files")
    encoder = None
    if args.method == "keyscore" and (not args.encoder or not args.captions):
        raise UsageError("--method keyscore needs --encoder PATH_OR_ID (a CLIP / SigLIP checkpoint) and "
                         "--captions FILE; or use --method uniform")
    try:
        captions = read_captions(args.captions, args.videos) if args.captions else [""] * len(args.videos)
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        raise UsageError(f"--captions {args.captions}: {err}") from None
    if args.method == "keyscore":
        try:
            encoder = load_encoder(args.encoder, device=args.device)
        except ValueError as err:
            raise UsageError(str(err).split(". Give")[0].splitlines()[0] + "; give a CLIP / SigLIP checkpoint "
                             "folder or hub id") from None
    errors: list[str] = []
    sink = contextlib.nullcontext(sys.stdout) if args.out == "-" else open(args.out, "w", encoding="utf-8")  # noqa: SIM115
    with sink as out:
        # the progress bar only on a terminal; the decoders' own logs never (their failures are the errors below)
        for video, caption in tqdm(list(zip(args.videos, captions)), desc="keyframes", unit="video", disable=None):
            record = {"video": video, "caption": caption, "method": args.method, "budget": args.budget}
            try:
                with native_stderr_silenced(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    sel = select_frames(
                        video, caption, method=args.method, budget=args.budget, encoder=encoder,
                        proposals=args.proposals, num_frames=args.num_frames, fps=None if args.num_frames else args.fps,
                    )
            except VideoError as err:
                errors.append(str(err))
                record["error"] = str(err)
                if len(args.videos) > 1:
                    print(f"warning: {err}", file=sys.stderr)
            else:
                for warning in caught:
                    print(f"warning: {warning.message}", file=sys.stderr)
                if len(sel.indices) < args.budget:
                    print(f"note: {video}: returned {len(sel.indices)} frames, fewer than --budget {args.budget}: "
                          f"the clip gave only {len(sel.candidates)} candidate frames at these sampling settings "
                          "(raise --fps or --num-frames for more)", file=sys.stderr)
                record.update(
                    indices=sel.indices.tolist(),
                    scores=None if sel.scores is None else [round(float(s), 6) for s in sel.scores],
                    timestamps=None if sel.timestamps is None else [round(float(s), 3) for s in sel.timestamps],
                    candidates=sel.candidates.tolist(),
                )
            out.write(json.dumps(record) + "\n")
            out.flush()
    if len(errors) == len(args.videos):
        raise UsageError(errors[0] if len(errors) == 1 else f"no video could be decoded; the first: {errors[0]}")
    return 1 if errors else 0
