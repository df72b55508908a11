"""``vlm-prune bench``: every registered method on the shipped synthetic models (or ``--model``).

For each model (the shipped models: every shipped training seed) it runs the unpruned baseline,
the saturation baseline (half the budget on the most saturated patches / frames, half random: a
method must beat it) and every applicable method at each keep ratio (0.5 / 0.25 / 0.11 / 0.05 of
the visual tokens; video: frames methods alone and composed with PACT). Per row: accuracy with its
95% interval, the spread over model seeds, retention and chance-corrected retention, per task family
accuracy, visual tokens at the end of the LLM and averaged over its layers, the ideal prefill FLOPs
ratio (``vlm_prune.eval.metrics``) and the prefill time ratio against the unpruned model measured in
the same run (median of ``--repeats`` prefill forwards, pruned and unpruned interleaved).

The matched view (:mod:`vlm_prune.eval.bench_stats`) interpolates every method at 25%, 11% and 5% of
the visual tokens (final and layer-averaged) and at the FLOPs of pruning that many before the LLM,
and names the best method per task family with paired 95% intervals against the runner-up, the
saturation baseline and random; every method also gets its paired difference to each reference row
the run has (saturation, QuoTA, KeyScore, DivPrune: ``bench_stats.REFERENCES``). Every registered
method runs unless ``--methods`` names some (``saturation`` for the baseline). Combinations a model
does not support are listed as skipped rows.

Writes ``bench.json``, ``bench.md`` and the figure ``bench.png`` (with ``.svg`` and ``.pdf``) under
``--out``. ``--speed`` times randomly initialised models of real shapes instead
(:mod:`vlm_prune.eval.speed`).
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
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from vlm_prune.eval import bench_stats, metrics
from vlm_prune.eval.synthetic import encode, load, make_dataset, shipped_seeds, trained_qtypes
from vlm_prune.eval.synthetic.baselines import PixelTap, SaturationFrames, SaturationTokens
from vlm_prune.eval.synthetic.scenes import COLOURS, DEFAULT_SEED, Sample

import vlm_prune
from vlm_prune.api import is_wrapped
from vlm_prune.cli import UsageError, cannot_load, fit_terminal, fresh_output
from vlm_prune.registry import method_class, method_stages

IMAGE_KEEPS = (0.5, 0.25, 0.11, 0.05)
VIDEO_KEEPS = (0.5, 0.25, 0.11, 0.05)
QUICK_IMAGE_KEEPS = (0.25, 0.05)
QUICK_VIDEO_KEEPS = (0.25,)
#: test samples per model kind, split evenly over the shipped seeds (default / --quick)
SAMPLES = {"image": 900, "video": 900}
QUICK_SAMPLES = {"image": 96, "video": 48}
#: the LLM-stage method composed with every frames method on video models
FRAMES_PARTNER = "pact"
#: the required model-free baseline row (vlm_prune.eval.synthetic.baselines)
SATURATION = "saturation"


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


def query_objects(query: str) -> list[str]:
    """QuoTA's query decoupling in the synthetic vocabulary: the objects the user's query names.

    The objects a synthetic query can name are coloured shapes: "<colour> shape" for the first
    colour the query names, else "coloured shape" (the query names only "shape"). QuoTA then asks
    per frame "is there a <object> ?" and reads P(yes) vs P(no) (``PLAIN_PROMPTS``).
    """
    words = query.lower().replace("?", " ").split()
    colour = next((w for w in words if w in COLOURS), None)
    return [f"{colour} shape" if colour else "coloured shape"]


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


def saturation_case(model: torch.nn.Module, processor: Any, adapter: Any, tap: PixelTap | None, seed: int) -> tuple[Callable[[torch.nn.Module], Any] | None, str]:
    """The saturation baseline for this model (frames on video models, patches on LLaVA images), or (None, why not)."""
    proc = getattr(processor, "video_processor", None) if "frames" in adapter.stages else getattr(processor, "image_processor", None)
    mean, std = getattr(proc, "image_mean", None), getattr(proc, "image_std", None)
    if mean is None or std is None:
        return None, "the processor states no image_mean / image_std to recover pixels"
    if "frames" in adapter.stages:
        return (lambda m: SaturationFrames(mean, std, seed)), "half the frames by saturation, half random"
    if adapter.family != "llava" or tap is None:
        return None, "needs one square patch grid per image (LLaVA-1.5 layout)"
    patch = model.config.vision_config.patch_size
    return (lambda m: SaturationTokens(tap, mean, std, patch)), "half the tokens by saturation, half random"


def plan(model: torch.nn.Module, processor: Any, keeps: tuple[float, ...], only: set[str] | None = None,
         tap: PixelTap | None = None, seed: int = 0) -> tuple[list[Case], list[dict[str, str]]]:
    """Cases for the saturation baseline and every registered method the model's adapter can run,
    and skipped combinations."""
    from vlm_prune.adapters import find_adapter

    adapter = find_adapter(model)
    n_layers = metrics.text_config(model.config).num_hidden_layers
    tokenizer = getattr(processor, "tokenizer", processor)
    cases: list[Case] = []
    skipped: list[dict[str, str]] = []

    def single(name: str) -> tuple[Callable[[torch.nn.Module], Any], str]:
        if name == "quota" and not has_token(tokenizer, "A"):
            note = ("quota: tokenizer has no 'A'; the model itself scores each frame, P(yes) to 'is there a <object> ?' "
                    "with the objects the user's query names (bench.query_objects)")
            return (lambda m: method_class("quota").for_processor(processor, objects=query_objects)), note
        _, note = fit_layer(name, n_layers)
        return (lambda m: fit_layer(name, n_layers)[0]), note

    if only is None or SATURATION in only:
        make, note = saturation_case(model, processor, adapter, tap, seed)
        if make is None:
            skipped.append({"method": SATURATION, "reason": note})
        else:
            cases += [Case(SATURATION, lambda m, make=make: [make(m)], k, note) for k in keeps]
    for name in vlm_prune.available_methods():
        if only is not None and name not in only:
            continue
        cls = method_class(name)
        refusal = cls.refusal(adapter.family, adapter.stages)
        if refusal:
            skipped.append({"method": name, "reason": refusal})
            continue
        try:
            make, note = single(name)
        except ImportError as err:  # e.g. KeyScore's STACFP without the video extra
            skipped.append({"method": name, "reason": str(err)})
            continue
        cases += [Case(name, lambda m, make=make: [make(m)], k, note) for k in keeps]
        # (a frames method that brings its own llm stage, HoliTom's inner merge, takes no partner there)
        if method_stages(name) == ("frames",) and (only is None or FRAMES_PARTNER in only):
            partner, partner_note = single(FRAMES_PARTNER)
            notes = "; ".join(n for n in (note, partner_note, f"{FRAMES_PARTNER} with its own default schedule") if n)
            cases += [Case(f"{name}+{FRAMES_PARTNER}", lambda m, a=make, b=partner: [a(m), b(m)], k, notes) for k in keeps]
    return cases, skipped


def refuse_inapplicable(args: argparse.Namespace) -> None:
    """Before any model loads: refuse (UsageError) a ``--methods`` list of which no method runs on a
    benched model's adapter family (``Method.refusal``, the rule wrap() applies); the saturation
    baseline counts as running everywhere."""
    if not args.methods or SATURATION in args.methods.split(","):
        return
    from vlm_prune.adapters import FAMILY_STAGES, family_of
    from vlm_prune.eval.synthetic.models import model_path

    if args.model is None:
        models = {f"the synthetic {kind} model": model_path(kind) / "config.json" for kind in args.kinds}
    elif os.path.isdir(args.model):
        models = {args.model: os.path.join(args.model, "config.json")}
    else:
        return  # a hub model: wrap() names what it refuses once the model is loaded
    for label, config in models.items():
        try:
            with open(config, encoding="utf-8") as f:
                architectures = json.load(f).get("architectures") or []
        except OSError:
            continue  # targets() says what is missing
        family = next(filter(None, map(family_of, architectures)), None)
        if family is None:
            continue
        refusals = [method_class(n).refusal(family, FAMILY_STAGES[family]) for n in args.methods.split(",")]
        if all(refusals):
            raise UsageError(f"--methods {args.methods}: none runs on {label} ({refusals[0]}); "
                             "see `vlm-prune methods` for the methods each model family runs")


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


def layer_average(config: Any, visual_in: int, stats: dict[str, Any] | None, i: int) -> float:
    """Visual tokens of sample ``i`` averaged over the decoder layers (what prefill FLOPs follow):
    last_stats' ``visual_tokens_layer_avg`` when the engine reports it, else from its stage records."""
    if stats is None:
        return float(visual_in)
    if stats.get("visual_tokens_layer_avg") is not None:
        return float(stats["visual_tokens_layer_avg"][i])
    one = {"stages": [{**r, "tokens_in": [r["tokens_in"][i]], "tokens_out": [r["tokens_out"][i]]} for r in stats["stages"]]}
    n_layers = metrics.text_config(config).num_hidden_layers
    return statistics.fmean(metrics.rows_per_layer(n_layers, visual_in, one))


def accuracy_pass(model: torch.nn.Module, processor: Any, batches: list[tuple[list[Sample], dict[str, torch.Tensor]]]) -> dict[str, Any]:
    """Greedy answers of every batch: per-sample correctness, accuracy per family, visual tokens
    in / out / layer-averaged and FLOPs (pruned over unpruned)."""
    hits: list[bool] = []
    tok_in = tok_out = tok_avg = 0.0
    flops = flops_full = 0.0
    tokenizer = processor.tokenizer
    for samples, inputs in batches:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += [first_word(t) == s.answer.lower() for t, s in zip(texts, samples)]
        stats = model.vlm_prune.last_stats if is_wrapped(model) else None
        seq = inputs["attention_mask"].sum(1).tolist()
        for i, length in enumerate(seq):
            flops += sample_flops(model.config, length, stats, i)
            flops_full += sample_flops(model.config, length, None, i)
            if stats is not None:
                tok_in += stats["visual_tokens_in"][i]
                tok_out += stats["visual_tokens_out"][i]
                tok_avg += layer_average(model.config, stats["visual_tokens_in"][i], stats, i)
    n = len(hits)
    qtypes = [s.qtype for samples, _ in batches for s in samples]
    families = {q: statistics.fmean(h for h, t in zip(hits, qtypes) if t == q) for q in sorted(set(qtypes))}
    return {"n": n, "accuracy": sum(hits) / n, "correct": "".join("1" if h else "0" for h in hits),
            "by_family": families, "visual_tokens_in": tok_in / n if tok_in else None,
            "visual_tokens_out": tok_out / n if tok_in else None,
            "visual_tokens_layer_avg": tok_avg / n if tok_in else None, "flops_ratio": flops / flops_full}


def to_device(inputs: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Processor outputs on the model's device, pixels in the model's dtype."""
    return {k: v.to(model.device, dtype=model.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


#: the fewest model seeds a task family is benchmarked on (the spread over seeds needs several)
MIN_SEEDS = 3


def seeds_and_families(kind: str, seeds: list[int]) -> tuple[list[int], tuple[str, ...]]:
    """The shipped ``seeds`` of ``kind`` to bench, and the task families to ask them.

    A family is asked when at least ``MIN_SEEDS`` of ``seeds`` (all of them, when fewer are given)
    answer it (their cards' ``eval_qtypes``); the seeds benched are those that answer every asked
    family, so each seed is scored on the same paired samples. When that leaves fewer than
    ``MIN_SEEDS`` seeds, every seed is benched on the families all of them answer. Prints what it leaves out.
    """
    per_seed = {seed: trained_qtypes(kind, seed) for seed in seeds}
    need = min(MIN_SEEDS, len(seeds))
    order = list(dict.fromkeys(q for fams in per_seed.values() for q in fams))
    families = tuple(q for q in order if sum(q in fams for fams in per_seed.values()) >= need)
    chosen = [seed for seed in seeds if set(families) <= set(per_seed[seed])]
    if len(chosen) < need:
        chosen = list(seeds)
        families = tuple(q for q in order if all(q in fams for fams in per_seed.values()))
    for seed in (seed for seed in seeds if seed not in chosen):
        print(f"synthetic-{kind}: seed {seed} is left out: it answers {sorted(set(families) - set(per_seed[seed]))} "
              f"no better than chance; benching seeds {chosen}")
    if dropped := sorted(set(order) - set(families)):
        print(f"synthetic-{kind}: families {dropped} are left out: fewer than {need} of seeds {seeds} answer them better than chance")
    return chosen, families


def run_model(name: str, model: torch.nn.Module, processor: Any, samples: list[Sample], keeps: tuple[float, ...],
              args: argparse.Namespace, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows (unpruned first) and skipped combinations of one model (training ``seed`` of a shipped kind)."""
    from tqdm.auto import tqdm

    only = set(args.methods.split(",")) if args.methods else None
    tap = PixelTap(getattr(getattr(model, "model", model), "vision_tower", model))
    try:
        cases, skipped = plan(model, processor, keeps, only, tap, args.seed)
        batches = [(samples[i:i + args.batch_size], to_device(encode(processor, samples[i:i + args.batch_size]), model))
                   for i in range(0, len(samples), args.batch_size)]
        timed = [inputs for _, inputs in batches[: args.time_batches]]
        base = accuracy_pass(model, processor, batches)
        t_base = time_pair(model, None, timed, args.repeats)
        n_visual = _visual_count(model, batches[0][1])
        chance = statistics.fmean(1 / len(s.options) for s in samples)
        rows = [{"model": name, "seed": seed, "method": "none", "keep": 1.0, **base, "visual_tokens_in": n_visual,
                 "visual_tokens_out": n_visual, "visual_tokens_layer_avg": n_visual, "kept_fraction": 1.0,
                 "layer_avg_fraction": 1.0, "chance": chance, "retention": 1.0, "chance_retention": 1.0,
                 **ratios(t_base, model.device), "notes": "", "qtypes": [s.qtype for s in samples]}]
        for case in tqdm(cases, desc=f"bench {name} seed {seed}", unit="setting"):
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
                "model": name, "seed": seed, "method": case.label, "keep": case.keep, **res,
                "kept_fraction": res["visual_tokens_out"] / res["visual_tokens_in"],
                "layer_avg_fraction": res["visual_tokens_layer_avg"] / res["visual_tokens_in"], "chance": chance,
                "retention": res["accuracy"] / base["accuracy"] if base["accuracy"] else None,
                "chance_retention": bench_stats.chance_retention(res["accuracy"], base["accuracy"], chance),
                **ratios(timing, model.device), "notes": case.notes,
            })
    finally:
        tap.close()
    return rows, [{"model": name, "seed": seed, **s} for s in skipped]


def _visual_count(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    """Visual tokens per sample of the unpruned model, counted as the library counts them (a
    keep=1.0 wrap changes nothing; LLaVA-OneVision's newline tokens are not visual tokens)."""
    import vlm_prune

    vlm_prune.wrap(model, "random", keep=1.0)
    try:
        with torch.no_grad():
            model(**inputs)
        return float(sum(model.vlm_prune.last_stats["visual_tokens_in"]) / inputs["input_ids"].shape[0])
    finally:
        vlm_prune.unwrap(model)


# ---- data -----------------------------------------------------------------------------------------
def processor_size(processor: Any) -> int | None:
    """The square side the processor's image/video processor resizes to, when it states one."""
    for attr in ("video_processor", "image_processor"):
        proc = getattr(processor, attr, None)
        if getattr(proc, "temporal_patch_size", None) is not None:
            continue  # Qwen2-VL-style processors (Qwen-VL, GLM-4.1V, LLaVA-OV-1.5): size holds pixel counts, any side fits
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


def per_seed(total: int, seeds: list[int]) -> int:
    """Test samples per model seed so that all seeds together hold at least ``total``."""
    return -(-total // max(1, len(seeds)))


def targets(args: argparse.Namespace) -> Iterator[tuple[str, int, torch.nn.Module, Any, list[Sample], tuple[float, ...]]]:
    """(name, seed, model, processor, test samples, keep ratios) of every model to bench, loaded one at a time.

    The shipped models: every shipped training seed of each kind in ``--kinds``, each on the same
    first test samples (so methods and seeds pair up), ``--limit`` (default 900, ``--quick`` 96 /
    48) split evenly over the seeds; ``--quick`` benches the first seed only unless ``--seeds`` says otherwise.
    """
    quick = args.quick
    keeps = {"image": args.keep or (QUICK_IMAGE_KEEPS if quick else IMAGE_KEEPS),
             "video": args.keep or (QUICK_VIDEO_KEEPS if quick else VIDEO_KEEPS)}
    totals = {k: args.limit or (QUICK_SAMPLES if quick else SAMPLES)[k] for k in ("image", "video")}
    if args.model is None:
        if args.device != "cpu":
            raise UsageError("the shipped synthetic models run on CPU; --device cuda applies to --model and --speed")
        for kind in args.kinds:
            seeds = shipped_seeds(kind)[: args.seeds or (1 if quick else None)]
            if not seeds:
                raise UsageError(f"no shipped {kind} model; train one with `python -m vlm_prune.eval.synthetic.train --kind {kind}`")
            seeds, families = seeds_and_families(kind, seeds)
            if not families:
                raise UsageError(f"the shipped {kind} seeds {seeds} share no task family they answer better than chance")
            samples = make_dataset(kind, "test", per_seed(totals[kind], seeds), seed=args.data_seed, qtypes=families)
            for seed in seeds:
                model, processor = load(kind, seed)
                yield f"synthetic-{kind}", seed, model, processor, samples, keeps[kind]
        return
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vlm_prune.adapters import find_adapter

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    try:
        processor = AutoProcessor.from_pretrained(args.model)
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    except (OSError, ValueError, ImportError) as err:  # not found / downloadable, not image-text-to-text, a missing package
        raise UsageError(cannot_load(args.model, err)) from None
    try:
        kind = "video" if "frames" in find_adapter(model).stages else "image"
    except TypeError as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    samples = render_for(make_dataset(kind, "test", totals[kind], seed=args.data_seed), processor_size(processor), with_options=True)
    yield args.model, 0, model, processor, samples, keeps[kind]


# ---- report ---------------------------------------------------------------------------------------
def markdown_escape(text: str) -> str:
    return text.replace("|", "\\|")


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows pooled over model seeds (per-sample scores dropped) and the matched view."""
    pooled = bench_stats.pool_seeds(rows)
    qtypes = {r["model"]: r["qtypes"] for r in rows if r["method"] == "none"}
    return {"pooled": [{k: v for k, v in r.items() if k != "correct"} for r in pooled],
            "matched": bench_stats.matched(pooled, qtypes)}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _diff(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    return f"{entry['method']}: {100 * entry['diff']:+.1f} +- {100 * entry['ci']:.1f}"


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> str:
    """The pooled results table, accuracy per task family, the matched view and the skipped combinations."""
    summary = summarise(rows)
    pooled, matched = summary["pooled"], summary["matched"]
    head = ["model", "method", "keep", "accuracy % (95% CI)", "visual tokens", "layer-avg tokens", "FLOPs ratio (ideal)",
            "seeds (min-max)", "retention", "chance-corrected retention", "prefill CPU-time ratio", "prefill time ratio", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in pooled:
        tokens = f"{fmt(r['visual_tokens_out'], '.1f')} / {fmt(r['visual_tokens_in'], '.0f')}"
        spread = f"{_pct(r['accuracy_min'])}-{_pct(r['accuracy_max'])} ({len(r['seeds'])})"
        lines.append("| " + " | ".join([
            r["model"], r["method"], fmt(r["keep"], "g"), f"{_pct(r['accuracy'])} +- {_pct(r['accuracy_ci'])}", tokens,
            fmt(r["visual_tokens_layer_avg"], ".1f"), fmt(r["flops_ratio"], ".2f"), spread,
            fmt(r["retention"], ".3f"), fmt(r["chance_retention"], ".3f"), fmt(r["prefill_cpu_ratio"], ".2f"),
            fmt(r["prefill_ratio"], ".2f"), markdown_escape(r["notes"]),
        ]) + " |")
    for model in dict.fromkeys(r["model"] for r in pooled):
        mine = [r for r in pooled if r["model"] == model]
        families = list(mine[0]["by_family"])
        lines += ["", f"Accuracy % per task family, {model} (mean over seeds):", "",
                  "| method | keep | " + " | ".join(families) + " |", "|" + "---|" * (len(families) + 2)]
        lines += ["| " + " | ".join([r["method"], fmt(r["keep"], "g")] + [_pct(r["by_family"].get(f)) for f in families]) + " |"
                  for r in mine]
        lines += _matched_tables(model, [m for m in matched if m["model"] == model])
    seen = set()
    unique = []
    for s in skipped:
        key = (s["model"], s["method"], s.get("keep"), s["reason"])
        if key not in seen:
            seen.add(key)
            unique.append(s)
    if unique:
        lines += ["", "Skipped (not applicable to the model):", ""]
        lines += [f"- {s['model']}: {s['method']}" + (f" (keep {s['keep']})" if s.get("keep") is not None else "")
                  + f" - {s['reason']}" for s in unique]
    return "\n".join(lines) + "\n"


def _matched_tables(model: str, entries: list[dict[str, Any]]) -> list[str]:
    """Per axis: accuracy of every method at each matched target (all families), then the best
    method per family at each target with paired 95% intervals."""
    lines: list[str] = []
    for axis, label in bench_stats.AXES.items():
        mine = [e for e in entries if e["axis"] == axis and e["family"] == "all"]
        if not mine:
            continue
        targets = [f"{100 * e['fraction']:g}%" + (f" (FLOPs {e['target']:.2f})" if axis == "flops_ratio" else "") for e in mine]
        methods = list(mine[0]["accuracy"])
        lines += ["", f"Matched {label}, {model}: accuracy % interpolated at each target (- = not reached):", "",
                  "| method | " + " | ".join(targets) + " |", "|" + "---|" * (len(targets) + 1)]
        lines += ["| " + " | ".join([m] + [_pct(e["accuracy"][m]) for e in mine]) + " |" for m in methods]
        if axis != "flops_ratio":  # at matched FLOPs the vision-stage rows repeat the layer-avg ones
            lines += _reference_table(model, label, mine)
        lines += ["", f"Best method per task family at matched {label}, {model} (paired difference, % points +- 95% CI):", "",
                  "| family | target | best | accuracy % | vs runner-up | vs saturation | vs random |", "|---|---|---|---|---|---|---|"]
        for e in (e for e in entries if e["axis"] == axis):
            best = e["best"]
            lines.append("| " + " | ".join([
                e["family"], f"{100 * e['fraction']:g}%", best or "-", _pct(e["accuracy"].get(best)) if best else "-",
                _diff(e.get("vs_runner_up")), _diff(e.get("vs_saturation")), _diff(e.get("vs_random")),
            ]) + " |")
    return lines


def _reference_table(model: str, label: str, mine: list[dict[str, Any]]) -> list[str]:
    """Every method at each matched target (all families) with its 95% interval and its paired
    difference to each reference row the model has (``bench_stats.REFERENCES``)."""
    refs = [r for r in bench_stats.REFERENCES if any(e["accuracy"].get(r) is not None for e in mine)]
    if not refs:
        return []
    lines = ["", f"Every method against {', '.join(refs)} at matched {label}, {model} (accuracy % +- 95% CI; "
             f"paired difference method - reference, % points +- 95% CI; - = not reached):", "",
             "| method | target | accuracy % | " + " | ".join(f"vs {r}" for r in refs) + " |", "|" + "---|" * (3 + len(refs))]
    for method in mine[0]["accuracy"]:
        for e in mine:
            acc = e["accuracy"][method]
            if acc is None:
                continue
            vs = e["vs_references"].get(method, {})
            cells = [f"{100 * vs[r]['diff']:+.1f} +- {100 * vs[r]['ci']:.1f}" if r in vs else "-" for r in refs]
            lines.append("| " + " | ".join([method, f"{100 * e['fraction']:g}%",
                                            f"{_pct(acc)} +- {_pct(e['ci'][method])}", *cells]) + " |")
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> list[str]:
    """The bench figure (:func:`vlm_prune.eval.plots.bench_figure`) from the rows pooled over seeds."""
    from vlm_prune.eval.plots import bench_figure

    return bench_figure(bench_stats.pool_seeds(rows), path)


def write_outputs(out_dir: str, payload: dict[str, Any], table: str, rows: list[dict[str, Any]] | None) -> dict[str, str]:
    """bench.json, bench.md and (with rows) the figure bench.png (+ .svg, .pdf) under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = payload["meta"]["mode"]
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "markdown": os.path.join(out_dir, f"{stem}.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(table)
    if rows is not None:
        paths["plot"], paths["svg"], paths["pdf"] = plot(rows, os.path.join(out_dir, f"{stem}.png"))
    return paths


def code_version() -> str:
    """``git describe --always --dirty`` of the checkout the package runs from, else the package version."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"vlm-prune {vlm_prune.__version__}" + (f" ({out})" if out else "")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meta(mode: str, argv_args: argparse.Namespace, program: str = "vlm-prune") -> dict[str, Any]:
    """Provenance of a result file: the command (``program`` and this process's arguments), the code
    version, the machine and the date (:mod:`vlm_prune.eval.report` refuses a result file without them)."""
    import shlex
    import sys

    import transformers

    return {
        "mode": mode,
        "command": f"{program} " + shlex.join(sys.argv[1:]),
        "code": code_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
                   + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "software": f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
        "data_seed": DEFAULT_SEED if getattr(argv_args, "data_seed", None) is None else argv_args.data_seed,
        "args": {k: v for k, v in vars(argv_args).items() if k != "func"},
    }


# ---- command --------------------------------------------------------------------------------------
def torch_threads(args: argparse.Namespace) -> int | None:
    """torch CPU threads for this run: ``--threads``; for ``--quick`` on the shipped models one
    (tiny models gain nothing from a second thread, whose waits cost CPU time on a busy machine);
    else None (torch's choice)."""
    if args.threads:
        return args.threads
    if args.quick and args.model is None and not args.speed and not getattr(args, "serve", False):
        return 1
    return None


def timing_repeats(args: argparse.Namespace) -> int:
    """Prefill timings per batch: ``--repeats``; else 1 for ``--quick`` on the shipped models (a
    smoke run: its time ratios are the median of one) and 3 otherwise."""
    if args.repeats:
        return args.repeats
    return 1 if args.quick and args.model is None and not args.speed and not getattr(args, "serve", False) else 3


def run(args: argparse.Namespace) -> int:
    args.repeats = timing_repeats(args)
    if getattr(args, "serve", False):  # vLLM serving throughput (eval/bench_serve.py, issue 19)
        from vlm_prune.eval import bench_serve

        fresh_output(args.out, ["serve.json"], args.overwrite)
        return bench_serve.run(args)
    fresh_output(args.out, ["speed.json" if args.speed else "bench.json"], args.overwrite)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    if not args.speed:
        refuse_inapplicable(args)
    threads = torch_threads(args)
    if threads:
        torch.set_num_threads(threads)
    if args.speed:
        from vlm_prune.eval import speed

        return speed.run(args)
    parts = (run_model(name, model, processor, samples, keeps, args, seed)
             for name, seed, model, processor, samples, keeps in targets(args))
    return run_and_write("bench", args, parts, markdown, plot=True, summarise=summarise)


def printed(table: str, where: str) -> str:
    """The table as the command prints it: cut to the terminal's width (the accuracy stays, in the
    fourth column; the rest is in ``where``), whole when stdout is no terminal (a pipe, a log file)."""
    return fit_terminal(table, where=where) if sys.stdout.isatty() else table


def run_and_write(mode: str, args: argparse.Namespace, parts: Iterable[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
                  to_markdown: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str], plot: bool,
                  summarise: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None) -> int:
    """Run every (rows, skipped) part lazily, then write bench.json / .md (and the plot) and print the table.

    ``summarise(rows)`` adds its keys (e.g. the pooled rows and the matched view) to the JSON."""
    start, info = time.perf_counter(), meta(mode, args)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for r, s in parts:
        rows += r
        skipped += s
    table = to_markdown(rows, skipped)
    payload = {"meta": {**info, "seconds": time.perf_counter() - start}, "rows": rows, "skipped": skipped,
               **(summarise(rows) if summarise else {})}
    paths = write_outputs(args.out, payload, table, rows if plot else None)
    print(printed(table, paths["markdown"]))
    print("wrote " + ", ".join(paths.values()))
    return 0
