"""Frames-stage methods (``uniform``, ``keyscore``, ``vidcom2``, ``fastvid``, ``holitom``, ``dycoke``; ``quota``
in two passes) inside vLLM, for any video model of the plugin.

vLLM fixes a video's placeholder count when it processes the prompt, before the tower runs. The
frames methods that choose WHICH frames to keep from the video's features, but keep a count fixed
by the budget alone, fit that as the vision methods do (docs/design/vllm-plugin.md, "Frames methods"):

- :func:`frames_slots` (processor): the visual tokens the method keeps of a T x N video, the
  same number ``wrap()`` keeps: ``n_total = method.n_keep(T * N)``, whole frames
  ``min(T, n_total // N)`` of N tokens each, or, below one frame, ``n_total`` tokens of one frame.
- :func:`frames_reduction` (encoder): the method object's own ``allocate`` on the video's
  [T, N, D] frame maps (the model's features, as ``wrap()`` hands them), checked against the slots.
- :func:`uniform_frames` (processor): uniform needs no features, so the plugin decodes only the
  kept frames (the tower never sees the others); :func:`uniform_frames` names them.
- vidcom2, fastvid, holitom keep exactly ``n_total`` tokens (:data:`EXACT_TOTAL`), spread over the
  frames by their features; dycoke's counts follow from the budget and the shape (:data:`SHAPE_COUNTED`:
  its plan on zero features counts them).

QuoTA's count depends on its frame scores (each frame's share of the budget truncated, maps capped),
which the unpruned model computes from the video, so it runs as a two-pass request through the same
engine (:func:`quota_request`). Pass 1 asks the engine, unpruned, QuoTA's question about each frame
(on Qwen2-VL / 2.5 each temporal slice of two frames, as wrap()) as a one-frame (one-slice) video
request whose map the encoder resizes to ``score_grid`` as wrap()'s scorer does, and reads P(answer)
from the prompt log-probabilities, optionally after the query decoupling (greedy, text only). Pass 2
is the user's request with the scores in its spec, from which the processor computes the slot count
and the encoder the plan (``quota_plan`` on the unpooled maps, or the frame maps where there are none).
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from vlm_prune.methods.base import FramesContext, FramesPlan, Method, Reduction
from vlm_prune.vllm.config import (
    FRAMES_SUPPORTED,  # (the frames methods served in one pass)
)

#: frames methods that keep exactly the video budget's tokens (spread over the frames by their features)
EXACT_TOTAL = ("vidcom2", "fastvid", "holitom")
#: frames methods whose count per frame follows from the budget and the video's shape alone (DyCoke: its
#: pivot frames whole, the compared frames share the rest): the processor runs their plan on zero features
SHAPE_COUNTED = ("dycoke",)
#: the spec's key for QuoTA's passes: {"phase": "score", "grid": [r, c]} or {"scores": [p_t, ...]}
QUOTA_KEY = "quota"

QUOTA_REFUSAL = (
    "QuoTA's token count per video follows its frame scores, which the unpruned model computes from the video "
    "before vLLM can fix the video's placeholder count: send each QuoTA request through "
    "vlm_prune.vllm.quota_request(llm, request, method, keep=...) (pass 1 scores the frames in the same engine, "
    "the request it returns carries the scores), not as the engine's default method or a bare request_kwargs"
)


def check_frames_method(method: Method) -> None:
    """Refuse frames methods the plugin cannot serve (QuoTA passes through :func:`quota_request`)."""
    if method.name == "quota":
        if getattr(method, "_scorer", None) is not None:
            raise ValueError("QuoTA with a custom scorer is not served by vlm_prune.vllm (it needs the processor's "
                             "pixels on the client); its default scorer, the served model itself, is")
        return
    if method.name not in FRAMES_SUPPORTED:
        raise ValueError(f"frames method {method.name!r} is not wired into vLLM; supported: {', '.join(FRAMES_SUPPORTED)}")
    if getattr(method, "decode_kv", False):
        raise ValueError(f"{method.name}'s decode-time KV pruning (decode_pruning=True) changes which cached keys each "
                         "decode step attends to, which vLLM's paged attention (every key of a request in every step) "
                         f"cannot follow; in vLLM use {method.name} with decode_pruning=False (its frames stage), or "
                         "vlm_prune.wrap() on the Hugging Face model")
    if method.name == "fastvid" and not method.top_up:
        raise ValueError("fastvid top_up=False keeps the official counts, which fall short of the budget by an amount "
                         "the video's content decides, but vLLM fixes each video's placeholder slots before the "
                         "encoder: use top_up=True (exactly the budget), or vlm_prune.wrap()")
    if method.name == "keyscore" and getattr(method, "_encoder", None) is not None:
        raise ValueError("keyscore with a custom encoder is not served by vlm_prune.vllm (the encoder object cannot "
                         "travel to vLLM's processes); use its default in-model embeddings (encoder=None)")


def frames_slots(method: Method, frames: int, per_frame: int, spec: dict[str, Any] | None = None,
                 unpooled_grid: tuple[int, int] | None = None, grid: tuple[int, int] | None = None) -> int:
    """Visual tokens a frames method keeps of a ``frames`` x ``per_frame`` video (what wrap() keeps).
    QuoTA: from the frame scores in ``spec`` (pass 2 of :func:`quota_request`); ``grid``: the frame
    map's (rows, cols) (default: square), which QuoTA's v2 / v5 caps depend on (Qwen's maps are not square)."""
    check_frames_method(method)
    n_total = method.n_keep(frames * per_frame, 1)
    if method.name == "quota":
        if n_total >= frames * per_frame:  # keep=1.0: nothing scored, nothing changed (as allocate)
            return frames * per_frame
        scores = (spec or {}).get(QUOTA_KEY, {}).get("scores")
        if scores is None:
            raise ValueError(QUOTA_REFUSAL)
        if len(scores) != frames:
            from vlm_prune.vllm.config import SPEC_FIELD

            raise ValueError(f"{SPEC_FIELD}.quota.scores: {len(scores)} scores for a video of {frames} frames (temporal "
                             "slices on Qwen2-VL); send the request vlm_prune.vllm.quota_request built for this video")
        if method.wants_unpooled and unpooled_grid is not None:
            grid = unpooled_grid
        elif grid is None:
            side = math.isqrt(per_frame)
            grid = (side, per_frame // side)
        from vlm_prune.frames.quota import quota_plan

        plan = quota_plan(torch.zeros(frames, grid[0] * grid[1], 1), grid, n_total,
                          torch.tensor(scores, dtype=torch.float32), method.variant, method.weight_scale,
                          method.weight_power, slots=frames * per_frame)
        return plan.reduction.indices.numel()
    if method.name in EXACT_TOTAL:
        return min(n_total, frames * per_frame)
    if method.name in SHAPE_COUNTED:
        ctx = FramesContext(features=torch.zeros(frames, per_frame, 1), grid=grid, n_total=n_total)
        return method.allocate(ctx).reduction.indices.numel()
    whole = min(frames, n_total // per_frame)
    return whole * per_frame if whole >= 1 else n_total


def uniform_frames(method: Method, frames: int, per_frame: int) -> list[int] | None:
    """The frames uniform keeps whole (ascending), or None when it keeps part of one frame
    (a budget below one frame: the tower then runs on every frame and the plan picks the tokens)."""
    from vlm_prune.frames.uniform import uniform_indices

    n_total = method.n_keep(frames * per_frame, 1)
    n_frames = n_total // per_frame
    return uniform_indices(frames, n_frames) if n_frames >= 1 else None


def frames_reduction(method: Method, features: torch.Tensor, grid: tuple[int, int], *,
                     text_features: torch.Tensor | None = None, pixels: torch.Tensor | None = None,
                     spec: dict[str, Any] | None = None, unpooled: torch.Tensor | None = None,
                     unpooled_grid: tuple[int, int] | None = None, tower_attention: Any = None) -> Reduction:
    """:func:`frames_plan`'s reduction."""
    return frames_plan(method, features, grid, text_features=text_features, pixels=pixels, spec=spec,
                       unpooled=unpooled, unpooled_grid=unpooled_grid, tower_attention=tower_attention).reduction


def frames_plan(method: Method, features: torch.Tensor, grid: tuple[int, int], *,
                text_features: torch.Tensor | None = None, pixels: torch.Tensor | None = None,
                spec: dict[str, Any] | None = None, unpooled: torch.Tensor | None = None,
                unpooled_grid: tuple[int, int] | None = None, tower_attention: Any = None) -> FramesPlan:
    """The method's reduction of one video's [T, N, D] frame maps (indices into its T * N rows),
    from the same FramesContext wrap() builds (features, grid, the video budget, the question's
    input embeddings, the processor's pixels; ``tower_attention(frame)``: the tower's (attention, keys)
    of a frame for FastVID / HoliTom); its size must equal :func:`frames_slots`.
    QuoTA: ``quota_plan`` with the scores of pass 1 on the unpooled maps [T, M, D] (v1/v2/v3/v5) or
    the frame maps (v4), as QuoTA.allocate."""
    t, n, _ = features.shape
    n_total = method.n_keep(t * n, 1)
    with torch.no_grad():
        if method.name == "quota" and n_total < t * n:
            from vlm_prune.frames.quota import quota_plan

            scores = torch.tensor((spec or {}).get(QUOTA_KEY, {}).get("scores"), dtype=torch.float32)
            feats, g = (unpooled, unpooled_grid) if method.wants_unpooled and unpooled is not None else (features, grid)
            plan = quota_plan(feats, g, n_total, scores, method.variant, method.weight_scale, method.weight_power,
                              slots=t * n)
        else:
            ctx = FramesContext(features=features, grid=grid, n_total=n_total, text_features=text_features, pixels=pixels,
                                tower_attention=tower_attention)
            plan = method.allocate(ctx)
    red = plan.reduction
    want = frames_slots(method, t, n, spec, unpooled_grid, grid)
    if red.indices.numel() != want:
        raise RuntimeError(f"vlm_prune: {method.name} kept {red.indices.numel()} tokens of the video, its slots are {want}")
    if red.sizes is not None:
        raise ValueError(f"frames method {method.name!r} merges tokens with sizes, which vLLM's attention cannot weight")
    return plan


def is_frames(method: Any) -> bool:
    return getattr(method, "stage", None) == "frames"


def quota_phase(spec: dict[str, Any] | None) -> str | None:
    """"score" for pass 1's frame requests, "plan" for pass 2, None otherwise."""
    q = (spec or {}).get(QUOTA_KEY) or {}
    return "score" if q.get("phase") == "score" else "plan" if "scores" in q else None


def strip_quota(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without QuoTA's per-request data (the method object is built once per configuration)."""
    return {k: v for k, v in spec.items() if k != QUOTA_KEY}


# ---- QuoTA: pass 1 through the same engine -----------------------------------------------------------
def quota_request(llm: Any, request: dict[str, Any], method: Any = "quota", *, keep: float | None = None,
                  budget: int | None = None, seed: int = 0, processor: Any = None) -> dict[str, Any]:
    """Pass 1 of QuoTA (arXiv 2503.08689) for one video request, through ``llm`` itself; returns the
    request for pass 2 (``llm.generate(returned_request, params)``), whose spec carries the scores.

    As wrap()'s QuoTA with its default scorer (the served model, unpruned): the question is the
    prompt's text after its last image / video (chat template's assistant prefix dropped); with
    ``decouple`` the model first answers the decoupling prompt (greedy, text only, cut where the
    answer first parses, at most min(4096, room) new tokens); then each frame is asked the frame
    prompt as a one-frame video request whose map the encoder resizes to at most ``score_grid``,
    and the frame's score is P(answer) (P(answer) / (P(answer) + P(versus)) with two tokens), read
    as the log-probability of the answer token appended to the prompt. ``method``: "quota" or a
    configured ``QuoTA`` (its ``objects`` callable and ``prompts`` act here, on the client).
    ``processor``: the checkpoint's processor (chat template); loaded from the model folder if None.
    ``llm`` may also be a :class:`vlm_prune.vllm.quota_client.QuotaClient` (an OpenAI-compatible
    server; ``request`` is then a /v1/chat/completions body): the same passes over HTTP.
    """
    from vlm_prune.vllm.quota_client import QuotaClient

    if isinstance(llm, QuotaClient):
        return llm.quota_request(request, method, keep=keep, budget=budget, seed=seed)
    video = (request.get("multi_modal_data") or {}).get("video")
    if video is None:
        raise ValueError("quota_request needs a request with one video in multi_modal_data['video']")
    engine = OfflineEngine(llm, video)
    processor = processor if processor is not None else load_processor(engine.model_path)
    question = question_text(request, processor, engine.hf_config)
    frames = video[0] if isinstance(video, tuple) else video
    out = dict(request)
    out["mm_processor_kwargs"] = quota_kwargs(engine, frames, question, method, keep=keep, budget=budget, seed=seed,
                                              processor=processor)
    return out


class OfflineEngine:
    """QuoTA's pass 1 through an offline ``vllm.LLM`` (one request's video); the HTTP twin is
    :class:`vlm_prune.vllm.quota_client.HttpEngine`. Both answer :func:`quota_kwargs`'s two questions."""

    def __init__(self, llm: Any, video: Any):
        mc = llm.llm_engine.model_config
        self.llm, self.video = llm, video
        self.hf_config, self.model_path, self.max_model_len = mc.hf_config, mc.model, mc.max_model_len

    def generate(self, ids: list[int], limit: int) -> list[int]:
        """Greedy continuation of the text-only prompt ``ids`` (at most ``limit`` tokens)."""
        from vllm import SamplingParams

        return list(self.llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=limit),
                                      use_tqdm=False)[0].outputs[0].token_ids)

    def answer_logprobs(self, prompt: str, ids: list[int], answers: list[tuple[str, int]], units: list[list[int]],
                        kwargs: dict[str, Any]) -> list[float]:
        """log P(answer | frame prompt) for each unit (frames of the video) and answer (word, token id), unit
        by unit: the prompt ``ids`` (the chat of ``prompt`` after one video placeholder, ending with the
        generation prompt) followed by the answer's token, the video cut to the unit, ``kwargs`` its
        mm_processor_kwargs; the answer's log-probability is the prompt's last."""
        from vllm import SamplingParams

        reqs = [{"prompt_token_ids": ids + [target], "multi_modal_data": {"video": _frames(self.video, unit)},
                 "mm_processor_kwargs": kwargs} for unit in units for _, target in answers]
        res = self.llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return [r.prompt_logprobs[-1][r.prompt_token_ids[-1]].logprob for r in res]


def load_processor(model_path: Any) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_path)


def video_model(hf_config: Any) -> dict[str, Any]:
    """:data:`VIDEO_MODELS`' entry of a config (the plugin's architecture or the checkpoint's)."""
    from vlm_prune.vllm.config import ARCHITECTURES

    arch = hf_config.architectures[0]
    info = VIDEO_MODELS.get(ARCHITECTURES.get(arch, arch))
    if info is None:
        raise ValueError(f"quota_request serves the video models {', '.join(VIDEO_MODELS)}; got {arch}")
    return info


def quota_kwargs(engine: Any, frames: Any, question: str, method: Any = "quota", *, keep: float | None = None,
                 budget: int | None = None, seed: int = 0, processor: Any = None) -> dict[str, Any]:
    """QuoTA's pass 1 (see :func:`quota_request`) through ``engine`` (:class:`OfflineEngine` or the HTTP
    client's engine): the pass-2 request's ``mm_processor_kwargs``, its spec carrying the frame scores.
    ``frames``: the video's frames (their count; on Qwen the first slice's grid), ``question``: the text
    :func:`question_text` reads from the request."""
    from vlm_prune.frames.quota import DECOUPLE_MAX_NEW_TOKENS, QuoTA
    from vlm_prune.frames.scorers import vocab_id
    from vlm_prune.vllm.config import build_method, method_spec

    spec = method_spec(method, keep=keep, budget=budget, seed=seed)
    q = build_method({**spec, "method": method}) if isinstance(method, QuoTA) else build_method(spec)
    if not isinstance(q, QuoTA):
        raise ValueError(f"quota_request serves QuoTA; got {spec['method']!r} (send other methods directly)")
    hf_config = engine.hf_config
    info = video_model(hf_config)
    tok = getattr(processor, "tokenizer", processor)
    group = info.get("group", lambda cfg: 1)(hf_config)  # frames per scored unit (Qwen: a slice)
    t, per_frame = -(-len(frames) // group), info["frame_tokens"](hf_config, processor, frames)

    def with_spec(extra: dict[str, Any] | None) -> dict[str, Any]:
        return {"vlm_prune": json.dumps({**spec, **({QUOTA_KEY: extra} if extra else {})}, sort_keys=True)}

    if q.n_keep(t * per_frame, 1) >= t * per_frame:
        return with_spec(None)
    if not question:
        return with_spec({"scores": [1.0] * t})  # no question: every frame alike (as QuoTA.frame_scores)
    room = getattr(hf_config.get_text_config(), "max_position_embeddings", None)

    def generate_text(prompt: str, done: Any = None, max_new_tokens: int = DECOUPLE_MAX_NEW_TOKENS) -> str:
        ids = _chat_ids(processor, tok, prompt, None)
        limit = max(1, min(max_new_tokens, room - len(ids))) if room else max_new_tokens
        # the engine's max_model_len bounds it too (below the model's max positions wrap() may generate longer)
        limit = max(1, min(limit, engine.max_model_len - len(ids)))
        res = engine.generate(ids, limit)
        for k in range(1, len(res) + 1):  # generate() stops at the first step where the answer parses
            text = tok.decode(res[:k], skip_special_tokens=True)
            if done is not None and done(text):
                return text
        return tok.decode(res, skip_special_tokens=True)

    ctx = FramesContext(features=torch.zeros(t, 1, 1), grid=(1, 1), n_total=1, query=question,
                        generate_text=generate_text)
    prompt = q.scoring_prompt(ctx)
    ids = _chat_ids(processor, tok, prompt, info["placeholder"](processor))
    answers = [(w, vocab_id(tok, w)) for w in q._prompts.tokens]
    grid = list(q.score_grid) if q.score_grid is not None else None
    units = [list(range(f * group, min((f + 1) * group, len(frames)))) for f in range(t)]
    logprobs = engine.answer_logprobs(prompt, ids, answers, units, with_spec({"phase": "score", "grid": grid}))
    probs = torch.tensor([math.exp(lp) for lp in logprobs], dtype=torch.float32).reshape(t, len(answers))
    return with_spec({"scores": q._prompts.score(probs).tolist()})


def _frames(video: Any, keep: list[int]) -> Any:
    if isinstance(video, tuple):  # (frames, metadata): the metadata of the frames kept
        meta = video[1]
        if isinstance(meta, dict) and "total_num_frames" in meta:
            meta = {**meta, "total_num_frames": len(keep), "frames_indices": list(range(len(keep)))}
            if meta.get("fps"):
                meta["duration"] = len(keep) / meta["fps"]
        return _frames(video[0], keep), meta
    return video[keep] if hasattr(video, "shape") else [video[i] for i in keep]


def _chat_ids(processor: Any, tok: Any, prompt: str, placeholder: str | None) -> list[int]:
    """One user turn in the processor's chat template ending with the assistant prefix (as wrap()'s
    chat_ids), the media as one placeholder token (vLLM expands it)."""
    content = ([{"type": "video"}] if placeholder else []) + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def question_text(request: dict[str, Any], processor: Any, hf_config: Any) -> str:
    """The prompt's text after its last image / video (``request``'s "prompt_token_ids" or "prompt"),
    without the chat template's assistant prefix, decoded as wrap() decodes it for QuoTA."""
    from vlm_prune.vllm.llava import question_ids

    tok = getattr(processor, "tokenizer", processor)
    ids = request.get("prompt_token_ids")
    if ids is None:
        ids = tok(request["prompt"]).input_ids
    media = {getattr(hf_config, k, None) for k in ("image_token_index", "video_token_index", "image_token_id",
                                                 "video_token_id")} - {None}
    last = max((i for i, x in enumerate(ids) if x in media), default=-1)
    suffix: list[int] = []
    mark = "QQQ"
    try:
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": mark}]}],
                                             add_generation_prompt=True, tokenize=False)
        if mark in text:
            suffix = tok(text[text.rindex(mark) + len(mark):], add_special_tokens=False).input_ids
    except Exception:  # a template that needs other fields: keep the text as it is
        pass
    return tok.decode(question_ids(list(ids), [(last, 1)], suffix), skip_special_tokens=True).strip()


def _pooled_frame_tokens(hf_config: Any, processor: Any, frames: Any) -> int:
    """Tokens of a frame pooled by ``spatial_pool_stride`` (LLaVA-NeXT-Video; OneVision: 2, bilinear)."""
    vc = hf_config.vision_config
    return math.ceil((vc.image_size // vc.patch_size) / getattr(hf_config, "spatial_pool_stride", 2)) ** 2


def _qwen_slice_tokens(hf_config: Any, processor: Any, frames: Any) -> int:
    """Merged tokens of one temporal slice of this video (from its grid in the model's video processor)."""
    first = frames[: hf_config.vision_config.temporal_patch_size]
    grid = processor.video_processor(videos=[np.asarray(first) if not hasattr(first, "shape") else first],
                                     do_sample_frames=False, return_tensors="pt")["video_grid_thw"][0]
    merge = hf_config.vision_config.spatial_merge_size
    return int(grid[1]) // merge * (int(grid[2]) // merge)


def _qwen_video_model() -> dict[str, Any]:
    return {"frame_tokens": _qwen_slice_tokens, "placeholder": lambda processor: "<|video_pad|>",
            "group": lambda cfg: cfg.vision_config.temporal_patch_size}


#: video models quota_request knows: tokens per frame, the video placeholder text
VIDEO_MODELS: dict[str, dict[str, Any]] = {
    **{arch: {"frame_tokens": _pooled_frame_tokens,
              "placeholder": lambda processor: getattr(processor, "video_token", "<video>")}
       for arch in ("VlmPruneLlavaOnevisionForConditionalGeneration", "VlmPruneLlavaNextVideoForConditionalGeneration")},
    # a scored unit is a temporal slice (two frames), as wrap()'s QuoTA on Qwen: group frames per request
    "VlmPruneQwen2VLForConditionalGeneration": _qwen_video_model(),
    "VlmPruneQwen2_5_VLForConditionalGeneration": _qwen_video_model(),
}
