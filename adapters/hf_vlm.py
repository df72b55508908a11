"""Shared machinery of the Hugging Face VLM adapters (LLaVA family, Qwen2-VL family).

Data flow for one prefill:
1. the inner model's ``forward`` (LlavaModel, Qwen2VLModel, ...) is wrapped: it records which
   rows of ``input_ids`` are visual placeholders (a :class:`Pending` for the engine);
2. the feature function (``get_image_features`` / ``get_video_features``) is wrapped: it runs
   the model's own tower and projector, then the vision / frames method on each image;
   reduced tokens are written back into their slots, dropped slots are marked;
3. the language model's ``forward`` is the engine (:class:`PrunedDecoder`), which removes the
   dropped rows before layer 0 (keeping original position ids, or renumbering them when the
   vision method's official code feeds the LLM a shorter sequence: ``renumber_positions``) and
   runs the llm stage.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import itertools
import math
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, ClassVar

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_prune.adapters.base import Adapter, ContextSlot
from vlm_prune.adapters.vision_towers import FeatureLayerTap, pool_grid
from vlm_prune.engine import LMSpec, Pending, PrunedDecoder
from vlm_prune.methods.base import (BudgetWarning, FramesContext, FramesPlan, Reduction, VisionContext, apportion,
                                    item_generator)


@dataclass
class Item:
    """One image or video in an encoder output: ``frames`` frames of ``grid`` tokens each,
    followed by ``tail`` tokens that are always kept (LLaVA-OneVision's video newline)."""

    features: torch.Tensor
    frames: int
    grid: tuple[int, int] | None
    tail: int = 0


@dataclass
class Piece:
    """Rows ``start .. start + length`` of an item's tokens that a vision method reduces on their own
    (one frame) to ``n_keep`` tokens; ``grid`` and ``tower_attention`` as in ``VisionContext``."""

    start: int
    length: int
    n_keep: int
    grid: tuple[int, int] | None = None
    tower_attention: Callable[[], tuple[torch.Tensor, ...]] | None = None


def coords_grid(coords: torch.Tensor) -> tuple[int, int] | None:
    """(rows, cols) when the (row, col) ``coords`` [K, 2] of a frame's tokens fill a grid in
    row-major order (a resized frame map), else None."""
    if coords.numel() == 0:
        return None
    rows, cols = int(coords[:, 0].max()) + 1, int(coords[:, 1].max()) + 1
    if rows * cols != coords.shape[0]:
        return None
    k = torch.arange(rows * cols, device=coords.device)
    return (rows, cols) if torch.equal(coords[:, 0] * cols + coords[:, 1], k) else None


@dataclass
class Request:
    """One prefill of the wrapped model: its inputs and what the stages learnt about it.

    It lives in a :class:`ContextSlot` for the length of the model's forward, so every thread
    calling the model has its own, and nothing of it survives the call (not even a failed one).
    """

    input_ids: torch.Tensor  # [B, S]; for a call with inputs_embeds: placeholder ids at visual rows, -1 elsewhere
    attention_mask: torch.Tensor
    masks: dict[str, torch.Tensor]  # modality -> [B, S] placeholder rows
    pending: Pending  # handed to the engine
    #: modality -> images / videos per sample (placeholder runs, then the encoder's own items)
    counts: dict[str, list[int]]
    #: the encoder output being reduced and its tower attention (set by reduce_features)
    out: Any = None
    tower_attention: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: every item's frames' ``tower_attention`` in order (VisionContext.batch_tower_attention; set with it)
    batch_tower_attention: Callable[[], list[tuple[torch.Tensor, ...]]] | None = None
    #: the call's inputs_embeds [B, S, D] when it gave no input_ids
    embeds: torch.Tensor | None = None
    #: modality -> the Reduction of every item of its encoder output (set by reduce_features)
    reductions: dict[str, list[Reduction]] = field(default_factory=dict)


class HFVLMAdapter(Adapter):
    """Base of adapters for ``*ForConditionalGeneration`` VLMs with ``model.model.language_model``."""

    #: names of the feature functions on the inner model, by modality
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features"}

    # ---- layout -------------------------------------------------------------------------------
    @property
    def inner(self) -> torch.nn.Module:
        return self.model.model

    @property
    def language_model(self) -> torch.nn.Module:
        return self.inner.language_model

    def placeholder_ids(self) -> dict[str, int]:
        """Token id of each modality's placeholder, e.g. {"image": 32000}."""
        cfg = self.model.config
        out = {"image": cfg.image_token_id}
        if getattr(cfg, "video_token_id", None) is not None:
            out["video"] = cfg.video_token_id
        return out

    def apply_rope(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The rotary function of the language model's own modeling module."""
        module = importlib.import_module(type(self.language_model.layers[0].self_attn).__module__)
        return module.apply_rotary_pos_emb

    def lm_spec(self) -> LMSpec:
        lm = self.language_model
        return LMSpec(lm=lm, layers=lm.layers, family=self.family, apply_rope=self.apply_rope())

    def image_grid(self, n_tokens: int, image_index: int) -> tuple[int, int] | None:
        """(rows, cols) of one image's tokens when they form a square grid."""
        side = math.isqrt(n_tokens)
        return (side, side) if side * side == n_tokens else None

    # ---- attach / detach ----------------------------------------------------------------------
    def __init__(self, model: torch.nn.Module, state: Any) -> None:
        super().__init__(model, state)
        self._request: ContextSlot[Request | None] = ContextSlot("request", None)
        self._bypass: ContextSlot[bool] = ContextSlot("bypass", False)
        #: True while a patched feature function runs (a nested one is passed through)
        self._encoding: ContextSlot[bool] = ContextSlot("encoding", False)
        #: columns of the prompt of the calling thread's generate() call in progress
        self._prompt: ContextSlot[int | None] = ContextSlot("prompt", None)
        self._noted: set[str] = set()  # the notes of note_whole_images already warned

    @property
    def request(self) -> Request | None:
        """The calling thread's current prefill (None outside one, in decode steps and unpruned runs)."""
        return self._request.get()

    @property
    def bypassed(self) -> bool:
        """True while the calling thread runs the model unpruned (see :meth:`unpruned`)."""
        return self._bypass.get()

    def check_language_model(self) -> None:
        """Refuse, at wrap time, language models whose attention the pruned decoder cannot honour."""
        cfg = self.language_model.config
        types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in types) or (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)):
            kinds = sorted(set(types)) or ["sliding window"]
            raise ValueError(
                f"vlm_prune's pruned decoder runs full causal attention in every layer; this language model has "
                f"{', '.join(kinds)} layers (config.layer_types / use_sliding_window). Disable the sliding window "
                "(config.use_sliding_window=False) if the prompts fit the full window, or use the model unwrapped"
            )

    def attach(self) -> None:
        self.check_language_model()
        lm = self.language_model
        self.decoder = PrunedDecoder(
            self.lm_spec(), self.state, lambda: lm.config._attn_implementation,
            pending=lambda: None if (r := self.request) is None else r.pending, bypassed=self._bypass.get,
        )
        self.decoder.check_depth()
        self.patches.set(lm, "forward", self.decoder.forward)
        inner_forward = self.patches.original(self.inner, "forward")

        @functools.wraps(inner_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            request = None if self.bypassed else self.new_request(args, kwargs)
            # a nested call (a frame scorer inside a prefill) gets its own scope and gives the outer one back
            with self._request.use(request):
                if request is not None:
                    self.reduce_encoded(kwargs)
                return inner_forward(*args, **kwargs)

        self.patches.set(self.inner, "forward", forward)
        self._patch_generate()
        self._patch_expansion()
        self._patch_loss()
        if "vision" in self.state.methods or getattr(self.state.methods.get("frames"), "wants_tower_attention", False):
            self.tap = self.make_tap()
            if self.tap is not None:
                self.patches.track(self.tap.handle)
        for modality, fname in self.feature_functions.items():
            self._patch_features(modality, fname)

    def _patch_generate(self) -> None:
        """generate() refuses what the pruned decoder cannot do and remembers its prompt length, so
        that use_cache=False (every step re-runs the whole sequence) prunes from the prompt only."""
        original = self.patches.original(self.model, "generate")

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            config = kwargs.get("generation_config") or self.model.generation_config
            impl = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
            if impl not in (None, "dynamic"):
                raise ValueError(
                    f"vlm_prune does not support generate(cache_implementation={impl!r}): pruned layers hold fewer "
                    "rows than the prompt, which a fixed-size cache cannot express. Use the default dynamic cache "
                    "(drop cache_implementation), or unwrap the model"
                )
            for flag in ("output_attentions", "output_hidden_states"):
                if kwargs.get(flag, getattr(config, flag, False)):
                    raise ValueError(
                        f"vlm_prune does not return {flag} from generate(): after a removal each layer holds "
                        "different rows. Read model.vlm_prune.last_rows / last_stats, or unwrap the model"
                    )
            for method in self.state.methods.values():  # decoding paths a method refuses (decode-time KV pruning)
                check = getattr(method, "check_generate", None)
                if check is not None:
                    check(kwargs, config)
            prompt = kwargs.get("input_ids", args[0] if args else None)
            self.check_generate_inputs(prompt, kwargs)
            if prompt is None:
                prompt = kwargs.get("inputs_embeds")
            with self._prompt.use(None if prompt is None else int(prompt.shape[1])):
                return original(*args, **kwargs)

        self.patches.set(self.model, "generate", generate)

    def check_generate_inputs(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """Refuse, at the generate() call, inputs that transformers' own preparation would fail on
        with a bare error before the model runs (the M-RoPE families: see ``Qwen2VLAdapter``)."""

    def _patch_loss(self) -> None:
        """Training-style calls with ``labels``: the loss over the rows the model returned.

        Nothing removed: transformers' own loss, unchanged. After a removal each kept row still
        predicts the input token that follows it in the original sequence (labels are mapped
        through ``last_rows``); padding rows are ignored.
        """
        original = self.patches.original(self.model, "forward")

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            labels = kwargs.get("labels")
            if labels is None:
                return original(*args, **kwargs)
            out = original(*args, **{**kwargs, "labels": None})
            rows = self.state.last_rows
            logits = out.logits
            if rows is None or logits.shape[1] != rows.shape[1]:
                raise ValueError(
                    "vlm_prune computes the loss over the rows the model returned; with labels, call the model "
                    f"without logits_to_keep (got logits for {logits.shape[1]} of {rows.shape[1] if rows is not None else '?'} rows)"
                )
            s = labels.shape[1]
            in_place = torch.where(rows >= 0, rows, torch.arange(rows.shape[1], device=rows.device))
            if rows.shape[1] == s and bool((in_place == torch.arange(s, device=rows.device)).all()):
                shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # nothing removed
            else:
                nxt = (rows + 1).clamp(max=s - 1).to(labels.device)
                shift = torch.gather(labels, 1, nxt).masked_fill(((rows < 0) | (rows + 1 >= s)).to(labels.device), -100)
            loss_kwargs = {k: v for k, v in kwargs.items() if k == "num_items_in_batch"}
            out.loss = self.model.loss_function(logits=logits, labels=None, shift_labels=shift,
                                                vocab_size=self.model.config.get_text_config().vocab_size, **loss_kwargs)
            return out

        self.patches.set(self.model, "forward", forward)

    def _patch_expansion(self) -> None:
        """generate() with num_beams / num_return_sequences > 1 encodes every image once, then repeats
        the encoder output per sequence; record which encoded item each repeated one is
        (``vlm_prune_source``), so side information of the encode (grids, tower rows) follows it."""
        original = self.patches.original(self.model, "_expand_multimodal_outputs")

        @functools.wraps(original)
        def expand(input_ids: Any, mm_encoder_output: dict, *args: Any, **kwargs: Any) -> dict:
            # transformers groups the items per text sample by matching their token counts with the
            # placeholders: probe it with the placeholder count of every item (a ViT-stage method
            # already shortened the items), each probe token naming its item
            probes, items = {}, {}
            for m, out in mm_encoder_output.items():
                pooled = getattr(out, "pooler_output", None)
                if pooled is not None:
                    items[m] = {source_of(out, i): p for i, p in enumerate(pooled)}
                    probes[m] = SimpleNamespace(pooler_output=[
                        torch.full((self.placeholder_count(out, p),), source_of(out, i)) for i, p in enumerate(pooled)])
            original(input_ids, probes, *args, **kwargs)
            result = original(input_ids, mm_encoder_output, *args, **kwargs)
            for m, probe in probes.items():
                sources = [int(t[0]) for t in probe.pooler_output]
                result[m].vlm_prune_source = sources
                expanded = [items[m][j] for j in sources]
                pooled = result[m].pooler_output
                if len(expanded) != len(pooled) or any(a is not b and not torch.equal(a, b) for a, b in zip(expanded, pooled)):
                    result[m].pooler_output = torch.stack(expanded) if isinstance(pooled, torch.Tensor) else type(pooled)(expanded)
            return result

        self.patches.set(self.model, "_expand_multimodal_outputs", expand)

    def placeholder_count(self, out: Any, item: torch.Tensor) -> int:
        """Placeholder rows one item of an encoder output fills (its tokens, unless a ViT-stage
        method shortened them)."""
        return len(item)

    def detach(self) -> None:
        if self.tap is not None:
            self.tap.remove()
            self.tap = None
        super().detach()

    #: side computation of the tower's feature-layer attention (VisionZip), when the adapter has one
    tap: FeatureLayerTap | None = None

    def make_tap(self) -> FeatureLayerTap | None:
        return None

    def annotate_output(self, modality: str, out: Any) -> None:
        """Snapshot side data methods need onto an encoder output (generate() encodes first)."""
        if self.tap is not None:
            out.vlm_prune_tower_input = self.tap.input

    def _patch_features(self, modality: str, fname: str) -> None:
        original = self.patches.original(self.inner, fname)

        signature = inspect.signature(original)

        @functools.wraps(original)
        def features(*args: Any, **kwargs: Any) -> Any:
            if self._encoding.get():  # called by another feature function (Qwen3-VL's video -> image)
                return original(*args, **kwargs)
            call = signature.bind_partial(*args, **kwargs).arguments
            self.before_features(modality, call)
            with self._encoding.use(True):
                out = original(*args, **kwargs)
            # remember the call's arguments (grid sizes): generate() encodes before the forward
            out.vlm_prune_call = call
            self.annotate_output(modality, out)
            if self.request is not None:
                out = self.encoded(modality, out)
            return out

        self.patches.set(self.inner, fname, features)

    def before_features(self, modality: str, call: dict[str, Any]) -> None:
        """Hook before the model's feature function runs with arguments ``call`` (LLaVA-NeXT sets
        each anyres tile's share of the image budget for the tower)."""

    # ---- per request --------------------------------------------------------------------------
    #: the placeholder rows holding the model's ``image_newline`` (LLaVA-NeXT, LLaVA-OneVision) are
    #: not visual tokens: never counted, pruned or merged in the LLM (the official code keeps them)
    newline_not_visual: ClassVar[bool] = False

    def new_request(self, args: tuple, kwargs: dict[str, Any]) -> Request | None:
        """The request of a prefill: its visual rows for the engine (None for decode steps)."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds") if input_ids is None else None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and cache.get_seq_length() > 0 and not self._brings_media(kwargs):
            return None  # a decode step, draft tokens, or a text turn after the cached prefix
        if embeds is not None:
            input_ids = self._placeholders_in(embeds)
        if input_ids is None:
            return None
        ids = self.placeholder_ids()
        masks = {m: input_ids == t for m, t in ids.items()}
        visual = torch.zeros_like(input_ids, dtype=torch.bool)
        for m in masks.values():
            visual |= m
        if cache is not None and cache.get_seq_length() > 0 and not bool(visual.any()):
            return None
        attn = kwargs.get("attention_mask")
        if attn is not None and attn.dim() == 2:
            attn = attn[:, -input_ids.shape[1]:]  # (after a cached prefix it also covers the cached columns)
        prompt = self._prompt.get()
        counts = {m: placeholder_runs(mask) for m, mask in masks.items()}
        pending = Pending(visual=visual, images_per_sample=[sum(c) for c in zip(*counts.values())],
                          prompt=prompt if prompt is not None and prompt < input_ids.shape[1] else None)
        newline = getattr(self.inner, "image_newline", None) if self.newline_not_visual else None
        if newline is not None:
            pending.not_visual = lambda embeds: (embeds == newline.to(embeds.dtype)).all(-1)
        return Request(
            input_ids=input_ids,
            attention_mask=attn if attn is not None else torch.ones_like(input_ids),
            masks=masks,
            pending=pending,
            counts=counts,
            embeds=embeds,
        )

    def _placeholders_in(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """For a call with inputs_embeds: [B, S] placeholder ids where a row is a placeholder's
        embedding (as transformers finds them), -1 elsewhere; None (with a warning) when none is."""
        table = self.language_model.embed_tokens
        ids = torch.full(embeds.shape[:2], -1, dtype=torch.long, device=embeds.device)
        for tok in self.placeholder_ids().values():
            row = table(torch.tensor(tok, device=embeds.device)).to(embeds.dtype)
            ids[(embeds == row).all(-1)] = tok
        if bool((ids >= 0).any()):
            return ids
        _warn_once("vlm_prune: these inputs_embeds hold no image / video placeholder embeddings, so the visual rows "
                   "are unknown and nothing is pruned (last_stats reports 0 visual tokens). Pass input_ids (or "
                   "inputs_embeds with the placeholders, and pixel_values) to prune")
        return None

    def _brings_media(self, kwargs: dict[str, Any]) -> bool:
        """True when a call carries images / videos (pixels or encoder outputs) for its placeholders."""
        encoded = kwargs.get("mm_encoder_outputs") or {}
        return any(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")) or \
            any(v is not None for v in encoded.values())

    def encoded(self, modality: str, out: Any) -> Any:
        """An encoder output of the current request: count its images / videos per sample (adjacent
        placeholders of two images form one run, the encoder knows them apart), then reduce it."""
        request = self.request
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            samples = self.sample_of_items(modality, self.item_lengths(modality, out))
            request.counts[modality] = [samples.count(b) for b in range(request.input_ids.shape[0])]
            request.pending.images_per_sample = [sum(c) for c in zip(*request.counts.values())]
            if modality == "video" and getattr(self.state.methods.get("llm"), "wants_frame_slots", False):
                self.record_frame_slots(modality, out)
        return self.reduce_features(modality, out)

    def record_frame_slots(self, modality: str, out: Any) -> None:
        """``Pending.frame_slots`` of the videos in an encoder output: each frame token's index in its
        frame, offset by the video's first placeholder (so that ids of different videos differ); a
        video's ``tail`` rows (LLaVA-OneVision's newline) get none."""
        request = self.request
        flat = torch.nonzero(request.masks[modality])  # [n, 2] (sample, row) of each placeholder, in order
        slots = request.pending.frame_slots
        if slots is None:
            slots = torch.full(request.input_ids.shape, -1, dtype=torch.long, device=flat.device)
        offset = 0
        for it in self.items(modality, out):
            length = it.features.shape[0]
            per_frame = (length - it.tail) // max(1, it.frames)
            body = per_frame * it.frames
            at = flat[offset : offset + body]
            ids = torch.arange(body, device=flat.device) % max(1, per_frame) + offset
            slots[at[:, 0], at[:, 1]] = ids
            offset += length
        request.pending.frame_slots = slots

    def item_lengths(self, modality: str, out: Any) -> list[int]:
        """Placeholder rows of each image / video of an encoder output, in order (one per
        ``pooler_output`` entry, unless an image spans several entries: InternVL's tiles)."""
        return [len(p) for p in out.pooler_output]

    def reduce_encoded(self, kwargs: dict[str, Any]) -> None:
        """generate() encodes images before the prefill: reduce them here (in this call's kwargs)."""
        encoded = kwargs.get("mm_encoder_outputs")
        if encoded:
            kwargs["mm_encoder_outputs"] = {
                m: (self.encoded(m, out) if out is not None and m in self.feature_functions else out)
                for m, out in encoded.items()
            }

    def sample_of_items(self, modality: str, counts: list[int]) -> list[int]:
        """Sample index of each image / video whose features have ``counts`` tokens, in order."""
        mask = self.request.masks[modality]
        flat_sample = torch.nonzero(mask)[:, 0]
        out, offset = [], 0
        for n in counts:
            out.append(int(flat_sample[offset]) if offset < flat_sample.numel() else 0)
            offset += n
        return out

    def text_embeds(self, sample: int) -> torch.Tensor:
        """Input embeddings of the sample's question (see :meth:`question_ids`)."""
        req = self.request
        if req.embeds is not None:
            return req.embeds[sample, : req.pending.prompt][self._question_rows(sample)]
        return self.language_model.embed_tokens(self.question_ids(sample))

    def items(self, modality: str, out: Any) -> list[Item]:
        """The images / videos in an encoder output, in placeholder order."""
        return [Item(f, 1, self.image_grid(f.shape[0], i)) for i, f in enumerate(out.pooler_output)]

    def rebuild(self, modality: str, out: Any, feats: list[torch.Tensor]) -> Any:
        """A copy of ``out`` whose pooler_output holds ``feats`` in the original container type."""
        out = copy.copy(out)
        old = out.pooler_output
        out.pooler_output = torch.stack(feats) if isinstance(old, torch.Tensor) else type(old)(feats)
        return out

    def reduce_features(self, modality: str, out: Any) -> Any:
        """A copy of the encoder output ``out`` reduced by the frames / vision method; the kept
        slots (and merge sizes) of every item are recorded for the engine."""
        frames_m = self.state.methods.get("frames") if modality == "video" else None
        vision_m = self.state.methods.get("vision")
        if frames_m is None and vision_m is None:
            if modality == "image":
                self.note_whole_images(out)
            return out
        items = self.items(modality, out)
        request = self.request
        self._check_placeholders(modality, out)
        request.out = out
        request.tower_attention = tower = self.tower_attention_fn(out, modality)
        request.batch_tower_attention = None if tower is None else functools.cache(
            lambda: [tower(i, t) for i, it in enumerate(items) for t in range(it.frames)])
        samples = self.sample_of_items(modality, [it.features.shape[0] for it in items])
        t0, c0 = time.perf_counter(), time.process_time()
        new_feats, keep_list, size_list, n_in, n_out, extra, merges = [], [], [], [], [], [], []
        # the frames stage's token groups (FramesPlan.groups), numbered on from earlier ones of the request
        group_list: list[torch.Tensor] = []
        group_keep = list(request.pending.group_keep or [])
        grouped = False
        # a frames + vision pipeline: the frames stage's count per video, then the vision stage's record
        mid: list[int] = []
        vision_videos: list[dict[str, list[int]]] = []
        vision_secs = vision_cpu = 0.0
        merged = False
        offset = 0
        for i, it in enumerate(items):
            body = it.features.shape[0] - it.tail
            # seeded by the item's rank within its sample, so a batch equals its samples run alone
            rank = samples[:i].count(samples[i])
            gen = item_generator(self.state.seed, rank)
            with torch.no_grad():
                if frames_m is not None:
                    plan = frames_m.allocate(self.frames_context(frames_m, it, i, samples[i]))
                    # packed: the plan resized frames (QuoTA), whose tokens fill the video's first slots in frame order
                    extra.append({"tokens_per_frame": plan.tokens_per_frame, "kept_frames": plan.kept_frames,
                                  "frame_scores": None if plan.frame_scores is None else plan.frame_scores.tolist(),
                                  "packed": plan.token_coords is not None})
                    if vision_m is not None:
                        v0, vc0 = time.perf_counter(), time.process_time()
                        mid.append(int(plan.reduction.indices.numel()))
                        plan, targets = self.vision_after_frames(vision_m, it, plan, samples[i], gen, i)
                        vision_videos.append({"targets": targets, "tokens_per_frame": plan.tokens_per_frame})
                        vision_secs += time.perf_counter() - v0
                        vision_cpu += time.process_time() - vc0
                    self.frames_planned(modality, it, offset, plan)
                    red = plan.reduction
                else:
                    red = self.reduce_frames(vision_m, it, samples[i], gen, i)
            merges.append(red)
            merged = merged or red.merged_into is not None
            groups = torch.full((it.features.shape[0],), -1, dtype=torch.long, device=it.features.device)
            if frames_m is not None and plan.groups is not None:
                groups[red.indices.to(groups.device)] = plan.groups.to(groups.device) + len(group_keep)
                group_keep.extend(plan.group_keep)
                grouped = True
            group_list.append(groups)
            f, keep, sizes = scatter_reduction(it.features[:body], red)
            tail = slice(body, it.features.shape[0])
            new_feats.append(torch.cat([f, it.features[tail]]))
            keep_list.append(torch.cat([keep, torch.ones(it.tail, dtype=torch.bool, device=keep.device)]))
            size_list.append(torch.cat([sizes, torch.ones(it.tail, device=sizes.device)]))
            skip = None if frames_m is not None else self.not_visual_rows(it, i)
            visual = keep.new_ones(body) if skip is None else ~skip[:body].to(keep.device)
            n_in.append(int(visual.sum()))  # visual tokens only, as the engine counts them
            n_out.append(int((keep[:body] & visual).sum()))
            offset += it.features.shape[0]
        secs, cpu_secs = time.perf_counter() - t0, time.process_time() - c0
        request.reductions[modality] = merges
        self._commit_vision(modality, keep_list, size_list)
        if grouped:
            self._commit_groups(modality, group_list, group_keep)
        if frames_m is None and getattr(vision_m, "renumber_positions", False):
            request.pending.renumber = True  # the official code feeds the LLM the shorter sequence
        record = {"stage": "frames" if frames_m is not None else "vision",
                  "method": (frames_m or vision_m).name, "modality": modality,
                  "tokens_in": n_in, "tokens_out": mid or n_out, "seconds": secs - vision_secs,
                  "cpu_seconds": cpu_secs - vision_cpu}
        if extra:
            record["videos"] = extra
        records = [record]
        if mid:  # the vision stage of a frames + vision pipeline, on the frames the frames stage kept
            records.append({"stage": "vision", "method": vision_m.name, "modality": modality, "tokens_in": mid,
                            "tokens_out": n_out, "seconds": vision_secs, "cpu_seconds": vision_cpu,
                            "videos": vision_videos})
        if merged:  # a merging method (VisionZip): each item's token -> its token's slot (Reduction.merged_into)
            records[-1]["merged_into"] = [r.membership(n).tolist() for r, n in zip(merges, n_in)]
        request.pending.records.extend(records)
        return self.rebuild(modality, out, new_feats)

    def note_whole_images(self, out: Any) -> None:
        """A frames-stage method alone (uniform, fastvid, vidcom2, keyscore, quota) leaves the images of
        encoder output ``out`` whole: the call's stage records and last_stats' budget_notes say so, and
        it is warned once (:class:`BudgetWarning`), as wrap() does for a target the model cannot reach."""
        methods = self.state.methods
        frames = methods.get("frames")
        if frames is None or getattr(frames, "decode_kv", False) or any(s in methods for s in ("vit", "llm")):
            return
        video = self.request.masks.get("video")
        if video is not None and bool(video.any()):  # a video call (Qwen2-VL encodes videos through its image path)
            return
        note = (f"{frames.name} selects and reduces the frames of videos; this call's images keep all their tokens. "
                f"Add a vision- or llm-stage method to prune images: wrap(model, frames={frames.name!r}, tokens='random', ...)")
        counts = []  # visual tokens of each image, as the engine counts them
        for i, it in enumerate(self.items("image", out)):
            body = it.features.shape[0] - it.tail
            skip = self.not_visual_rows(it, i)
            counts.append(body if skip is None else int((~skip[:body]).sum()))
        self.request.pending.records.append({"stage": "frames", "method": frames.name, "modality": "image",
                                             "skipped": "images", "note": note, "tokens_in": counts,
                                             "tokens_out": counts, "seconds": 0.0})
        if note not in self._noted:
            self._noted.add(note)
            warnings.warn(note, BudgetWarning, stacklevel=2)

    def _check_placeholders(self, modality: str, out: Any) -> None:
        """Refuse, as transformers does, inputs whose placeholder tokens do not match the encoded images /
        videos, before a method runs on them (it would fail on the mismatch with a bare shape error)."""
        mask = self.request.masks.get(modality)
        if mask is None:
            return
        rows = [self.placeholder_count(out, p) for p in out.pooler_output]
        tokens = int(mask.sum())
        if tokens != sum(rows):
            raise ValueError(placeholder_mismatch(modality, tokens, rows))

    def item_generator(self, samples: list[int], index: int) -> torch.Generator:
        """:func:`item_generator` of item ``index`` (``samples``: the sample of every item), seeded by
        the item's rank within its sample."""
        return item_generator(self.state.seed, samples[:index].count(samples[index]))

    def not_visual_rows(self, it: "Item", index: int) -> torch.Tensor | None:
        """[N] bool: the rows of item ``index`` that are not visual tokens (the ``image_newline`` rows
        of LLaVA-NeXT / LLaVA-OneVision images, found as the engine finds them: equal to the model's
        newline embedding); None when every row is one. Vision methods never see, count or drop them."""
        newline = getattr(self.inner, "image_newline", None) if self.newline_not_visual else None
        if newline is None or it.grid is not None or it.tail:  # video items end in their newline (tail)
            return None
        mask = (it.features == newline.to(it.features.dtype)).all(-1)
        return mask if bool(mask.any()) else None

    def reduce_frames(self, method: Any, it: "Item", sample: int, gen: torch.Generator, index: int) -> Reduction:
        """Apply a vision method to each frame of an item (an image is one frame). Rows that are not
        visual tokens (:meth:`not_visual_rows`) are always kept and the method sees the others only,
        so they never count against its budget."""
        skip = self.not_visual_rows(it, index)
        if skip is None:
            return self.reduce_visual_frames(method, it, sample, gen, index)
        rows = torch.nonzero(~skip).squeeze(1)
        kept = torch.nonzero(skip).squeeze(1)
        red = self.reduce_visual_frames(method, Item(it.features[rows], 1, None), sample, gen, index)
        feats = None if red.features is None else torch.cat([red.features, it.features[kept]])
        sizes = None if red.sizes is None else torch.cat([red.sizes, torch.ones(kept.numel(), device=red.sizes.device)])
        return Reduction(torch.cat([rows[red.indices.to(rows.device)], kept]), feats, sizes)

    def reduce_visual_frames(self, method: Any, it: "Item", sample: int, gen: torch.Generator, index: int) -> Reduction:
        """Apply a vision method to each frame of an item whose rows are all visual tokens."""
        n = (it.features.shape[0] - it.tail) // it.frames
        tower_attention = self.request.tower_attention
        pieces = [Piece(t * n, n, method.n_keep(n, 1), it.grid,
                        (lambda i=index, t=t: tower_attention(i, t)) if tower_attention else None)
                  for t in range(it.frames)]
        return self.reduce_pieces(method, it.features[: it.frames * n], pieces, sample, gen, index)

    def reduce_pieces(self, method: Any, features: torch.Tensor, pieces: list["Piece"], sample: int,
                      gen: torch.Generator, index: int) -> Reduction:
        """Apply a vision method to each piece (a frame) of ``features`` [K, D] on its own, with the
        piece's count; one Reduction over the K rows (a piece with count 0 is dropped whole)."""
        text = self.text_embeds(sample).detach()
        k = features.shape[0]
        parts, merged = [], False
        into_all = torch.full((k,), -1, dtype=torch.long, device=features.device)
        for piece in pieces:
            if piece.n_keep <= 0:
                continue
            rows = features[piece.start : piece.start + piece.length]
            red = method.reduce_image(VisionContext(
                features=rows, n_keep=piece.n_keep, grid=piece.grid, text_embeds=text,
                tower_attention=piece.tower_attention, generator=gen, image_index=index,
                batch_tower_attention=self.request.batch_tower_attention,
            ))
            if len(pieces) == 1:
                return red
            into = red.membership(piece.length).to(into_all.device)
            into_all[piece.start : piece.start + piece.length] = torch.where(into >= 0, into + piece.start, -1)
            merged = merged or red.merged_into is not None
            parts.append(Reduction(red.indices + piece.start, red.features, red.sizes))
        if not parts:
            return Reduction(torch.zeros(0, dtype=torch.long, device=features.device))
        feats = None
        if any(p.features is not None for p in parts):
            feats = torch.cat([p.features if p.features is not None else features[p.indices] for p in parts])
        sizes = None
        if any(p.sizes is not None for p in parts):
            sizes = torch.cat([p.sizes if p.sizes is not None else torch.ones(p.indices.numel()) for p in parts])
        return Reduction(torch.cat([p.indices for p in parts]), feats, sizes, into_all if merged else None)

    def vision_after_frames(self, method: Any, it: "Item", plan: FramesPlan, sample: int, gen: torch.Generator,
                            index: int) -> tuple[FramesPlan, list[int]]:
        """The vision stage of a frames + vision pipeline on one video: ``method`` reduces each frame
        the frames stage kept, on its own. The stage's count is the pipeline rule's share of the
        video's target (``Method.n_keep`` over the video's tokens: the target itself when it is the
        last stage), shared over the kept frames in proportion to their tokens (:func:`apportion`).
        Kept tokens stay at the slots the frames stage gave them. Returns the composed plan and the
        count asked of each frame (0 for the frames the frames stage dropped)."""
        n = (it.features.shape[0] - it.tail) // it.frames
        first = plan.reduction
        native = first.features is None  # whole frames (or a part of one) at their own slots
        features = it.features[first.indices] if native else first.features
        frames = [t for t, k in enumerate(plan.tokens_per_frame) if k > 0]
        lengths = [plan.tokens_per_frame[t] for t in frames]
        shares = apportion(method.n_keep(features.shape[0], 1, n_original=it.frames * n), lengths)
        tower_attention = self.request.tower_attention
        pieces, start = [], 0
        for t, length, share in zip(frames, lengths, shares):
            local = first.indices[start : start + length] - t * n if native else None
            whole = native and length == n
            if whole:
                grid = it.grid
            elif plan.token_coords is not None:
                grid = coords_grid(plan.token_coords[start : start + length, 1:])
            else:
                grid = None
            attention = None
            if tower_attention is not None and native:
                attention = ((lambda t=t: tower_attention(index, t)) if whole else
                             (lambda t=t, local=local: tuple(x[local] for x in tower_attention(index, t)[:2])))
            pieces.append(Piece(start, length, share, grid, attention))
            start += length
        second = self.reduce_pieces(method, features, pieces, sample, gen, index)
        kept_rows = second.indices
        per_frame = [0] * it.frames
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], device=kept_rows.device)
        for j, t in enumerate(frames):
            per_frame[t] = int(((kept_rows >= bounds[j]) & (kept_rows < bounds[j + 1])).sum())
        targets = [0] * it.frames
        for t, share in zip(frames, shares):
            targets[t] = share
        return FramesPlan(
            reduction=first.then(second, it.frames * n),
            kept_frames=[t for t in range(it.frames) if per_frame[t] > 0],
            tokens_per_frame=per_frame,
            frame_scores=plan.frame_scores,
            token_coords=None if plan.token_coords is None else plan.token_coords[kept_rows.to(plan.token_coords.device)],
        ), targets

    def frames_planned(self, modality: str, it: "Item", offset: int, plan: Any) -> None:
        """Hook after a frames plan for the item whose slots start at flat placeholder ``offset``
        (models with spatial position ids place resized tokens here)."""

    def frames_context(self, method: Any, it: "Item", index: int, sample: int) -> FramesContext:
        n = (it.features.shape[0] - it.tail) // it.frames
        tower = self.request.tower_attention
        return FramesContext(
            features=it.features[: it.frames * n].reshape(it.frames, n, -1),
            grid=it.grid,
            n_total=method.n_keep(it.frames * n, 1),
            query=self.query_text(sample),
            text_features=self.text_embeds(sample).detach(),
            generate_text=self.generate_text_fn(),
            tower_attention=(lambda t, i=index: tower(i, t)) if tower else None,
        )

    @contextlib.contextmanager
    def unpruned(self):
        """Run the model without any pruning inside this block (frame scorers, query decoupling)."""
        with self._bypass.use(True):
            yield

    def tokenizer(self) -> Any:
        proc = self.state.processor
        return getattr(proc, "tokenizer", proc)

    def chat_ids(self, prompt: str, media: str | None, n_media_tokens: int = 0) -> torch.Tensor:
        """Token ids of one user turn (with a ``media`` placeholder expanded to ``n_media_tokens``)
        in the processor's chat template, ending with the assistant prefix."""
        proc = self.state.processor
        content = ([{"type": media}] if media else []) + [{"type": "text", "text": prompt}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer()(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        if media:
            tok_id = self.placeholder_ids()[media]
            parts = []
            for t in ids.tolist():
                parts.extend([tok_id] * n_media_tokens if t == tok_id else [t])
            ids = torch.tensor(parts)
        return ids

    def chat_batch(self, prompts: list[str], media: str | None, n_media_tokens: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`chat_ids` of each prompt, left-padded: (input_ids, attention_mask) [len(prompts), width]."""
        unique = {p: self.chat_ids(p, media, n_media_tokens) for p in dict.fromkeys(prompts)}  # one template render each
        seqs = [unique[p] for p in prompts]
        width = max(s.numel() for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, width - s.numel():] = s
            mask[i, width - s.numel():] = 1
        return ids, mask

    def score_frame_videos(self, frames: torch.Tensor, prompts: list[str], tokens: list[str], **extra: Any) -> torch.Tensor:
        """QuoTA's default scorer on families whose video is a run of frame tokens: the unpruned model
        on one-frame videos made of each frame's already computed tokens ``frames`` [T, n, D], one
        prompt per frame (or one shared), all in one batch. Returns probabilities [T, len(tokens)]."""
        t = frames.shape[0]
        prompts = prompts * t if len(prompts) == 1 else prompts
        ids, mask = self.chat_batch(prompts, "video", frames.shape[1])
        return self.score_prompts(ids, mask, tokens, BaseModelOutputWithPooling(pooler_output=list(frames)), **extra)

    def score_prompts(self, ids: torch.Tensor, mask: torch.Tensor, tokens: list[str], encoded: Any, **extra: Any
                      ) -> torch.Tensor:
        """The unpruned model's next-token probabilities [B, len(tokens)] of ``tokens`` after the
        prompts ``ids`` / ``mask`` [B, S] (from :meth:`chat_batch`), whose video placeholders take the
        already computed encoder output ``encoded`` (no second vision-tower pass); one batch,
        logits of the last position only (QuoTA's default frame scorer)."""
        from vlm_prune.frames.scorers import vocab_id

        targets = [vocab_id(self.tokenizer(), t) for t in tokens]
        device = self.model.device
        with self.unpruned(), torch.no_grad():
            logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=1,
                                mm_encoder_outputs={"video": encoded}, **extra).logits[:, -1]
        return torch.softmax(logits.float(), dim=-1)[:, targets].cpu()

    def generate_text_fn(self) -> Callable[..., str] | None:
        """Text-only greedy generation with the unpruned model (QuoTA's query decoupling):
        generate(prompt, done=None, max_new_tokens=64) stops at end of sequence, once
        ``done(text so far)`` is true, or at the model's maximum position."""
        if self.state.processor is None:
            return None

        def generate(prompt: str, done: Callable[[str], bool] | None = None, max_new_tokens: int = 64) -> str:
            from transformers import StoppingCriteria, StoppingCriteriaList

            ids = self.chat_ids(prompt, None)[None].to(self.model.device)
            tok = self.tokenizer()

            class Parsed(StoppingCriteria):
                def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                    text = tok.decode(input_ids[0, ids.shape[1]:], skip_special_tokens=True)
                    return torch.full((input_ids.shape[0],), bool(done(text)), device=input_ids.device)

            stop = StoppingCriteriaList([Parsed()]) if done is not None else None
            room = getattr(self.language_model.config, "max_position_embeddings", None)
            limit = max(1, min(max_new_tokens, room - ids.shape[1])) if room else max_new_tokens
            with self.unpruned(), torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit,
                                          do_sample=False, stopping_criteria=stop)
            return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

        return generate

    def query_text(self, sample: int) -> str | None:
        """The sample's question as text, when a processor (tokenizer) was given."""
        tok = self.tokenizer()
        if tok is None or not hasattr(tok, "decode") or self.request.embeds is not None:
            return None
        return tok.decode(self.question_ids(sample), skip_special_tokens=True).strip()

    def question_ids(self, sample: int) -> torch.Tensor:
        """Token ids of the sample's question: valid text after its last visual token, without the
        chat template's end-of-turn and assistant prefix when the processor's template is known."""
        question = self.request.input_ids[sample, : self.request.pending.prompt][self._question_rows(sample)]
        suffix = self._template_suffix()
        n = suffix.numel()
        if n and question.numel() > n and torch.equal(question[-n:].cpu(), suffix):
            question = question[:-n]
        return question

    def _question_rows(self, sample: int) -> torch.Tensor:
        """[S'] bool: the sample's valid text rows after its last visual row, within the prompt."""
        req = self.request
        end = req.pending.prompt  # tokens generated after the prompt are no part of the question
        valid = req.attention_mask[sample, :end].bool()
        visual = torch.zeros_like(valid)
        for m in req.masks.values():
            visual |= m[sample, :end]
        idx = torch.nonzero(visual).squeeze(1)
        after = torch.arange(valid.numel(), device=valid.device) > (idx.max() if idx.numel() else -1)
        return valid & after & ~visual

    def _template_suffix(self) -> torch.Tensor:
        """Ids the chat template puts after a user message when it adds the generation prompt."""
        if hasattr(self, "_suffix"):
            return self._suffix
        self._suffix = torch.zeros(0, dtype=torch.long)
        proc = self.state.processor
        if proc is not None and getattr(proc, "chat_template", None):
            mark = "QQQ"
            try:
                text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": mark}]}],
                                                add_generation_prompt=True, tokenize=False)
            except Exception:  # a template that needs other fields: keep the text as it is
                return self._suffix
            if mark in text:
                tail = text[text.rindex(mark) + len(mark):]
                self._suffix = self.tokenizer()(tail, add_special_tokens=False, return_tensors="pt").input_ids[0]
        return self._suffix

    def _commit_vision(self, modality: str, keep_list: list, size_list: list) -> None:
        pending = self.request.pending
        mask = self.request.masks[modality]
        keep = pending.keep if pending.keep is not None else torch.ones_like(mask)
        sizes = pending.sizes if pending.sizes is not None else torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
        keep = keep.clone()
        sizes = sizes.clone()
        keep[mask] = torch.cat(keep_list).to(keep.device)
        sizes[mask] = torch.cat(size_list).to(sizes.device)
        pending.keep, pending.sizes = keep, sizes

    def _commit_protected(self, modality: str, tables: list[torch.Tensor]) -> None:
        """Hand the engine each item's protected ranks over its placeholders (``Pending.protected``)."""
        pending = self.request.pending
        mask = self.request.masks[modality]
        protected = pending.protected.clone() if pending.protected is not None else \
            torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        protected[mask] = torch.cat(tables).to(protected.device)
        pending.protected = protected

    def _commit_groups(self, modality: str, group_list: list[torch.Tensor], group_keep: list[int]) -> None:
        """Hand the frames stage's token groups (FramesPlan.groups) of this modality's rows to the engine."""
        pending = self.request.pending
        mask = self.request.masks[modality]
        groups = pending.groups.clone() if pending.groups is not None else torch.full(mask.shape, -1, dtype=torch.long,
                                                                                      device=mask.device)
        groups[mask] = torch.cat(group_list).to(groups.device)
        pending.groups, pending.group_keep = groups, group_keep

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None:
        """callable(item, frame) -> (attention [N], keys [N, d]) for that frame's N tokens, or None."""
        return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def placeholder_mismatch(modality: str, tokens: int, rows: list[int]) -> str:
    """The message for an input with ``tokens`` placeholders of ``modality`` whose images / videos
    give ``rows`` tokens each: transformers' own first words, the counts, and the fix."""
    name = "Image" if modality == "image" else "Video"
    items = f"{len(rows)} {modality}{'s' if len(rows) != 1 else ''}" + (f" of {', '.join(map(str, rows))} tokens" if rows else "")
    return (f"{name} features and {modality} tokens do not match, tokens: {tokens}, features: {sum(rows)} rows ({items}): "
            f"the input has {tokens} {modality} placeholder tokens; build it with the model's processor, which gives "
            f"each {modality} exactly its placeholders")


def placeholder_runs(mask: torch.Tensor) -> list[int]:
    """Runs of placeholder rows in each sample of a [B, S] mask (a first guess at images per sample)."""
    m = mask.int()
    return (m[:, 1:] > m[:, :-1]).sum(1).add(m[:, 0]).tolist()


def source_of(out: Any, item: int) -> int:
    """The index, among the images / videos the encoder saw, of item ``item`` of an encoder output
    (they differ once generate() repeats the output per beam / returned sequence)."""
    source = getattr(out, "vlm_prune_source", None)
    return item if source is None else source[item]


def scatter_reduction(features: torch.Tensor, red: Reduction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a Reduction back into the image's N slots: (features [N, D], keep [N], sizes [N])."""
    n = features.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=features.device)
    keep[red.indices.to(features.device)] = True
    out = features
    if red.features is not None:
        out = features.clone()
        out[red.indices] = red.features.to(features.dtype)
    sizes = torch.ones(n, dtype=torch.float32, device=features.device)
    if red.sizes is not None:
        sizes[red.indices] = red.sizes.float().to(features.device)
    return out, keep, sizes


def fit_grid(frames: torch.Tensor, grid: tuple[int, int], limit: tuple[int, int] | None) -> torch.Tensor:
    """Frame maps [T, rows*cols, D] bilinearly resized to at most ``limit`` (rows, cols) each way."""
    if limit is None or (grid[0] <= limit[0] and grid[1] <= limit[1]):
        return frames
    size = (min(grid[0], limit[0]), min(grid[1], limit[1]))
    t, n, d = frames.shape
    flat = pool_grid(frames.transpose(0, 1).reshape(n, t * d), grid, size)
    return flat.reshape(size[0] * size[1], t, d).transpose(0, 1).to(frames.dtype)
