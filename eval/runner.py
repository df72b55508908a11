"""The evaluation loop: load a model, prune it, answer every question, measure, resume, merge.

``Predictor`` turns (text, frames or images) into a greedy answer in the model's own chat
template and measures it (time to first token, generation time, visual tokens before and
after pruning, analytic prefill FLOPs). ``run_eval`` runs one or more (method, keep) settings
over a dataset question by question: each video is decoded once (ahead, on background threads)
and answered under every setting; one JSON line per question and setting is written as it goes
(answered, failed with its error, or skipped), then a summary per setting and, for the sweep, a
Markdown + JSON table and a plot (see :mod:`vlm_prune.eval.plots`).
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

import vlm_prune
from vlm_prune.cli import cannot_load
from vlm_prune.eval import leaderboard, metrics, sharding
from vlm_prune.eval.answers import format_prompt, prompt_style, score
from vlm_prune.eval.datasets import (NO_SUBTITLES, Sample, missing_media_error, read_samples, read_srt,
                                    split_missing, subtitles_at)

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

    def inputs(self, text: str, visuals: Sequence[Any], media_type: str | None,
               times: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
        """Processor outputs on the model's device; float tensors in the model's dtype. A video's
        frames are the ones given (the processor does not sample again) at ``times`` (seconds, for the
        prompts that write each frame's time: Qwen3-VL, GLM-4.1V, SmolVLM2), see
        :func:`vlm_prune.video.processor_video_kwargs`."""
        from vlm_prune.video import processor_video_kwargs

        kwargs: dict[str, Any] = {"text": [self.prompt(text, media_type, len(visuals))], "return_tensors": "pt"}
        if media_type == "video":
            kwargs["videos"] = list(visuals)
            kwargs.update(processor_video_kwargs(self.processor, [times] * len(visuals) if times is not None else None))
        elif media_type == "image":
            kwargs["images"] = list(visuals)
        batch = self.processor(**kwargs)
        dtype = self.model.dtype
        return {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                for k, v in batch.items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def generate(
        self, text: str, visuals: Sequence[Any], media_type: str | None,
        max_new_tokens: int | None = None, stop: Sequence[str] = (), times: Sequence[float] | None = None,
    ) -> Generation:
        """Answer ``text`` about ``visuals`` (one video as a uint8 [T,H,W,3] array, its frames at
        ``times`` seconds when known, or PIL images)."""
        batch = self.inputs(text, visuals, media_type, times)
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


def _frame_number(name: str, position: int) -> int:
    """The number in a frame file's name ("00042.jpg" -> 42), else its 1-based position."""
    digits = "".join(c for c in os.path.splitext(name)[0] if c.isdigit())
    return int(digits) if digits else position + 1


def _read_frame_folder(
    folder: str, frames: int, fps: float, clip: tuple[float, float] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Frames of a folder of images taken at ``fps`` (MVBench's TVQA: 3 fps), file number m at
    m / fps seconds (the official MVBench reader's 1-based numbering); a clip keeps the frames
    inside it. Returns (frames uint8 [T,H,W,3], their times in seconds)."""
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTS))
    if not files:
        raise FileNotFoundError(f"no image frames ({', '.join(IMAGE_EXTS)}) in {folder}")
    numbers = np.array([_frame_number(f, i) for i, f in enumerate(files)])
    order = np.argsort(numbers, kind="stable")
    idx = order
    if clip is not None:
        times = numbers[order] / fps
        idx = order[(times >= clip[0]) & (times <= clip[1])]
        if not idx.size:
            raise ValueError(
                f"no frame of {folder} lies inside {clip[0]:g}-{clip[1]:g} s "
                f"({len(files)} frames at {fps:g} fps: {numbers.min() / fps:.2f}-{numbers.max() / fps:.2f} s)"
            )
    idx = idx[_pick(len(idx), frames)]
    video = np.stack([np.asarray(Image.open(os.path.join(folder, files[i])).convert("RGB")) for i in idx])
    return video, numbers[idx] / fps


@dataclass
class Visuals:
    """What one question shows the model: a video as [uint8 [T,H,W,3]] or PIL images, the
    seconds decoding took, and the decoder's warnings (a truncated file, a fallback backend)."""

    items: list[Any]
    decode_s: float = 0.0
    warnings: list[str] = field(default_factory=list)
    times: np.ndarray | None = None  # seconds of each video frame (None for images)
    n_frames: int | None = None  # frames the video file lists, and its frame rate (video files only)
    fps: float | None = None
    #: a truncated video file: {"listed": frames it lists, "decoded": frames that decode}
    truncated: dict[str, int] | None = None


def load_visuals(sample: Sample, frames: int | str, decode_timeout: float | None = None) -> Visuals:
    """A video's frames (a clipped question: sampled inside its clip only) or PIL images.

    frames: frames per video (an int, or "quota" for QuoTA's duration rule; 32 for folders of
    frames under "quota").
    """
    from vlm_prune.video import decode

    start = time.perf_counter()
    if sample.media_type == "image":
        items, notes = [Image.open(p).convert("RGB") for p in sample.media], []
        times = None
    elif os.path.isdir(sample.media[0]):
        n = frames if isinstance(frames, int) else 32
        video, times = _read_frame_folder(sample.media[0], n, sample.frames_fps or 1.0, sample.clip)
        items, notes = [video], []
    else:
        out = decode(sample.media[0], num_frames=frames, timeout=decode_timeout, bound=sample.clip)
        cut = {"listed": out.n_frames, "decoded": out.decoded} if out.truncated else None
        return Visuals([out.frames], time.perf_counter() - start, out.warnings, out.times, out.n_frames,
                       out.native_fps, cut)
    return Visuals(items, time.perf_counter() - start, notes, times)


def frame_plan(sample: Sample, frames: int | str) -> tuple[Any, ...]:
    """What decides the frames a question sees: equal plans share one decode."""
    return (tuple(sample.media), frames, sample.clip, sample.frames_fps)


class Prefetcher:
    """Decodes the visuals of the questions ahead on daemon threads while the model runs.

    Each frame plan (:func:`frame_plan`) is decoded once and kept only until its last question
    has taken it. ``workers`` threads decode (decoders release the GIL), at most ``ahead`` plans
    are held at a time. Daemon threads: Ctrl-C and SIGTERM stop the process without waiting for
    them.
    """

    def __init__(self, samples: Sequence[Sample], frames: int | str, decode_timeout: float | None,
                 workers: int = 2, ahead: int = 4) -> None:
        self.frames, self.timeout = frames, decode_timeout
        self.order: list[tuple[Any, ...]] = []
        self.first: dict[tuple[Any, ...], Sample] = {}
        self.uses: dict[tuple[Any, ...], int] = {}
        for s in samples:
            key = frame_plan(s, frames)
            if key not in self.first:
                self.first[key] = s
                self.order.append(key)
            self.uses[key] = self.uses.get(key, 0) + 1
        self.futures: dict[tuple[Any, ...], Future] = {}
        self.taken: set[tuple[Any, ...]] = set()
        self.next, self.ahead = 0, max(1, ahead)
        self.queue: queue.Queue = queue.Queue()
        for i in range(max(1, workers)):
            threading.Thread(target=self._work, name=f"vlm_prune-prefetch-{i}", daemon=True).start()
        self._fill()

    def _work(self) -> None:
        while True:
            key, fut = self.queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(load_visuals(self.first[key], self.frames, self.timeout))
            except BaseException as err:  # noqa: BLE001 - handed to the question that needs it
                fut.set_exception(err)

    def _fill(self, need: tuple[Any, ...] | None = None) -> None:
        while self.next < len(self.order) and (len(self.futures) < self.ahead or (need and need not in self.futures)):
            key = self.order[self.next]
            self.next += 1
            self.futures[key] = Future()
            self.queue.put((key, self.futures[key]))

    def get(self, sample: Sample) -> tuple[Visuals, bool]:
        """(visuals of ``sample``, whether this call is the first use of its decode); raises what
        decoding raised. Questions must be asked for in the order given."""
        key = frame_plan(sample, self.frames)
        self._fill(need=key)
        first = key not in self.taken
        self.taken.add(key)
        fut = self.futures[key]
        try:
            return fut.result(), first
        finally:
            self.uses[key] -= 1
            if self.uses[key] == 0:
                del self.futures[key]
                self._fill()


# ------------------------------------------------------------------------------------- config
SUBTITLES = ("without", "with", "both")


class EvalConfigError(ValueError):
    """A mistake in the configuration or its inputs (a flag, a method, the model), found before any
    question runs; the message says what to change. ``vlm-prune eval`` prints it as one line."""


@dataclass
class EvalConfig:
    """Everything one ``vlm-prune eval`` invocation needs; see ``vlm_prune.eval.cli``.

    decode_workers: background threads decoding the next questions' videos while the model
    answers (0: decode on the model's thread, when it is needed).
    subtitles: Video-MME only: "without" (default), "with" (the "w/ subs" score) or "both"
    (each setting twice, on the same decoded frames).
    device: "auto" (each rank's GPU when torch sees CUDA, else the CPU), "cuda" or "cpu"; ignored
    with ``device_map``, which places the model itself.
    """

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
    device: str = "auto"
    decode_timeout: float | None = 300.0
    decode_workers: int = 2
    subtitles: str = "without"
    #: minutes a rank waits for the others at the final sync (several processes; sharding.barrier)
    sync_timeout_min: float = sharding.SYNC_TIMEOUT_MIN

    #: config files (vlm_prune.config), each one more setting of the sweep
    configs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:  # paths may come as pathlib.Path
        self.model, self.data, self.out = os.fspath(self.model), os.fspath(self.data), os.fspath(self.out)


@dataclass(frozen=True)
class Setting:
    """One point of a sweep: a method pipeline ("none", "random", "quota+pact") and its budget."""

    method: str
    keep: float | None = None
    budget: int | None = None
    subtitles: bool = False  # Video-MME "w/ subs": the frame-aligned subtitles in the prompt
    #: a config file's setting (``--config``), as canonical JSON (vlm_prune.config.PruneConfig.to_json)
    config: str | None = None

    @property
    def name(self) -> str:
        suffix = "_subs" if self.subtitles else ""
        if self.method == "none":
            return "none" + suffix
        if self.config is not None:
            from vlm_prune.config import load_config

            return load_config(json.loads(self.config)).label() + suffix
        amount = f"keep{self.keep:g}" if self.keep is not None else f"budget{self.budget}"
        return f"{self.method}_{amount}{suffix}"


def settings(cfg: EvalConfig) -> list[Setting]:
    """The sweep: "none" once, every other method at each keep (or budget); every method name is
    checked against the registry here, before any data or model is loaded."""
    from vlm_prune.api import build_pipeline

    out = []
    for method in cfg.methods:
        if method == "none":
            out.append(Setting("none"))
            continue
        if not cfg.keeps and not cfg.budgets:
            raise EvalConfigError(f"method {method!r} needs --keep (fractions) or --budget (tokens per image/frame)")
        plan = [Setting(method, keep=k) for k in cfg.keeps] + [Setting(method, budget=b) for b in cfg.budgets]
        try:
            build_pipeline(method.split("+"), keep=plan[0].keep, budget=plan[0].budget)
        except (ValueError, TypeError) as err:
            raise EvalConfigError(f"--method {method!r}: {err}") from None
        out += plan
    out += [config_setting(path) for path in cfg.configs]
    if cfg.subtitles not in SUBTITLES:
        raise EvalConfigError(f"subtitles must be one of {', '.join(SUBTITLES)}, got {cfg.subtitles!r}")
    if cfg.subtitles != "without" and cfg.dataset != "videomme":
        raise EvalConfigError(f"--subtitles {cfg.subtitles} applies to --dataset videomme only, not {cfg.dataset}")
    with_subs = [replace(st, subtitles=True) for st in out]
    return {"without": out, "with": with_subs, "both": [x for pair in zip(out, with_subs) for x in pair]}[cfg.subtitles]


def config_setting(path: str) -> Setting:
    """The setting of a config file (``--config``), validated now."""
    from vlm_prune.config import ConfigError, load_config

    try:
        pc = load_config(path)
    except ConfigError as err:
        raise EvalConfigError(f"--{err}") from None
    return Setting(pc.pipeline, keep=pc.keep, budget=pc.budget, config=pc.to_json())


def wrap_setting(model: torch.nn.Module, setting: Setting, processor: Any, seed: int = 0) -> None:
    """wrap() ``model`` for ``setting`` (a config's setting with its own seed)."""
    if setting.config is not None:
        vlm_prune.wrap(model, config=json.loads(setting.config), processor=processor)
    else:
        vlm_prune.wrap(model, setting.method.split("+"), keep=setting.keep, budget=setting.budget,
                       processor=processor, seed=seed)


def spread(samples: list[Sample], limit: int | None) -> list[Sample]:
    """``limit`` questions spread evenly over the dataset (so every task of MVBench / MLVU is
    represented), in file order; all of them without a limit."""
    if limit is None or limit >= len(samples):
        return samples
    if limit < 1:
        raise EvalConfigError(f"--limit must be at least 1, got {limit}")
    return [samples[i] for i in np.unique(np.round(np.linspace(0, len(samples) - 1, limit)).astype(np.int64))]


def check_family(cfg: EvalConfig, plan: list[Setting]) -> None:
    """Before the model loads: its class (config.json ``architectures``) has an adapter, and every
    method of the plan runs on that family (``Method.refusal``, the rule wrap() applies)."""
    from transformers import AutoConfig

    from vlm_prune.adapters import FAMILY_STAGES, family_of, supported_model_classes
    from vlm_prune.registry import method_class

    try:
        architectures = AutoConfig.from_pretrained(cfg.model).architectures or []
    except (OSError, ValueError) as err:
        raise EvalConfigError(cannot_load(cfg.model, err)) from None
    family = next(filter(None, map(family_of, architectures)), None)
    if family is None:
        raise EvalConfigError(f"--model {cfg.model} is a {', '.join(architectures) or 'model of no stated class'}; "
                              f"vlm_prune supports {', '.join(supported_model_classes())}")
    for setting in plan:
        for name in setting.method.split("+") if setting.method != "none" else []:
            refusal = method_class(name).refusal(family, FAMILY_STAGES[family])
            if refusal:
                raise EvalConfigError(f"--method {setting.method}: {refusal}")


def check_settings(model: torch.nn.Module, plan: list[Setting], processor: Any, seed: int = 0) -> None:
    """wrap() and unwrap the model with every setting once, so that a method the model cannot run
    (an unsupported model class, a stage its family lacks) stops the run before any question."""
    for setting in plan:
        if setting.method == "none":
            continue
        try:
            wrap_setting(model, setting, processor, seed)
        except (ValueError, TypeError) as err:
            raise EvalConfigError(f"--method {setting.method}: {err}") from None
        vlm_prune.unwrap(model)


def _on_cuda(cfg: EvalConfig) -> bool:
    """Whether the model goes to a GPU; refuses a GPU placement torch cannot serve."""
    available = torch.cuda.is_available()
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise EvalConfigError(f"--device takes auto, cpu or cuda, got {cfg.device!r}")
    if cfg.device_map:
        wants = str(cfg.device_map)
        if not available and (wants.startswith("cuda") or wants.isdigit()):
            raise EvalConfigError(f"--device-map {wants}: no CUDA device is visible to torch; use --device cpu "
                                  "(or --device-map auto)")
        return available and wants != "cpu"
    if cfg.device == "cuda" and not available:
        raise EvalConfigError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return available and cfg.device != "cpu"


def load_model(cfg: EvalConfig, dist: sharding.Dist) -> tuple[torch.nn.Module, Any]:
    """(model, processor) from a hub id or local folder; one device per rank, or device_map."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cuda = _on_cuda(cfg)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        processor = AutoProcessor.from_pretrained(cfg.model)
        model = AutoModelForImageTextToText.from_pretrained(cfg.model, **kwargs)
    except (OSError, ValueError, ImportError) as err:  # not found / downloadable, not image-text-to-text, a missing package
        raise EvalConfigError(cannot_load(cfg.model, err)) from None
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
            raise EvalConfigError(
                f"{run_dir} holds results of a different configuration (differs in {', '.join(diff)}); "
                "use another --out folder or delete that one"
            )
        return
    os.makedirs(run_dir, exist_ok=True)
    tmp = f"{path}.rank{dist.rank}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(identity, f, indent=1)
    os.replace(tmp, path)


def _base_record(sample: Sample, status: str) -> dict[str, Any]:
    return {"id": sample.id, "status": status, "categories": sample.categories, "answer": sample.answer}


def _answered(sample: Sample, gen: Generation, visuals: Visuals, first_use: bool, wait_s: float,
              device: torch.device) -> dict[str, Any]:
    pred, correct = score(sample, gen.text)
    rec = {**_base_record(sample, "ok"), "output": gen.text, "pred": pred, "correct": correct}
    rec.update({k: v for k, v in asdict(gen).items() if k != "text"})
    rec.update({"decode_s": visuals.decode_s if first_use else 0.0, "decode_wait_s": wait_s,
                "peak_memory_bytes": metrics.peak_memory_bytes(device)})
    if visuals.warnings:
        rec["warnings"] = visuals.warnings
    if visuals.truncated:  # scored on the frames that decode; the summary counts these
        rec["truncated"] = visuals.truncated
    return rec


def _failed(sample: Sample, err: BaseException, stage: str) -> dict[str, Any]:
    """The record of a question that raised: kept with its error, left out of the accuracy,
    tried again on the next run."""
    message = f"{type(err).__name__}: {err}"
    return {**_base_record(sample, "failed"), "correct": False, "stage": stage, "error": message[:2000]}


def skipped_record(sample: Sample, reason: str) -> dict[str, Any]:
    return {**_base_record(sample, "skipped"), "correct": False, "reason": reason}


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Tally:
    """Progress-bar text: answered / failed so far and the running accuracy of each setting."""

    def __init__(self, names: list[str], done: dict[str, dict[str, dict[str, Any]]]) -> None:
        self.ok = {n: [bool(r.get("correct")) for r in done[n].values() if not sharding.is_failed(r)] for n in names}
        self.failed = 0

    def add(self, name: str, rec: dict[str, Any]) -> None:
        if rec["status"] == "ok":
            self.ok[name].append(bool(rec["correct"]))
        else:
            self.failed += 1

    def text(self) -> str:
        accs = [f"{sum(v) / len(v):.3f}" for v in self.ok.values() if v]
        return f"acc {'/'.join(accs) or '-'}" + (f" failed {self.failed}" if self.failed else "")


def evaluate_samples(
    model: torch.nn.Module, processor: Any, plan: list[Setting], samples: list[Sample],
    run_dirs: dict[str, str], cfg: EvalConfig, dist: sharding.Dist,
) -> None:
    """Answer this rank's questions under every setting of ``plan``, question by question.

    Each question's video is decoded once (in the background, ahead of the model) and answered
    under each setting whose folder lacks an answer to it; the model is wrapped for that
    setting and unwrapped after. An exception on one question (a broken video, out of memory)
    is recorded as that question's failure and the run goes on.
    """
    mine = sharding.shard(samples, dist, key=lambda s: tuple(s.media))
    done = {st.name: sharding.read_records(run_dirs[st.name]) for st in plan}
    pending = {s.id: [st for st in plan if s.id not in done[st.name] or sharding.is_failed(done[st.name][s.id])]
               for s in mine}
    todo = [s for s in mine if pending[s.id]]
    device = next(model.parameters()).device
    predictor = Predictor(model, processor, cfg.max_new_tokens)
    metrics.reset_peak_memory(device)
    prefetch = Prefetcher(todo, cfg.frames, cfg.decode_timeout, workers=cfg.decode_workers,
                          ahead=2 * max(1, cfg.decode_workers)) if cfg.decode_workers > 0 else None
    tally = _Tally([st.name for st in plan], done)
    label = "eval" if dist.world_size == 1 else f"eval [rank {dist.rank}]"
    writers = {st.name: sharding.RankWriter(run_dirs[st.name], dist) for st in plan}
    try:
        with tqdm(total=len(mine), initial=len(mine) - len(todo), desc=label, position=dist.rank,
                  dynamic_ncols=True) as bar:
            for sample in todo:
                start = time.perf_counter()
                try:
                    if prefetch is not None:
                        visuals, first_use = prefetch.get(sample)
                    else:
                        visuals, first_use = load_visuals(sample, cfg.frames, cfg.decode_timeout), True
                except Exception as err:  # noqa: BLE001 - one broken video must not stop the run
                    visuals, error = None, err
                wait_s = time.perf_counter() - start
                for setting in pending[sample.id]:
                    if visuals is None:
                        rec = _failed(sample, error, "decode")
                    else:
                        rec = _answer(predictor, sample, setting, visuals, first_use, wait_s, cfg, processor)
                        first_use = False
                    writers[setting.name].write(rec)
                    tally.add(setting.name, rec)
                bar.update(1)
                bar.set_postfix_str(tally.text())
    finally:
        for w in writers.values():
            w.close()


def _answer(predictor: Predictor, sample: Sample, setting: Setting, visuals: Visuals, first_use: bool,
            wait_s: float, cfg: EvalConfig, processor: Any) -> dict[str, Any]:
    """One question under one setting: wrap, generate, unwrap; an exception becomes the record."""
    model = predictor.model
    try:
        if setting.method != "none":
            wrap_setting(model, setting, processor, cfg.seed)
        try:
            gen = predictor.generate(format_prompt(sample, _subtitles(sample, visuals) if setting.subtitles else None),
                                     visuals.items, sample.media_type, times=visuals.times)
        finally:
            if setting.method != "none":
                vlm_prune.unwrap(model)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory on one long video: record, go on
        _free_memory(predictor.device)
        return _failed(sample, err, "model")
    return _answered(sample, gen, visuals, first_use, wait_s, predictor.device)


def _subtitles(sample: Sample, visuals: Visuals) -> str:
    """Video-MME's subtitle text for as many frames as the model sees, as lmms-eval writes it
    (:func:`subtitles_at`): "" when no cue is on screen then, "No subtitles available" without an
    .srt file (or for a folder of frames, which has no frame rate)."""
    if sample.subtitles is None or visuals.times is None or not visuals.n_frames or not visuals.fps:
        return NO_SUBTITLES
    return subtitles_at(read_srt(sample.subtitles), visuals.n_frames, visuals.fps, len(visuals.times))


def merge_setting(run_dir: str, questions: list[Sample], skipped: dict[str, str], dataset: str,
                  timeout_min: float | None = sharding.SYNC_TIMEOUT_MIN) -> dict[str, Any]:
    """Rank 0: every question's record in dataset order (answered, failed, or skipped with its
    reason; answered ones with lmms-eval's reading of the output, :func:`leaderboard.annotate`)
    into results.jsonl, and the setting's summary into summary.json."""
    records = sharding.wait_for(run_dir, [s.id for s in questions if s.id not in skipped], log=tqdm.write,
                                timeout_min=timeout_min)
    merged = [skipped_record(s, skipped[s.id]) if s.id in skipped else records[s.id] for s in questions]
    leaderboard.annotate(dataset, merged, {s.id: s for s in questions})
    sharding.write_merged(run_dir, merged)
    summary = metrics.summarize(merged, dataset)
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def run_eval(
    cfg: EvalConfig, model: torch.nn.Module | None = None, processor: Any = None,
) -> list[dict[str, Any]] | None:
    """Run every setting of ``cfg``; rank 0 returns one summary row per setting (others None).

    model / processor: already loaded objects (tests, notebooks); loaded from ``cfg.model`` if None.
    Every question of the dataset (or of ``--limit``) ends up in each setting's results.jsonl as
    answered, failed (with its error; retried on the next run) or skipped (missing media, with
    ``skip_missing``); the accuracy counts the answered ones and the summaries say how many of
    each there are, and why.
    """
    from vlm_prune.eval.plots import short_name, write_sweep

    dist = sharding.current()
    if cfg.sync_timeout_min <= 0:
        raise ValueError(f"sync_timeout_min (--sync-timeout) must be > 0 minutes, got {cfg.sync_timeout_min}")
    sharding.exit_with_launcher(dist)
    _on_cuda(cfg)  # a device torch cannot serve is refused before the dataset is read
    plan = settings(cfg)
    questions = spread(read_samples(cfg.dataset, cfg.data, split=cfg.split), cfg.limit)
    present, missing = split_missing(questions)
    if missing and not cfg.skip_missing:
        raise missing_media_error(cfg.dataset, len(questions), missing)
    skipped = {s.id: reason for s, reason in missing}
    if missing and dist.is_main:
        tqdm.write(f"skipping {len(missing)} of {len(questions)} questions whose media is missing "
                   f"(--skip-missing), first: {missing[0][1]}")
    if model is None:
        check_family(cfg, plan)
        model, processor = load_model(cfg, dist)
    if processor is None:
        raise ValueError("run_eval needs the model's processor when a model object is given")
    check_settings(model, plan, processor, cfg.seed)
    run_dirs = {}
    for setting in plan:
        run_dirs[setting.name] = os.path.join(cfg.out, setting.name)
        identity = {"model": cfg.model, "dataset": cfg.dataset, "data": os.path.abspath(cfg.data),
                    "split": cfg.split, "frames": cfg.frames, "max_new_tokens": cfg.max_new_tokens,
                    "seed": cfg.seed, "prompt": prompt_style(cfg.dataset),
                    **{k: v for k, v in asdict(setting).items() if k != "config" or v is not None}}
        _check_run_dir(run_dirs[setting.name], identity, dist)
    evaluate_samples(model, processor, plan, present, run_dirs, cfg, dist)
    sharding.barrier(dist, cfg.sync_timeout_min)
    if not dist.is_main:
        return None
    rows = [{"name": st.name, **asdict(st), **merge_setting(run_dirs[st.name], questions, skipped, cfg.dataset,
                                                    cfg.sync_timeout_min)}
            for st in plan]
    write_sweep(rows, cfg.out, title=f"{short_name(cfg.model)} on {cfg.dataset}")
    return rows
