"""The evaluation loop: load a model, prune it, answer every question, measure, resume, merge.

``Predictor`` turns (text, frames or images) into a greedy answer in the model's own chat
template and measures it (time to first token, generation time, visual tokens before and
after pruning, analytic prefill FLOPs). ``run_eval`` runs one or more (method, keep) settings
over a dataset, writes one JSON line per sample as it goes and a summary per setting; a sweep
also gets a Markdown + JSON table and a plot (see :mod:`vlm_prune.eval.plots`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

import vlm_prune
from vlm_prune.eval import metrics, sharding
from vlm_prune.eval.answers import format_prompt, score
from vlm_prune.eval.datasets import Sample, load_samples

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass
class Generation:
    """One answer and its measurements."""

    text: str
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    generate_s: float
    visual_tokens_in: int
    visual_tokens_out: int
    prefill_flops: float
    prefill_flops_unpruned: float


class _Clock(metrics.FirstTokenClock, LogitsProcessor):
    """FirstTokenClock as the LogitsProcessor type generate() expects."""


class Predictor:
    """Greedy answers of a (possibly wrapped) HF VLM, measured.

    model: a HF VLM, wrapped by ``vlm_prune.wrap`` or not; processor: its processor (with a
    chat template). max_new_tokens: 16 by default (enough for a letter or a short phrase).
    """

    def __init__(self, model: torch.nn.Module, processor: Any, max_new_tokens: int = 16) -> None:
        self.model = model
        self.processor = processor
        self.max_new_tokens = max_new_tokens
        self.device = next(model.parameters()).device
        self.timer = metrics.Timer(self.device)
        cfg = model.config
        self.visual_ids = [i for i in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None)) if i is not None]
        self.n_layers = metrics.text_config(cfg).num_hidden_layers

    def prompt(self, text: str, media_type: str | None, n_media: int) -> str:
        content: list[dict[str, str]] = [{"type": media_type} for _ in range(n_media)] if media_type else []
        content.append({"type": "text", "text": text})
        return self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    def inputs(self, text: str, visuals: Sequence[Any], media_type: str | None) -> dict[str, torch.Tensor]:
        """Processor outputs on the model's device; float tensors in the model's dtype."""
        kwargs: dict[str, Any] = {"text": [self.prompt(text, media_type, len(visuals))], "return_tensors": "pt"}
        if media_type == "video":
            kwargs["videos"] = list(visuals)
        elif media_type == "image":
            kwargs["images"] = list(visuals)
        batch = self.processor(**kwargs)
        dtype = self.model.dtype
        return {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                for k, v in batch.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def generate(
        self, text: str, visuals: Sequence[Any], media_type: str | None,
        max_new_tokens: int | None = None, stop: Sequence[str] = (),
    ) -> Generation:
        """Answer ``text`` about ``visuals`` (one video as a uint8 [T,H,W,3] array, or PIL images)."""
        batch = self.inputs(text, visuals, media_type)
        ids = batch["input_ids"]
        seq_len = int(ids.shape[1])
        clock = _Clock(self.timer)
        tok = self.processor.tokenizer
        start = self.timer.now()
        out = self.model.generate(
            **batch, max_new_tokens=max_new_tokens or self.max_new_tokens, do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
        end = self.timer.now()
        new = out[0, seq_len:]
        answer = tok.decode(new, skip_special_tokens=True)
        for s in stop:
            if s and s in answer:
                answer = answer[: answer.index(s)]
        state = getattr(self.model, "vlm_prune", None)
        stats = state.last_stats if state is not None else None
        n_visual = int(sum(int((ids == i).sum()) for i in self.visual_ids))
        v_in = int(sum(stats["visual_tokens_in"])) if stats else n_visual
        v_out = int(sum(stats["visual_tokens_out"])) if stats else n_visual
        cfg = self.model.config
        return Generation(
            text=answer.strip(),
            prompt_tokens=seq_len,
            new_tokens=int(new.numel()),
            ttft_s=(clock.first if clock.first is not None else end) - start,
            generate_s=end - start,
            visual_tokens_in=v_in,
            visual_tokens_out=v_out,
            prefill_flops=metrics.prefill_flops(cfg, metrics.rows_per_layer(self.n_layers, seq_len, stats)),
            prefill_flops_unpruned=metrics.prefill_flops(cfg, [seq_len] * self.n_layers),
        )


# ------------------------------------------------------------------------------- media reading
def _pick(n: int, k: int) -> np.ndarray:
    """k indices spread uniformly over range(n) (all of them when k >= n)."""
    if k >= n:
        return np.arange(n)
    return np.round(np.linspace(0, n - 1, k)).astype(np.int64)


def _read_frame_folder(folder: str, frames: int, fps: float, clip: tuple[float, float] | None) -> np.ndarray:
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTS))
    if not files:
        raise FileNotFoundError(f"no image frames ({', '.join(IMAGE_EXTS)}) in {folder}")
    idx = np.arange(len(files))
    if clip is not None:
        inside = idx[(idx / fps >= clip[0]) & (idx / fps <= clip[1])]
        idx = inside if inside.size else idx
    idx = idx[_pick(len(idx), frames)]
    return np.stack([np.asarray(Image.open(os.path.join(folder, files[i])).convert("RGB")) for i in idx])


def load_visuals(sample: Sample, frames: int | str, decode_timeout: float | None = None) -> list[Any]:
    """A video as [frames uint8 [T,H,W,3]] (the clip only, for clipped questions) or PIL images.

    frames: frames per video (an int, or "quota" for QuoTA's duration rule). A clipped
    question reads four times as many frames over the whole video and keeps those inside
    the clip, spread uniformly.
    """
    from vlm_prune.video import read_frames

    if sample.media_type == "image":
        return [Image.open(p).convert("RGB") for p in sample.media]
    path = sample.media[0]
    if os.path.isdir(path):
        return [_read_frame_folder(path, frames if isinstance(frames, int) else 32, sample.frames_fps or 1.0, sample.clip)]
    if sample.clip is None:
        video, _ = read_frames(path, num_frames=frames, timeout=decode_timeout)
        return [video]
    n_read = frames * 4 if isinstance(frames, int) else frames
    video, times = read_frames(path, num_frames=n_read, timeout=decode_timeout)
    inside = np.nonzero((times >= sample.clip[0]) & (times <= sample.clip[1]))[0]
    keep = inside if inside.size else np.arange(len(times))
    k = frames if isinstance(frames, int) else len(keep)
    return [video[keep[_pick(len(keep), k)]]]


# ------------------------------------------------------------------------------------- config
@dataclass
class EvalConfig:
    """Everything one ``vlm-prune eval`` invocation needs; see ``vlm_prune.eval.cli``."""

    model: str
    data: str
    dataset: str
    out: str
    methods: list[str] = field(default_factory=lambda: ["none"])
    keeps: list[float] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    frames: int | str = 32
    limit: int | None = None
    split: str | None = None
    skip_missing: bool = False
    max_new_tokens: int = 16
    dtype: str = "auto"
    device_map: str | None = None
    attn_implementation: str | None = None
    seed: int = 0
    decode_timeout: float | None = 300.0


@dataclass(frozen=True)
class Setting:
    """One point of a sweep: a method pipeline ("none", "random", "quota+pact") and its budget."""

    method: str
    keep: float | None = None
    budget: int | None = None

    @property
    def name(self) -> str:
        if self.method == "none":
            return "none"
        amount = f"keep{self.keep:g}" if self.keep is not None else f"budget{self.budget}"
        return f"{self.method}_{amount}"


def settings(cfg: EvalConfig) -> list[Setting]:
    """The sweep: "none" once, every other method at each keep (or budget)."""
    out = []
    for method in cfg.methods:
        if method == "none":
            out.append(Setting("none"))
            continue
        if not cfg.keeps and not cfg.budgets:
            raise ValueError(f"method {method!r} needs --keep (fractions) or --budget (tokens per image/frame)")
        out += [Setting(method, keep=k) for k in cfg.keeps] + [Setting(method, budget=b) for b in cfg.budgets]
    return out


def load_model(cfg: EvalConfig, dist: sharding.Dist) -> tuple[torch.nn.Module, Any]:
    """(model, processor) from a hub id or local folder; one device per rank, or device_map."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cuda = torch.cuda.is_available()
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    processor = AutoProcessor.from_pretrained(cfg.model)
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, **kwargs)
    if not cfg.device_map:
        model.to(torch.device(f"cuda:{dist.local_rank}") if cuda else torch.device("cpu"))
    return model.eval(), processor


# ---------------------------------------------------------------------------------------- run
def _check_run_dir(run_dir: str, identity: dict[str, Any], dist: sharding.Dist) -> None:
    """Refuse to resume into a folder that holds results of a different configuration."""
    path = os.path.join(run_dir, "run_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != identity:
            diff = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            raise ValueError(
                f"{run_dir} holds results of a different configuration (differs in {', '.join(diff)}); "
                "use another --out folder or delete that one"
            )
        return
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.rank{dist.rank}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(identity, f, indent=1)
    os.replace(tmp, path)


def _record(sample: Sample, gen: Generation | None, error: str | None, device: torch.device) -> dict[str, Any]:
    pred, correct = score(sample, gen.text) if gen is not None else (None, False)
    rec: dict[str, Any] = {"id": sample.id, "categories": sample.categories, "answer": sample.answer,
                           "output": gen.text if gen else None, "pred": pred, "correct": correct}
    if gen is not None:
        rec.update({k: v for k, v in asdict(gen).items() if k != "text"})
    rec["peak_memory_bytes"] = metrics.peak_memory_bytes(device)
    if error:
        rec["error"] = error
    return rec


def evaluate_setting(
    predictor: Predictor, samples: list[Sample], run_dir: str, cfg: EvalConfig, dist: sharding.Dist, desc: str,
) -> dict[str, Any] | None:
    """Evaluate this rank's shard of ``samples`` into ``run_dir``; rank 0 returns the summary."""
    from vlm_prune.video import VideoError

    mine = sharding.shard(samples, dist)
    done = sharding.read_records(run_dir)
    todo = [s for s in mine if s.id not in done]
    correct = sum(bool(done[s.id]["correct"]) for s in mine if s.id in done)
    seen = len(mine) - len(todo)
    label = desc if dist.world_size == 1 else f"{desc} [rank {dist.rank}]"
    metrics.reset_peak_memory(predictor.device)
    with sharding.RankWriter(run_dir, dist) as writer, tqdm(
        total=len(mine), initial=seen, desc=label, position=dist.rank, dynamic_ncols=True
    ) as bar:
        for sample in todo:
            gen, error = None, None
            try:
                visuals = load_visuals(sample, cfg.frames, cfg.decode_timeout)
                gen = predictor.generate(format_prompt(sample), visuals, sample.media_type)
            except (VideoError, OSError) as err:  # unreadable media: counted as wrong, kept in the file
                error = f"{type(err).__name__}: {err}"
            rec = _record(sample, gen, error, predictor.device)
            writer.write(rec)
            seen += 1
            correct += bool(rec["correct"])
            bar.update(1)
            bar.set_postfix(acc=f"{correct / seen:.3f}")
    if not dist.is_main:
        return None
    records = sharding.wait_for(run_dir, [s.id for s in samples], log=tqdm.write)
    ordered = [records[s.id] for s in samples]
    sharding.write_merged(run_dir, ordered)
    summary = metrics.summarize(ordered)
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def run_eval(
    cfg: EvalConfig, model: torch.nn.Module | None = None, processor: Any = None,
) -> list[dict[str, Any]] | None:
    """Run every setting of ``cfg``; rank 0 returns one summary row per setting (others None).

    model / processor: already loaded objects (tests, notebooks); loaded from ``cfg.model`` if None.
    """
    from vlm_prune.eval.plots import write_sweep

    dist = sharding.current()
    samples = load_samples(cfg.dataset, cfg.data, split=cfg.split, skip_missing=cfg.skip_missing)
    if cfg.limit is not None:
        samples = samples[: cfg.limit]
    plan = settings(cfg)
    if model is None:
        model, processor = load_model(cfg, dist)
    if processor is None:
        raise ValueError("run_eval needs the model's processor when a model object is given")
    rows = []
    for setting in plan:
        run_dir = os.path.join(cfg.out, setting.name)
        identity = {"model": cfg.model, "dataset": cfg.dataset, "data": os.path.abspath(cfg.data),
                    "split": cfg.split, "frames": cfg.frames, "max_new_tokens": cfg.max_new_tokens,
                    "seed": cfg.seed, **asdict(setting)}
        _check_run_dir(run_dir, identity, dist)
        if setting.method != "none":
            vlm_prune.wrap(model, setting.method.split("+"), keep=setting.keep, budget=setting.budget,
                           processor=processor, seed=cfg.seed)
        try:
            predictor = Predictor(model, processor, cfg.max_new_tokens)
            summary = evaluate_setting(predictor, samples, run_dir, cfg, dist, setting.name)
        finally:
            if setting.method != "none":
                vlm_prune.unwrap(model)
        if summary is not None:
            rows.append({"name": setting.name, **asdict(setting), **summary})
    if not dist.is_main:
        return None
    write_sweep(rows, cfg.out, title=f"{cfg.model} on {cfg.dataset}")
    return rows
