"""``vlm-prune bench``: every registered method on the shipped synthetic models (or ``--model``).

For each model it runs the unpruned baseline and every applicable method at each keep ratio
(images: 1.0 / 0.5 / 0.25 / 0.11 / 0.05; video: 1.0 / 0.5 / 0.25 / 0.125 of the video tokens,
frames methods alone and composed with PACT), and reports accuracy, retention (accuracy /
unpruned accuracy), visual tokens kept, the prefill time ratio against the unpruned model
measured in the same run (median of ``--repeats`` prefill forwards per batch, pruned and
unpruned interleaved) and the ideal prefill FLOPs ratio (``vlm_prune.eval.metrics``).
Combinations a model does not support are listed as skipped rows with the reason.

Writes ``bench.json``, ``bench.md`` and ``bench.png`` (accuracy against the kept fraction, one
line per method, one panel per model) under ``--out``. ``--speed`` times randomly initialised
models of real shapes instead (:mod:`vlm_prune.eval.speed`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import string
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from vlm_prune.eval import metrics
from vlm_prune.eval.synthetic import encode, load, make_dataset
from vlm_prune.eval.synthetic.scenes import Sample

import vlm_prune
from vlm_prune.api import is_wrapped
from vlm_prune.registry import method_class

IMAGE_KEEPS = (1.0, 0.5, 0.25, 0.11, 0.05)
VIDEO_KEEPS = (1.0, 0.5, 0.25, 0.125)
QUICK_IMAGE_KEEPS = (0.25, 0.05)
QUICK_VIDEO_KEEPS = (0.25,)
#: the LLM-stage method composed with every frames method on video models
FRAMES_PARTNER = "pact"
#: QuoTA's frame question in the synthetic vocabulary (what its query decoupling would look for)
SYNTHETIC_FRAME_QUESTION = "is there a coloured shape ?"


# ---- methods ----------------------------------------------------------------------------------
def fit_layer(name: str, n_layers: int, factor: float = 1.0) -> tuple[Any, str]:
    """The method ``name`` with defaults, its pruning layer moved inside an ``n_layers`` decoder.

    Methods with a single pruning layer (FastV K=2, PACT L=4) get ``round(layer * factor)``
    clamped to [1, n_layers - 1] when that differs from the default; AdaptInfer's derived
    schedule keeps as many stage ratios as the depth has pruning steps. Returns (method, note).
    """
    cls = method_class(name)
    method = cls()
    ratios = getattr(method, "stage_ratios", None)
    if ratios is not None and getattr(method, "schedule", None) == "auto":  # AdaptInfer's derived schedule
        from vlm_prune.methods.adaptinfer import auto_layers

        stages = len(auto_layers(n_layers))
        if stages - 1 < len(ratios):
            return cls(stage_ratios=ratios[: stages - 1]), f"{name}: {stages} pruning step(s) ({n_layers} decoder layers)"
        return method, ""
    layer = getattr(method, "layer", None)
    if not isinstance(layer, int):
        return method, ""
    fitted = max(1, min(n_layers - 1, round(layer * factor)))
    if fitted == layer:
        return method, ""
    return cls(layer=fitted), f"{name} at layer {fitted} (default {layer}; {n_layers} decoder layers)"


class YesNoFrameScorer:
    """QuoTA frame scorer for tokenizers without an "A" token (the synthetic vocabulary).

    QuoTA asks the VLM one yes/no question per frame and uses P("A"); here the wrapped model
    itself, unpruned, answers ``question`` about each frame alone and p_t = P(yes) / (P(yes) + P(no)).
    LLaVA-OneVision layout (one frame = the pooled grid + the newline token).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, question: str = SYNTHETIC_FRAME_QUESTION) -> None:
        self.model = model
        self.question = question
        self.yes, self.no = (tokenizer.convert_tokens_to_ids(w) for w in ("yes", "no"))

    def __call__(self, pixels: torch.Tensor, prompt: str) -> torch.Tensor:
        adapter = self.model.vlm_prune.adapter
        rows, cols = adapter.frame_grid()
        ids = adapter.chat_ids(self.question, "video", rows * cols + 1)[None].expand(pixels.shape[0], -1)
        device = self.model.device
        with adapter.unpruned(), torch.no_grad():
            logits = self.model(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                pixel_values_videos=pixels[:, None].to(device), logits_to_keep=1,
            ).logits[:, -1, [self.yes, self.no]]
        return torch.softmax(logits.float(), dim=-1)[:, 0].cpu()


def has_token(tokenizer: Any, word: str) -> bool:
    ids = tokenizer.encode(word, add_special_tokens=False)
    return bool(ids) and ids != [getattr(tokenizer, "unk_token_id", None)]


@dataclasses.dataclass
class Case:
    """One row of the table: a pipeline of stage methods at one keep ratio."""

    label: str
    build: Callable[[torch.nn.Module], list[Any]]  # model -> configured methods (fresh objects)
    keep: float | None
    notes: str = ""


def plan(model: torch.nn.Module, processor: Any, keeps: tuple[float, ...], only: set[str] | None = None) -> tuple[list[Case], list[dict[str, str]]]:
    """Cases for every registered method the model's adapter can run, and skipped combinations."""
    from vlm_prune.adapters import find_adapter

    adapter = find_adapter(model)
    n_layers = metrics.text_config(model.config).num_hidden_layers
    tokenizer = getattr(processor, "tokenizer", processor)
    cases: list[Case] = []
    skipped: list[dict[str, str]] = []

    def single(name: str) -> tuple[Callable[[torch.nn.Module], Any], str]:
        if name == "quota" and not has_token(tokenizer, "A"):
            note = (f"quota: tokenizer has no 'A'; frames scored by the model itself, P(yes) to "
                    f"'{SYNTHETIC_FRAME_QUESTION}' per frame; no query decoupling")
            return (lambda m: method_class("quota")(scorer=YesNoFrameScorer(m, tokenizer), decouple=False)), note
        _, note = fit_layer(name, n_layers)
        return (lambda m: fit_layer(name, n_layers)[0]), note

    for name in vlm_prune.available_methods():
        if only is not None and name not in only:
            continue
        cls = method_class(name)
        if cls.stage not in adapter.stages:
            skipped.append({"method": name, "reason": f"{cls.stage}-stage method; the {adapter.family} adapter "
                                                      f"offers {', '.join(adapter.stages)}"})
            continue
        if cls.supported is not None and adapter.family not in cls.supported:
            skipped.append({"method": name, "reason": f"supports {', '.join(cls.supported)} models only"})
            continue
        try:
            make, note = single(name)
        except ImportError as err:  # e.g. KeyScore's STACFP without the video extra
            skipped.append({"method": name, "reason": str(err)})
            continue
        cases += [Case(name, lambda m, make=make: [make(m)], k, note) for k in keeps]
        if cls.stage == "frames" and (only is None or FRAMES_PARTNER in only):
            partner, partner_note = single(FRAMES_PARTNER)
            notes = "; ".join(n for n in (note, partner_note, f"{FRAMES_PARTNER} with its own default schedule") if n)
            cases += [Case(f"{name}+{FRAMES_PARTNER}", lambda m, a=make, b=partner: [a(m), b(m)], k, notes) for k in keeps]
    return cases, skipped


# ---- running ------------------------------------------------------------------------------------
def first_word(text: str) -> str:
    words = text.split()
    return words[0].strip(string.punctuation).lower() if words else ""


@torch.no_grad()
def prefill_seconds(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of one prefill forward pass (logits of the last position).

    On a shared CPU machine the process CPU time (with ``--threads 1``) is the stable measure;
    wall-clock time also counts the waits for other processes.
    """
    timer = metrics.Timer(model.device)
    start, cpu = timer.now(), time.process_time()
    model(**inputs, logits_to_keep=1)
    return timer.now() - start, time.process_time() - cpu


def wrap_case(model: torch.nn.Module, case: Case, processor: Any, seed: int = 0) -> torch.nn.Module:
    return vlm_prune.wrap(model, case.build(model), keep=case.keep, processor=processor, seed=seed)


def time_pair(model: torch.nn.Module, wrap: Callable[[torch.nn.Module], Any] | None,
              batches: list[dict[str, torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median prefill seconds per batch, summed over ``batches``: pruned and unpruned, wall and CPU.

    Each repeat wraps the model with ``wrap``, runs one untimed warm-up prefill, times one,
    unwraps and times the unpruned model (interleaved, so load changes hit both alike).
    ``wrap`` None times the unpruned model against itself. Keys: wall, wall_full, cpu, cpu_full.
    """
    out = dict.fromkeys(("wall", "wall_full", "cpu", "cpu_full"), 0.0)
    for inputs in batches:
        runs: dict[str, list[float]] = {k: [] for k in out}
        prefill_seconds(model, inputs)
        for _ in range(repeats):
            if wrap is not None:
                wrap(model)
                prefill_seconds(model, inputs)
            wall, cpu = prefill_seconds(model, inputs)
            if wrap is not None:
                vlm_prune.unwrap(model)
            wall_full, cpu_full = prefill_seconds(model, inputs)
            for key, value in zip(out, (wall, wall_full, cpu, cpu_full)):
                runs[key].append(value)
        for key in out:
            out[key] += statistics.median(runs[key])
    return out


def ratios(t: dict[str, float], device: torch.device) -> dict[str, float | None]:
    """Pruned / unpruned prefill time: wall-clock, and process CPU time on CPU devices."""
    return {"prefill_ratio": t["wall"] / t["wall_full"], "prefill_s": t["wall"],
            "prefill_cpu_ratio": t["cpu"] / t["cpu_full"] if device.type == "cpu" else None}


def sample_flops(config: Any, seq_len: int, stats: dict[str, Any] | None, i: int) -> float:
    """Prefill FLOPs of sample ``i`` of a batch from the batch's last_stats."""
    one = None
    if stats is not None:
        one = {"stages": [{**r, "tokens_in": [r["tokens_in"][i]], "tokens_out": [r["tokens_out"][i]]} for r in stats["stages"]]}
    n_layers = metrics.text_config(config).num_hidden_layers
    return metrics.prefill_flops(config, metrics.rows_per_layer(n_layers, seq_len, one))


def accuracy_pass(model: torch.nn.Module, processor: Any, batches: list[tuple[list[Sample], dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Greedy answers of every batch: accuracy, visual tokens in/out and FLOPs (pruned, unpruned)."""
    correct = n = tok_in = tok_out = 0
    flops = flops_full = 0.0
    tokenizer = processor.tokenizer
    for samples, inputs in batches:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(first_word(t) == s.answer.lower() for t, s in zip(texts, samples))
        n += len(samples)
        stats = model.vlm_prune.last_stats if is_wrapped(model) else None
        seq = inputs["attention_mask"].sum(1).tolist()
        for i, length in enumerate(seq):
            flops += sample_flops(model.config, length, stats, i)
            flops_full += sample_flops(model.config, length, None, i)
        if stats is not None:
            tok_in += sum(stats["visual_tokens_in"])
            tok_out += sum(stats["visual_tokens_out"])
    return {"n": n, "accuracy": correct / n, "visual_tokens_in": tok_in / n if tok_in else None,
            "visual_tokens_out": tok_out / n if tok_in else None, "flops_ratio": flops / flops_full}


def to_device(inputs: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Processor outputs on the model's device, pixels in the model's dtype."""
    return {k: v.to(model.device, dtype=model.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def run_model(name: str, model: torch.nn.Module, processor: Any, samples: list[Sample], keeps: tuple[float, ...],
              args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows (unpruned first) and skipped combinations of one model."""
    from tqdm.auto import tqdm

    only = set(args.methods.split(",")) if args.methods else None
    cases, skipped = plan(model, processor, keeps, only)
    batches = [(samples[i:i + args.batch_size], to_device(encode(processor, samples[i:i + args.batch_size]), model))
               for i in range(0, len(samples), args.batch_size)]
    timed = [inputs for _, inputs in batches[: args.time_batches]]
    base = accuracy_pass(model, processor, batches)
    t_base = time_pair(model, None, timed, args.repeats)
    n_visual = _visual_count(model, batches[0][1])
    rows = [{"model": name, "method": "none", "keep": 1.0, **base, "visual_tokens_in": n_visual,
             "visual_tokens_out": n_visual, "kept_fraction": 1.0, "retention": 1.0,
             **ratios(t_base, model.device), "notes": ""}]
    for case in tqdm(cases, desc=f"bench {name}", unit="setting"):
        try:
            wrap_case(model, case, processor, args.seed)
        except ValueError as err:
            skipped.append({"method": case.label, "keep": case.keep, "reason": str(err)})
            continue
        try:
            res = accuracy_pass(model, processor, batches)
        finally:
            vlm_prune.unwrap(model)
        timing = time_pair(model, lambda m, c=case: wrap_case(m, c, processor, args.seed), timed, args.repeats)
        rows.append({
            "model": name, "method": case.label, "keep": case.keep, **res,
            "kept_fraction": res["visual_tokens_out"] / res["visual_tokens_in"],
            "retention": res["accuracy"] / base["accuracy"] if base["accuracy"] else None,
            **ratios(timing, model.device), "notes": case.notes,
        })
    return rows, [{"model": name, **s} for s in skipped]


def _visual_count(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    """Visual tokens per sample of the unpruned model (placeholder tokens in the prompt)."""
    cfg = model.config
    placeholders = [getattr(cfg, a) for a in ("image_token_id", "video_token_id") if getattr(cfg, a, None) is not None]
    mask = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    for t in placeholders:
        mask |= inputs["input_ids"] == t
    return mask.sum(1).float().mean().item()


# ---- data -----------------------------------------------------------------------------------------
def processor_size(processor: Any) -> int | None:
    """The square side the processor's image/video processor resizes to, when it states one."""
    for attr in ("video_processor", "image_processor"):
        proc = getattr(processor, attr, None)
        for size in (getattr(proc, "crop_size", None), getattr(proc, "size", None)):
            size = dict(size or {})
            side = size.get("height") or size.get("shortest_edge")
            if side:
                return int(side)
    return None


def render_for(samples: list[Sample], side: int | None, with_options: bool) -> list[Sample]:
    """The samples upscaled (nearest) to ``side`` pixels; ``with_options`` appends the answer choices."""
    import numpy as np
    from PIL import Image

    out = []
    for s in samples:
        image, frames, question = s.image, s.frames, s.question
        if side and image is not None and image.size[0] != side:
            image = image.resize((side, side), Image.NEAREST)
        if side and frames is not None and frames.shape[1] != side:
            frames = np.stack([np.asarray(Image.fromarray(f).resize((side, side), Image.NEAREST)) for f in frames])
        if with_options:
            question = f"{question.replace(' ?', '?')} Answer with one word: {', '.join(s.options)}."
        out.append(dataclasses.replace(s, image=image, frames=frames, question=question))
    return out


def targets(args: argparse.Namespace) -> Iterator[tuple[str, torch.nn.Module, Any, list[Sample], tuple[float, ...]]]:
    """(name, model, processor, test samples, keep ratios) of every model to bench, loaded one at a time."""
    quick = args.quick
    n_image = args.limit or (96 if quick else 300)
    n_video = args.limit or (48 if quick else 150)
    image_keeps = args.keep or (QUICK_IMAGE_KEEPS if quick else IMAGE_KEEPS)
    video_keeps = args.keep or (QUICK_VIDEO_KEEPS if quick else VIDEO_KEEPS)
    if args.model is None:
        if args.device != "cpu":
            raise SystemExit("the shipped synthetic models run on CPU; --device cuda applies to --model and --speed")
        for kind, n, keeps in (("image", n_image, image_keeps), ("video", n_video, video_keeps)):
            model, processor = load(kind)
            yield f"synthetic-{kind}", model, processor, make_dataset(kind, "test", n), keeps
        return
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vlm_prune.adapters import find_adapter

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    processor = AutoProcessor.from_pretrained(args.model)
    video = "frames" in find_adapter(model).stages
    kind, n, keeps = ("video", n_video, video_keeps) if video else ("image", n_image, image_keeps)
    samples = render_for(make_dataset(kind, "test", n), processor_size(processor), with_options=True)
    yield args.model, model, processor, samples, keeps


# ---- report ---------------------------------------------------------------------------------------
def markdown_escape(text: str) -> str:
    return text.replace("|", "\\|")


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> str:
    """The results table and the list of skipped combinations."""
    head = ["model", "method", "keep", "visual tokens", "kept", "accuracy", "retention",
            "prefill time ratio", "prefill CPU-time ratio", "FLOPs ratio (ideal)", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tokens = f"{fmt(r['visual_tokens_out'], '.1f')} / {fmt(r['visual_tokens_in'], '.0f')}"
        lines.append("| " + " | ".join([
            r["model"], r["method"], fmt(r["keep"], "g"), tokens, fmt(r["kept_fraction"], ".3f"),
            fmt(r["accuracy"], ".3f"), fmt(r["retention"], ".3f"), fmt(r["prefill_ratio"], ".2f"),
            fmt(r["prefill_cpu_ratio"], ".2f"), fmt(r["flops_ratio"], ".2f"), markdown_escape(r["notes"]),
        ]) + " |")
    if skipped:
        lines += ["", "Skipped (not applicable to the model):", ""]
        lines += [f"- {s['model']}: {s['method']}" + (f" (keep {s['keep']})" if s.get("keep") is not None else "")
                  + f" - {s['reason']}" for s in skipped]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Accuracy against the kept fraction, one line per method, one panel per model."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    colours = colormaps["tab20"].colors
    markers = "os^vDPX*<>"
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(6.5 * len(models), 4.8), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, name in zip(axes, models):
        mine = [r for r in rows if r["model"] == name]
        for i, method in enumerate(dict.fromkeys(r["method"] for r in mine if r["method"] != "none")):
            pts = sorted((r for r in mine if r["method"] == method), key=lambda r: r["kept_fraction"])
            ax.plot([r["kept_fraction"] for r in pts], [r["accuracy"] for r in pts], label=method,
                    color=colours[i % len(colours)], marker=markers[i % len(markers)], ms=4,
                    ls="--" if "+" in method else "-")
        for r in mine:
            if r["method"] == "none":
                ax.axhline(r["accuracy"], color="black", ls=":", label="unpruned")
        ax.set(xscale="log", xlabel="kept fraction of visual tokens (log)", ylabel="accuracy", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110)


def write_outputs(out_dir: str, payload: dict[str, Any], table: str, rows: list[dict[str, Any]] | None) -> dict[str, str]:
    """bench.json, bench.md and (with rows) bench.png under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = payload["meta"]["mode"]
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "markdown": os.path.join(out_dir, f"{stem}.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(table)
    if rows is not None:
        paths["plot"] = os.path.join(out_dir, f"{stem}.png")
        plot(rows, paths["plot"])
    return paths


def meta(mode: str, argv_args: argparse.Namespace) -> dict[str, Any]:
    return {
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "args": {k: v for k, v in vars(argv_args).items() if k != "func"},
    }


# ---- command --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed:
        from vlm_prune.eval import speed

        return speed.run(args)
    parts = (run_model(name, model, processor, samples, keeps, args)
             for name, model, processor, samples, keeps in targets(args))
    return run_and_write("bench", args, parts, markdown, plot=True)


def run_and_write(mode: str, args: argparse.Namespace, parts: Iterable[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
                  to_markdown: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str], plot: bool) -> int:
    """Run every (rows, skipped) part lazily, then write bench.json / .md (and the plot) and print the table."""
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for r, s in parts:
        rows += r
        skipped += s
    table = to_markdown(rows, skipped)
    payload = {"meta": {**meta(mode, args), "seconds": time.perf_counter() - start}, "rows": rows, "skipped": skipped}
    paths = write_outputs(args.out, payload, table, rows if plot else None)
    print(table)
    print("wrote " + ", ".join(paths.values()))
    return 0


def _keeps(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 0.5,0.25, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"keep fractions must lie in (0, 1], got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="every method on the shipped synthetic models: accuracy, kept tokens, prefill time",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="fewer samples (96 image / 48 video) and keep ratios (0.25, 0.05 / 0.25); a row per method")
    p.add_argument("--limit", type=_positive, default=None, help="samples per model (default 300 image / 150 video)")
    p.add_argument("--keep", type=_keeps, default=None, help="keep ratios for every model, e.g. 0.5,0.25")
    p.add_argument("--methods", default=None, help="comma-separated method names to run (default: all registered)")
    p.add_argument("--model", default=None, metavar="PATH_OR_HUB_ID",
                   help="bench a supported checkpoint with its own processor instead of the shipped models")
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--repeats", type=_positive, default=3, help="prefill timings per batch, the median counts (default 3)")
    p.add_argument("--time-batches", type=_positive, default=1, help="batches timed per setting (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling methods (random; default 0)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch CPU threads (default: torch's choice); 1 gives stable timings on a shared machine")
    s = p.add_argument_group("--speed: time-to-first-token on random models of real shapes")
    s.add_argument("--speed", action="store_true", help="time LLaVA-1.5-7B / OneVision-7B shapes instead")
    s.add_argument("--scale", type=_positive, default=8,
                   help="divide hidden sizes, heads and layers by S (default 8; 1 = the real 7B shapes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (float32) or cuda (bfloat16) for --model and --speed; the shipped models run on CPU")
    s.add_argument("--frames", type=_positive, default=32, help="video frames of the OneVision shape (default 32)")
    s.add_argument("--speed-keeps", type=_keeps, default=(0.25, 0.11), help="keep ratios timed (default 0.25,0.11)")
    s.add_argument("--shapes", default="image,video,image-deep",
                   help="model shapes timed: image, video, image-deep (default all three)")
    p.set_defaults(func=run)
