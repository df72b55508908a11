"""The pruned decoder loop.

It replaces the ``forward`` of one language-model instance (LlamaModel, Qwen2Model,
Qwen2VLTextModel, ...) and runs the same decoder layers, but lets methods remove or merge
rows between layers:

- rows keep their ORIGINAL position ids (gaps stay), so RoPE sees the same positions, unless the
  method's official code builds a shorter sequence: ``Pending.renumber`` (vision stage: VisionZip,
  FasterVLM, VisPruner, DivPrune, CDPruner) or an llm method's ``renumber_positions`` (AdaptInfer and
  PyramidDrop on LLaVA) renumber each sample's rows
  without gaps after the removal, and decode steps continue from the renumbered count;
- ragged batches are left-padded after a removal, padding rows are masked as keys;
- merged rows carry a size w; every later layer adds log(w) to attention logits for that key
  (proportional attention) through an additive float mask (eager / SDPA);
- each layer's KV cache holds exactly the rows that layer saw; the key-validity and bias of
  every cache segment are kept on the cache object, so decode steps of ``generate()`` attend
  to the right keys and continue positions from the unpruned length. A method with
  ``drops_earlier_keys`` (PruneVid's ``early_kv="drop"``, as its official cache) also hides the
  rows it removes from the decode steps of the layers before the removal
  (:func:`earlier_keys_dropped`);
- hybrid language models (Qwen3.5's Gated DeltaNet linear-attention layers between full-attention
  ones) need nothing more: a linear layer keeps no keys, so the removal is the physical one and the
  exact reference is the unwrapped model's layers 0..L-1 on the full sequence followed by layers
  L..end on the kept rows (their recurrent states, convolution windows and decode-time caches built
  from those rows only; the linear layers take the 2-D padding mask via ``LMSpec.layer_mask``, the
  full-attention ones the key masks and log-size biases above). A method reading a linear layer's
  attention reads the nearest full-attention layer before it (:meth:`PrunedDecoder.attention_layer`),
  recorded as the stage record's ``attention_layers`` and in ``last_stats["notes"]``.

The layers themselves are called unchanged with the fastest exact mask of each segment
(:func:`segment_mask`): none where no key is padding or merged (SDPA's and FlashAttention's
causal kernels), a boolean mask where only padding needs one, the additive float mask only
where merged keys carry log(size) (SDPA) or under eager attention; FlashAttention-2 gets a 2-D
key-padding mask where there is padding (proportional attention is off there).
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from transformers.modeling_outputs import MoeModelOutputWithPast

from vlm_prune.kv_cache import CacheSegments, install, segments_of
from vlm_prune.methods.base import DecodeStepContext, LayerContext, Reduction


@dataclass
class Rows:
    """The rows of a batch between two layers."""

    hidden: torch.Tensor  # [B, S, D]
    pos: torch.Tensor  # [P, B, S]
    valid: torch.Tensor  # [B, S] bool
    visual: torch.Tensor  # [B, S] bool
    sizes: torch.Tensor  # [B, S] float32
    origin: torch.Tensor  # [B, S] long: index in the model input, -1 for padding
    #: features added to some rows' hidden states after the first layers (Qwen3-VL's DeepStack):
    #: [n, B, S, D], layer i's addition in inject[i], zero on rows that get none; None: no layer adds any
    inject: torch.Tensor | None = None

    @property
    def text(self) -> torch.Tensor:
        """Valid non-visual rows after the last visual row of each sample (the question)."""
        s = self.valid.shape[1]
        ar = torch.arange(s, device=self.valid.device).expand_as(self.valid)
        last_vis = torch.where(self.visual & self.valid, ar, -1).max(dim=1, keepdim=True).values
        has_vis = last_vis >= 0
        return self.valid & ~self.visual & ((ar > last_vis) | ~has_vis)


@dataclass
class Pending:
    """What the adapter learnt about the next prefill (set before the LM runs, consumed by it)."""

    visual: torch.Tensor  # [B, S] bool
    keep: torch.Tensor | None = None  # [B, S] bool, vision-stage removal
    sizes: torch.Tensor | None = None  # [B, S] float, vision-stage merges
    images_per_sample: list[int] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    visual_in: list[int] | None = None  # visual tokens per sample before any reduction
    #: columns of the prompt when the input also holds generated tokens (generate with
    #: use_cache=False): LLM-stage methods then choose from the prompt's rows only
    prompt: int | None = None
    #: resized frame maps (QuoTA on M-RoPE models): new spatial positions for some rows
    position_rewrites: list["PositionRewrite"] = field(default_factory=list)
    #: callable(embeds [B, S, D]) -> [B, S] bool: placeholder rows that are not visual tokens
    #: (LLaVA-OneVision's newline tokens); never counted, pruned or merged
    not_visual: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: renumber positions without gaps after the vision-stage removal (``keep``), as an official
    #: code that feeds the LLM a shorter sequence (VisionZip); 1-D positions only
    renumber: bool = False
    #: [B, S] long: rows with the same id >= 0 attend to each other both ways (Gemma 3's image
    #: tokens, from ``token_type_ids``); -1: causal only. Follows the kept rows
    blocks: torch.Tensor | None = None
    #: [B, S] long: for each video token, the id of its spatial slot (the same id for the same slot in
    #: every frame of one video, ids of different videos apart), -1 elsewhere; set for llm methods with
    #: ``wants_frame_slots`` (FrameFusion), handed to them as ``extras["frame_slots"]`` of their rows
    frame_slots: torch.Tensor | None = None
    #: [B, S] long: the frames stage's group of each row (-1: none), and the rows each group keeps
    #: in the llm stage (FramesPlan.groups / group_keep, ids unique within the request)
    groups: torch.Tensor | None = None
    group_keep: list[int] | None = None
    #: [B, S] long: for each row that an llm-stage method must keep, its rank among them (MustDrop's
    #: key set, ranked by the vision tower's [CLS] attention), -1 elsewhere; handed to the method as
    #: ``extras["protected"]`` of its rows
    protected: torch.Tensor | None = None


@dataclass
class PositionRewrite:
    """Place resized frame tokens of one video of sample ``b`` on M-RoPE's (t, h, w) axes.

    rows: [K] sequence rows of the tokens; frame_rows: [K] the row of the first slot of each
    token's source frame (its temporal position is kept); base_row: the video's first slot,
    whose h / w positions are the grid origin; rel: [K, 2] (row, col) in the resized grid.
    """

    b: int
    rows: torch.Tensor
    frame_rows: torch.Tensor
    base_row: int
    rel: torch.Tensor

    def apply(self, pos: torch.Tensor) -> None:
        """Rewrite the last three (t, h, w) position rows of ``pos`` [P, B, S] in place."""
        t, h, w = pos.shape[0] - 3, pos.shape[0] - 2, pos.shape[0] - 1
        rel = self.rel.to(pos.device)
        pos[t, self.b, self.rows] = pos[t, self.b, self.frame_rows]
        pos[h, self.b, self.rows] = pos[h, self.b, self.base_row] + rel[:, 0]
        pos[w, self.b, self.rows] = pos[w, self.b, self.base_row] + rel[:, 1]


def default_positions(
    position_ids: torch.Tensor | None, b: int, s: int, past: int | None, device: torch.device,
    segs: CacheSegments | None, dims: int = 1,
) -> torch.Tensor:
    """[P, B, S] positions: the given ones, else continuing after the unpruned prefix.

    Without position ids the unwrapped model counts from the cache length; after a removal
    the cache is shorter than the prompt, so the count continues from the prompt's own
    positions instead (kept on the cache by the engine).
    """
    if position_ids is not None:
        pos = position_ids.to(device)
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() == 2:
            pos = pos[None].expand(dims, -1, -1)
        return pos.expand(pos.shape[0], b, s) if pos.shape[1] == 1 and b > 1 else pos
    ar = torch.arange(s, device=device)
    if segs is not None:
        return segs.next_pos[:, :, None] + ar
    return (ar + (past or 0)).view(1, 1, s).expand(dims, b, s)


@dataclass
class LMSpec:
    """What the engine needs to know about one language model (the adapter fills it in).

    rope_positions(pos [P,B,S]) -> what the rotary module takes; layer_position_ids(pos) ->
    the ``position_ids`` kwarg the decoder layers take; apply_rope(q, k, cos, sin) -> (q, k).
    default_positions(pos_ids_or_None, B, S, past_len, device) -> [P,B,S] positions exactly as
    the unwrapped model would build them. take_injections(kwargs, embeds) pops the language
    model's own extra inputs that add features to rows after its first layers (Qwen3-VL's
    DeepStack) and returns them as :attr:`Rows.inject` [n, B, S, D] (None when the call has none).
    """

    lm: torch.nn.Module
    layers: torch.nn.ModuleList
    family: str
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    default_positions: Callable[..., torch.Tensor] = default_positions
    rope_positions: Callable[[torch.Tensor], torch.Tensor] = lambda p: p[0]
    layer_position_ids: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p[0]
    #: rotary(x, rope positions, key) -> (cos, sin) for the layers of that key (Gemma 3: one table
    #: per layer type); None: ``lm.rotary_emb(x, rope positions)`` for every layer
    rotary: Callable[..., Any] | None = None
    #: the key of each decoder layer's rotary table (``rotary``); None for all by default
    rotary_key: Callable[[int], Any] = lambda i: None
    #: window(i) -> the columns decoder layer i attends back over (a sliding-window layer: a row sees
    #: the keys less than that many columns before it, as transformers' sliding mask), None: all. After
    #: a removal the window counts the rows that layer holds (its cache keeps the last window - 1)
    window: Callable[[int], int | None] = lambda i: None
    take_injections: Callable[[dict[str, Any], torch.Tensor], torch.Tensor | None] | None = None
    #: layer_mask(idx, mask, q_valid [B, q]) -> the mask layer idx takes instead of the attention
    #: mask (Qwen3.5's linear-attention layers take the 2-D padding mask of the newest rows)
    layer_mask: Callable[[int, Any, torch.Tensor], Any] | None = None


@functools.lru_cache(maxsize=None)
def _cache_keyword_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_keyword(layer: torch.nn.Module) -> str:
    """transformers renamed the decoder layers' ``past_key_values`` to ``cache`` in 5.2x."""
    return _cache_keyword_of(type(layer))


# the language model's output: a MoE model's forward reads ``router_logits`` from it (None here, as for
# any model: output_router_logits is refused)
_OUTPUT_CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def _pop_cache(kwargs: dict[str, Any]) -> Any:
    """The KV cache, under either of its transformers 5.x names."""
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


class PrunedDecoder:
    """The replacement forward of one language model instance."""

    def __init__(self, spec: LMSpec, state: Any, attn_impl: Callable[[], str],
                 pending: Callable[[], Pending | None] = lambda: None, bypassed: Callable[[], bool] = lambda: False) -> None:
        self.spec = spec
        self.state = state
        self.attn_impl = attn_impl
        self._pending = pending
        self._bypassed = bypassed
        self._local = threading.local()  # a pending replaced for part of one call (:meth:`_split_prompt`)

    # ---- helpers ----------------------------------------------------------------------------
    @property
    def pending(self) -> Pending | None:
        """What the adapter learnt about the calling thread's current prefill (None: nothing)."""
        override = getattr(self._local, "pending", None)
        return override if override is not None else self._pending()

    @property
    def bypass(self) -> bool:
        """True while the calling thread runs the model unpruned (frame scoring inside a request)."""
        return self._bypassed()

    @property
    def llm_method(self) -> Any:
        return self.state.methods.get("llm")

    @property
    def decode_method(self) -> Any:
        """The configured method that prunes the KV cache during decoding (docs/decode-kv.md), or None."""
        if self.bypass:
            return None
        return next((m for m in self.state.methods.values() if getattr(m, "decode_kv", False)), None)

    def prune_points(self) -> list[int]:
        m = self.llm_method
        if m is None or self.bypass:
            return []
        return sorted(set(m.prune_layers(len(self.spec.layers))))

    def check_depth(self) -> None:
        """Refuse, at wrap time, an llm-stage or decode-time method whose layers lie beyond this
        language model's depth (the methods' own checks, which would otherwise first fail at the call)."""
        n = len(self.spec.layers)
        self.prune_points()
        if (m := self.decode_method) is not None:
            m.decode_final_rows_from(n)
            m.decode_step_layer(n)

    def project_qk(self, layer_idx: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The q/k the attention of ``layer_idx`` computes for given hidden states (GQA repeated).

        ``project(hidden [B, S, D], pos, rope=True, q_rows=None)``: ``q_rows`` [B, R] projects
        only those query rows (q is [B, H, R, d]; keys always cover all S rows). ``rope`` True /
        False applies RoPE at ``pos`` to both or neither; ``rope="keys"`` returns
        (q, k, k_rope): q and k without RoPE and the keys with it, from one projection.
        """
        layer = self.spec.layers[layer_idx]
        spec = self.spec

        def rotary(x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self._rotary(x, pos[None] if pos.dim() == 2 else pos, spec.rotary_key(layer_idx))

        def project(
            hidden: torch.Tensor, pos: torch.Tensor, rope: bool | str = True, q_rows: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, ...]:
            if rope not in (True, False, "keys"):
                raise ValueError(f"project_qk rope must be True, False or 'keys', got {rope!r}")
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            b, s, dim = x.shape
            hd = attn.head_dim
            xq = x if q_rows is None else torch.gather(x, 1, q_rows[..., None].expand(b, q_rows.shape[1], dim))
            q = attn.q_proj(xq)
            heads = getattr(getattr(attn, "config", None), "num_attention_heads", None)
            if heads is not None and q.shape[-1] == 2 * heads * hd:  # a gated query (Qwen3.5): each head's query half
                q = q.view(b, xq.shape[1], heads, 2 * hd)[..., :hd]
            q = q.reshape(b, xq.shape[1], -1, hd)
            k = attn.k_proj(x).view(b, s, -1, hd)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            rep = q.shape[1] // k.shape[1]
            repeat = (lambda t: t.repeat_interleave(rep, dim=1)) if rep > 1 else (lambda t: t)
            if rope is False:
                return q, repeat(k)
            cos, sin = rotary(x, pos)
            if q_rows is None and rope is True:
                q, k = spec.apply_rope(q, k, cos, sin)
                return q, repeat(k)
            k_rope = spec.apply_rope(k[:, :1], k, cos, sin)[1]  # one head in q's slot: only k's rotation is used
            if rope == "keys":
                return q, repeat(k), repeat(k_rope)
            pos3 = pos[None] if pos.dim() == 2 else pos
            q_pos = torch.gather(pos3, 2, q_rows[None].expand(pos3.shape[0], b, q_rows.shape[1]))
            q = spec.apply_rope(q, q[:, :1], *rotary(xq, q_pos))[0]
            return q, repeat(k_rope)

        return project

    def attention_layer(self, layer: int) -> int:
        """The decoder layer whose attention (queries, keys, scaling) a method reading ``layer``'s gets:
        ``layer`` itself, or, where it is a linear-attention layer of a hybrid model (Qwen3.5's Gated
        DeltaNet: no softmax attention, no keys), the nearest full-attention layer before it (the first
        full-attention layer when none precedes). Its projections are applied to the rows the method
        sees, so a score means "what that layer's attention would pay these rows"."""
        full = [i for i, m in enumerate(self.spec.layers) if getattr(m, "self_attn", None) is not None]
        if layer in full or not full:
            return layer
        before = [i for i in full if i < layer]
        return before[-1] if before else full[0]

    def _n_keep(self, layer: int, rows: Rows) -> torch.Tensor:
        m = self.llm_method
        n_vis = (rows.visual & rows.valid).sum(1)
        n_img = (self.pending.images_per_sample if self.pending and self.pending.images_per_sample else None)
        out = []
        for b, n in enumerate(n_vis.tolist()):
            orig = self.pending.visual_in[b] if self.pending and self.pending.visual_in else n
            images = n_img[b] if n_img else 1
            if hasattr(m, "n_keep_at"):
                out.append(m.n_keep_at(layer, orig, n, images))
            else:
                out.append(m.n_keep(n, images, orig))
        return torch.tensor(out, dtype=torch.long, device=rows.valid.device)

    def _context(self, layer: int, rows: Rows, prune_before: int, previous: torch.Tensor | None = None,
                 memo: dict[str, Any] | None = None, first: Rows | None = None) -> LayerContext:
        extras = {"family": self.spec.family, "prune_before": prune_before, "origin": rows.origin,
                  "images": self.pending.images_per_sample if self.pending else None, "final_norm": self.spec.lm.norm,
                  "prefill_memo": {} if memo is None else memo}
        pending = self.pending

        def follow(table: torch.Tensor) -> torch.Tensor:  # an input-layout [B, S] table, through removals (-1: padding)
            table = table.to(rows.origin.device)
            return torch.gather(table, 1, rows.origin.clamp(min=0)).masked_fill(rows.origin < 0, -1)

        if pending is not None and pending.frame_slots is not None:  # each row's slot
            extras["frame_slots"] = follow(pending.frame_slots)
        if pending is not None and pending.groups is not None:  # the frames stage's groups
            extras["groups"], extras["group_keep"] = follow(pending.groups), pending.group_keep
        if pending is not None and pending.protected is not None:  # rows the method must keep (MustDrop's key set)
            extras["protected"] = follow(pending.protected)
        if first is not None:  # the rows entering layer 0 (methods with needs_input_rows)
            extras.update(input_hidden=first.hidden, input_visual=first.visual & first.valid, input_text=first.text,
                          input_origin=first.origin)
        if previous is not None:  # the same rows entering the layer before (methods with needs_previous_hidden)
            extras["previous_hidden"] = previous[:, : rows.hidden.shape[1]]
            extras["previous_project_qk"] = self.project_qk(self.attention_layer(layer - 1))
        read = self.attention_layer(layer)
        return LayerContext(
            layer=layer,
            hidden=rows.hidden,
            valid=rows.valid,
            visual=rows.visual & rows.valid,
            text=rows.text,
            positions=rows.pos if rows.pos.shape[0] > 1 else rows.pos[0],
            sizes=rows.sizes,
            n_keep=self._n_keep(prune_before, rows),
            layer_module=self.spec.layers[read],
            project_qk=self.project_qk(read),
            extras=extras,
        )

    def _select(self, layer: int, rows: Rows, prune_before: int, previous: torch.Tensor | None = None,
                memo: dict[str, Any] | None = None, first: Rows | None = None
                ) -> tuple[list[Reduction] | None, float, float]:
        """The method's reductions (None: it changes nothing at this layer), with the wall-clock and
        process CPU seconds they took. ``previous``: the hidden states of the same rows entering layer
        ``layer - 1``, when kept; ``memo``: what the method keeps across the layers of this prefill;
        ``first``: the rows entering layer 0, when the method asks for them."""
        t0, c0 = time.perf_counter(), time.process_time()
        pending = self.pending
        # tokens generated after the prompt (use_cache=False re-runs them) sit in the last rows of
        # every sample (a vision-stage removal left-pads, so they stay last): the method chooses from
        # the prompt's rows, exactly as with a cache. Counted on the input's width, not the rows'
        extra = pending.visual.shape[1] - pending.prompt if pending is not None and pending.prompt is not None else 0
        extra = max(0, min(extra, int(rows.valid.sum(1).min())))
        with torch.no_grad():
            if extra:
                cut = rows.valid.shape[1] - extra
                head = Rows(rows.hidden[:, :cut], rows.pos[..., :cut], rows.valid[:, :cut], rows.visual[:, :cut],
                            rows.sizes[:, :cut], rows.origin[:, :cut])
                if first is not None:
                    w = first.valid.shape[1] - extra
                    first = Rows(first.hidden[:, :w], first.pos[..., :w], first.valid[:, :w], first.visual[:, :w],
                                 first.sizes[:, :w], first.origin[:, :w])
                reds = self.llm_method.select(self._context(layer, head, prune_before, previous, memo, first))
                if reds is not None:
                    reds = [_append_rows(r, rows, i, cut) for i, r in enumerate(reds)]
            else:
                reds = self.llm_method.select(self._context(layer, rows, prune_before, previous, memo, first))
        return reds, time.perf_counter() - t0, time.process_time() - c0

    def _rotary(self, x: torch.Tensor, pos: torch.Tensor, key: Any) -> Any:
        """(cos, sin) at positions ``pos`` [P, B, S] for the layers of rotary ``key``."""
        spec = self.spec
        if spec.rotary is None:
            return spec.lm.rotary_emb(x, spec.rope_positions(pos))
        return spec.rotary(x, spec.rope_positions(pos), key)

    def _pe(self, x: torch.Tensor, pos: torch.Tensor) -> dict[Any, Any]:
        """Every layer's position embeddings at ``pos``, by rotary key (one table unless the spec has several)."""
        keys = dict.fromkeys(self.spec.rotary_key(i) for i in range(len(self.spec.layers)))
        return {k: self._rotary(x, pos, k) for k in keys}

    # ---- masks ------------------------------------------------------------------------------
    def _mask(self, key_valid: torch.Tensor, key_bias: torch.Tensor, q_valid: torch.Tensor, dtype: torch.dtype,
              blocks: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None) -> Any:
        """The fastest exact mask of the newest ``q`` rows against the ``kv`` keys of a segment
        (:func:`segment_mask` for this model's attention implementation)."""
        return segment_mask(self.attn_impl(), key_valid, key_bias, q_valid, dtype, blocks, window)

    def _blocks_of(self, rows: Rows) -> torch.Tensor | None:
        """[B, S] the bidirectional block id of each row (``Pending.blocks`` followed to the kept rows)."""
        pending = self.pending
        if pending is None or pending.blocks is None:
            return None
        blocks = pending.blocks.to(rows.origin.device)
        return torch.gather(blocks, 1, rows.origin.clamp(min=0)).masked_fill(rows.origin < 0, -1)

    def _visible(self, idx: int, cache: Any, kv: int, q: int) -> tuple[int, int | None]:
        """(keys, window) of decoder layer ``idx`` when the newest ``q`` rows end a segment of ``kv`` keys:
        the last keys the layer attends over (a sliding-window cache layer, transformers'
        ``DynamicSlidingWindowLayer``, returns only its last window - 1 cached keys before the new rows)
        and the window its mask must still apply (None: every returned key is within it)."""
        window = self.spec.window(idx)
        if window is None:
            return kv, None
        layers = getattr(cache, "layers", None)
        cached = layers[idx] if layers is not None and idx < len(layers) else None
        keys = min(kv - q, window - 1) + q if getattr(cached, "is_sliding", False) else kv
        return keys, window if keys > window else None

    def _layer_masks(self, cache: Any, key_valid: list[torch.Tensor], key_bias: list[torch.Tensor], layer_segment: list[int],
                     q_valid: torch.Tensor, dtype: torch.dtype,
                     blocks: tuple[torch.Tensor, list[torch.Tensor]] | None = None) -> list[Any]:
        """Each decoder layer's mask when the newest rows (``q_valid`` [B, q]) end its segment's keys
        (``key_valid`` / ``key_bias`` per segment); layers that see the same keys share one.
        ``blocks``: (the new rows' block ids, each segment's key block ids)."""
        q = q_valid.shape[1]
        built: dict[tuple[int, int, int | None], Any] = {}
        out = []
        for idx, seg in enumerate(layer_segment):
            n, window = self._visible(idx, cache, key_valid[seg].shape[1], q)
            if (seg, n, window) not in built:
                pair = None if blocks is None else (blocks[0], blocks[1][seg][:, -n:])
                built[seg, n, window] = self._mask(key_valid[seg][:, -n:], key_bias[seg][:, -n:], q_valid, dtype, pair, window)
            out.append(built[seg, n, window])
        return out

    # ---- the forward ------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> MoeModelOutputWithPast:
        spec = self.spec
        lm = spec.lm
        cache = _pop_cache(kwargs)
        inject = spec.take_injections(kwargs, inputs_embeds if inputs_embeds is not None else input_ids) \
            if spec.take_injections is not None else None
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("output_router_logits"):
            raise ValueError(
                "vlm_prune does not return output_attentions / output_hidden_states / output_router_logits: after a "
                "removal each layer holds different rows. Use model.vlm_prune.last_rows (the input row of every output row) with the "
                "logits, or unwrap the model (vlm_prune.unwrap) to inspect attentions and hidden states"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = lm.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = lm.config.use_cache
        if use_cache and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=lm.config)
        check_cache(cache)
        b, s, _ = inputs_embeds.shape
        device = inputs_embeds.device
        segs = segments_of(cache)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.dim() == 2:
            new_valid = attention_mask[:, -s:].bool().to(device)
        else:
            new_valid = torch.ones(b, s, dtype=torch.bool, device=device)

        pending = self.pending
        if (segs is None and past == 0 and pending is not None and pending.prompt is not None and pending.prompt < s
                and self.decode_method is not None):  # tokens after the prompt, under decode-time KV pruning
            hidden = self._split_prompt(inputs_embeds, position_ids, new_valid, cache, use_cache, kwargs, inject, pending)
        elif (segs is not None or past > 0) and pending is not None:  # a prompt after a cached prefix
            if segs is None:
                segs = self._foreign_segments(cache, attention_mask, b, past, position_ids, device)
            pos = spec.default_positions(position_ids, b, s, None, device, segs)
            hidden = self._prefill(inputs_embeds, pos, new_valid, cache, True, kwargs, prefix=segs, inject=inject)
        elif segs is not None or past > 0:
            pos = spec.default_positions(position_ids, b, s, past if segs is None else None, device, segs)
            hidden = self._decode(inputs_embeds, pos, new_valid, cache, segs, kwargs)
        else:
            pos = spec.default_positions(position_ids, b, s, 0, device, None)
            hidden = self._prefill(inputs_embeds, pos, new_valid, cache, use_cache, kwargs, inject=inject)
        hidden = lm.norm(hidden)
        return MoeModelOutputWithPast(last_hidden_state=hidden, **{_OUTPUT_CACHE_FIELD: cache if use_cache else None})

    def _run_layer(self, idx: int, hidden: torch.Tensor, mask: Any, pe: Any, pos: torch.Tensor, cache: Any, use_cache: bool,
                   kwargs: dict, q_valid: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.spec.layers[idx]
        if self.spec.layer_mask is not None:
            mask = self.spec.layer_mask(idx, mask, q_valid)
        # FlashAttention reads position ids only to find packed sequences (gaps after a removal
        # look like packing); without a mask every row is real, so the dense kernel is right
        flash_dense = mask is None and "flash" in self.attn_impl()
        out = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=pe[self.spec.rotary_key(idx)],
            position_ids=None if flash_dense else self.spec.layer_position_ids(pos),
            use_cache=use_cache,
            **{_cache_keyword(layer): cache},
            **kwargs,
        )
        return out[0] if isinstance(out, tuple) else out

    def _split_prompt(self, embeds: torch.Tensor, position_ids: torch.Tensor | None, valid: torch.Tensor, cache: Any,
                      use_cache: bool, kwargs: dict, inject: torch.Tensor | None, pending: Pending) -> torch.Tensor:
        """A prompt followed by tokens after it (generate(use_cache=False) re-runs the generated tokens,
        assisted decoding checks its first draft in the prefill) while a method prunes the KV cache
        during decoding: the prompt runs as a prefill, then the later tokens as decode steps on its cache
        (a private one when the call keeps none), so they see exactly what cached decode steps see."""
        p = pending.prompt
        b, s = valid.shape
        if cache is None or not use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.spec.lm.config)
        pos = self.spec.default_positions(position_ids, b, s, 0, embeds.device, None)
        head = replace(pending, prompt=None, visual=pending.visual[:, :p],
                       keep=None if pending.keep is None else pending.keep[:, :p],
                       sizes=None if pending.sizes is None else pending.sizes[:, :p],
                       blocks=None if pending.blocks is None else pending.blocks[:, :p])
        self._local.pending = head
        try:
            hidden = self._prefill(embeds[:, :p], pos[..., :p], valid[:, :p], cache, True, kwargs,
                                   inject=None if inject is None else inject[:, :, :p])
        finally:
            self._local.pending = None
        pending.visual_in = head.visual_in
        rows = self.state.last_rows
        tail = self._decode(embeds[:, p:], pos[..., p:], valid[:, p:], cache, segments_of(cache), kwargs)
        later = torch.where(valid[:, p:], torch.arange(p, s, device=valid.device), -1)
        self.state.last_rows = torch.cat([rows, later.to(rows.device)], 1)
        return torch.cat([hidden, tail], 1)

    def _foreign_segments(self, cache: Any, attention_mask: torch.Tensor | None, b: int, past: int,
                          position_ids: torch.Tensor | None, device: torch.device) -> CacheSegments:
        """Bookkeeping for a cache filled elsewhere (every layer saw every row; padding from the
        2-D attention mask when it covers the cached columns)."""
        n = len(self.spec.layers)
        kv = [cache.get_seq_length(i) for i in range(n)]
        valid = [torch.ones(b, k, dtype=torch.bool, device=device) for k in kv]
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= past:
            valid = [attention_mask[:, :k].bool().to(device) for k in kv]
        nxt = self.spec.default_positions(position_ids, b, 1, past, device, None)[:, :, 0]
        segs = CacheSegments(list(range(n)), valid, [torch.zeros(b, k, device=device) for k in kv],
                             next_pos=nxt, seen=kv[0], prompt=kv[0])
        install(cache, segs)
        return segs

    def _prefill(self, embeds: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, cache: Any, use_cache: bool,
                 kwargs: dict, prefix: CacheSegments | None = None, inject: torch.Tensor | None = None) -> torch.Tensor:
        """A prompt's forward: the vision stage's removal before layer 0, the llm stage between layers.

        ``prefix``: the bookkeeping of a cache that already holds earlier tokens (a system prompt, an
        earlier turn): the new rows attend to its keys, the vision / frames stage prunes the new
        images as usual; the llm stage does not run (its scores would not see the cached rows), which
        is warned once and reported in the stage records."""
        spec, b, s = self.spec, embeds.shape[0], embeds.shape[1]
        pending = self.pending
        device = embeds.device
        visual = pending.visual.to(device) if pending is not None else torch.zeros(b, s, dtype=torch.bool, device=device)
        sizes = pending.sizes.to(device).float() if pending is not None and pending.sizes is not None else torch.ones(b, s, device=device)
        origin = torch.where(valid, torch.arange(s, device=device), -1)
        if pending is not None and pending.not_visual is not None:
            visual = visual & ~pending.not_visual(embeds).to(device)
        if pending is not None and pending.position_rewrites:
            pos = pos.clone()
            for rewrite in pending.position_rewrites:
                rewrite.apply(pos)
        rows = Rows(embeds, pos, valid, visual, sizes, origin, inject)
        visual_in = visual & valid
        stats_in = visual_in.sum(1).tolist()
        if pending is not None:
            pending.visual_in = stats_in
        records = list(pending.records) if pending is not None else []
        vision_renumbered = False
        if pending is not None and pending.keep is not None:
            keep = pending.keep.to(device)
            reds = [Reduction(torch.nonzero(valid[i] & keep[i]).squeeze(1)) for i in range(b)]
            kept = apply(rows, reds)
            if pending.renumber and kept is not rows:
                if rows.pos.shape[0] > 1:
                    raise ValueError("Pending.renumber renumbers 1-D positions; this model's multi-axis positions (M-RoPE) "
                                     "must keep their ids")
                kept = replace(kept, pos=renumbered(kept.pos, kept.valid))
                vision_renumbered = True
            rows = kept

        if prefix is not None:
            return self._after_prefix(rows, pos, stats_in, records, prefix, cache, kwargs, vision_renumbered)
        points = self.prune_points()
        method = self.llm_method
        early = bool(getattr(method, "scores_from_previous_layer", False))
        # DART reads layer L-1's keys and layer L's input: keep the rows entering L-1 for the context
        keep_previous = bool(getattr(method, "needs_previous_hidden", False))
        previous: dict[int, torch.Tensor] = {}
        # SparseVLM picks its text raters from the rows entering layer 0
        first = rows if getattr(method, "needs_input_rows", False) else None
        n_layers = len(spec.layers)
        layer_segment: list[int] = []
        key_valid: list[torch.Tensor] = []
        key_bias: list[torch.Tensor] = []
        planned: dict[int, tuple[list[Reduction] | None, float, float]] = {}
        renumber = (bool(getattr(method, "renumber_positions", False)) and bool(points)) or vision_renumbered
        segment_next: list[torch.Tensor] = []
        key_visual: list[torch.Tensor] = []
        key_origin: list[torch.Tensor] = []  # each segment's input row per key (decode-time KV pruning)
        layer_visual: list[torch.Tensor] = []  # visual rows each layer saw, per sample
        layout_start = 0  # the first key segment holding the current rows' layout
        mask = pe = None
        memo: dict[str, Any] = {}  # what the method keeps across the layers of this prefill (FrameFusion's phases)
        for idx in range(n_layers):
            reds = None
            entering_before = previous.pop(idx, None)  # (never held past the layer it was kept for)
            if idx in points and (rows.visual & rows.valid).any():
                reds, secs, cpu_secs = planned.pop(idx) if idx in planned else \
                    self._select(idx, rows, idx, entering_before, memo, first)
            if reds is not None:  # None: the method changes nothing before this layer (no record, same mask)
                before = (rows.visual & rows.valid).sum(1).tolist()
                merges = merged_into(rows, reds, visual_in) if any(r.merged_into is not None for r in reds) else None
                if getattr(method, "drops_earlier_keys", False):  # the layers since the last removal (same rows)
                    for j in range(layout_start, len(key_valid)):
                        key_valid[j] = earlier_keys_dropped(key_valid[j], reds)
                rows = apply(rows, reds)
                layout_start = len(key_valid)
                if renumber and getattr(method, "renumber_positions", False):
                    rows = replace(rows, pos=renumbered(rows.pos, rows.valid))
                records.append({
                    "stage": "llm", "method": method.name, "layer": idx,
                    "tokens_in": before, "tokens_out": (rows.visual & rows.valid).sum(1).tolist(), "seconds": secs,
                    "cpu_seconds": cpu_secs,
                })
                if merges is not None:
                    records[-1]["merged_into"] = merges
                read = {r: self.attention_layer(r) for r in {idx - 1 if early else idx} | ({idx - 1} if keep_previous else set())
                        if r >= 0}
                if any(r != f for r, f in read.items()):  # linear-attention layers read through a full-attention one
                    records[-1]["attention_layers"] = {r: f for r, f in sorted(read.items()) if r != f}
                mask = None
            if mask is None:
                key_valid.append(rows.valid)
                key_visual.append(rows.visual & rows.valid)
                key_origin.append(rows.origin)
                key_bias.append(torch.log(rows.sizes.float()).masked_fill(~rows.valid, 0.0))
                blocks = self._blocks_of(rows)
                mask = self._mask(rows.valid, key_bias[-1], rows.valid, rows.hidden.dtype,
                                  None if blocks is None else (blocks, blocks))
                windowed: dict[int, Any] = {}  # the sliding-window layers' masks (a fresh cache returns every key)
                pe = self._pe(rows.hidden, rows.pos)
                segment_next.append(rows.pos.masked_fill(~rows.valid, -1).amax(-1) + 1)
            layer_segment.append(len(key_valid) - 1)
            layer_visual.append((rows.visual & rows.valid).sum(1))
            if early and (idx + 1) in points and (rows.visual & rows.valid).any():
                planned[idx + 1] = self._select(idx, rows, idx + 1, memo=memo, first=first)
            if keep_previous and (idx + 1) in points:
                previous[idx + 1] = rows.hidden
            layer_mask = mask
            if (window := spec.window(idx)) is not None and rows.valid.shape[1] > window:
                if window not in windowed:
                    windowed[window] = self._mask(rows.valid, key_bias[-1], rows.valid, rows.hidden.dtype,
                                                  None if blocks is None else (blocks, blocks), window)
                layer_mask = windowed[window]
            rows = replace(rows, hidden=injected(rows, idx, self._run_layer(idx, rows.hidden, layer_mask, pe, rows.pos, cache, use_cache, kwargs, rows.valid)))

        if cache is not None and use_cache:
            # tokens after the prompt (assisted decoding's first draft, checked in the prefill) were not
            # chosen from and sit last in every segment: they can be cropped like any later token
            prompt = pending.prompt if pending is not None and pending.prompt is not None else s
            segs = CacheSegments(layer_segment, key_valid, key_bias, next_pos=pos[:, :, -1] + 1, seen=s, prompt=prompt,
                                 segment_next_pos=segment_next if renumber else None, key_visual=key_visual)
            decode = self._keep_final_rows(segs, key_origin, rows.origin, cache)
            install(cache, segs)
        else:
            decode = None
        self.state.last_stats = _stats(stats_in, rows, records, layer_visual, self.state)
        if decode is not None:
            self.state.last_stats["decode"] = decode
        self.state.last_rows = rows.origin
        return rows.hidden

    def _keep_final_rows(self, segs: CacheSegments, key_origin: list[torch.Tensor], final: torch.Tensor,
                         cache: Any) -> dict | None:
        """Decode-time KV pruning's output-aware cache (MustDrop): from the decode method's layer F on,
        every layer's keys are limited to the prompt rows that reached the last layer (``final`` [B, k],
        their input rows). Layers sharing a segment share its restricted copy, whose KV entries are then
        gathered out of their layers' tensors (:meth:`_compact`). Returns last_stats' "decode" entry: the
        layer F and, per layer, the visual keys decode steps attend to per sample."""
        method = self.decode_method
        first = method.decode_final_rows_from(len(self.spec.layers)) if method is not None else None
        if first is None:
            return None
        b = final.shape[0]
        width = max(int(o.max()) + 1 for o in key_origin) if key_origin else 0
        reached = torch.zeros(b, max(width, int(final.max()) + 1), dtype=torch.bool, device=final.device)
        reached.scatter_(1, final.clamp(min=0), final >= 0)
        restricted: dict[int, int] = {}
        last = segs.layer_segment[-1]  # holds the final rows: a renumbered restricted layer continues from their count
        for idx in range(first, len(segs.layer_segment)):
            seg = segs.layer_segment[idx]
            if seg not in restricted:
                origin = key_origin[seg].to(reached.device)
                keep = torch.gather(reached, 1, origin.clamp(min=0)) & (origin >= 0)
                valid = segs.key_valid[seg] & keep.to(segs.key_valid[seg].device)
                if torch.equal(valid, segs.key_valid[seg]):
                    restricted[seg] = seg
                else:
                    segs.key_valid.append(valid)
                    segs.key_bias.append(segs.key_bias[seg].masked_fill(~valid, 0.0))
                    segs.key_visual.append(segs.key_visual[seg] & valid)
                    if segs.segment_next_pos is not None:
                        segs.segment_next_pos.append(segs.segment_next_pos[last])
                    restricted[seg] = len(segs.key_valid) - 1
            segs.layer_segment[idx] = restricted[seg]
        compacted = [self._compact(cache, segs, j) for j in sorted(set(restricted.values()) - set(restricted))]
        return {"method": method.name, "from_layer": first, "compacted": all(compacted),
                "visual_keys_per_layer": [(segs.key_visual[j] & segs.key_valid[j]).sum(1).tolist() for j in segs.layer_segment]}

    @staticmethod
    def _compact(cache: Any, segs: CacheSegments, seg: int) -> bool:
        """Free the masked KV entries of segment ``seg``: each sample's valid keys, in order, left-padded
        to the longest, gathered out of the key / value tensors of every layer on the segment, and the
        bookkeeping gathered alike. Only plain dynamic layers (transformers' ``DynamicLayer``) are edited;
        others (sliding, quantized, offloaded) keep their entries masked. True when compacted."""
        from transformers.cache_utils import DynamicLayer

        layers = [i for i, j in enumerate(segs.layer_segment) if j == seg]
        cached = getattr(cache, "layers", None)
        if cached is None or any(type(cached[i]) is not DynamicLayer or not cached[i].is_initialized for i in layers):
            return False
        valid = segs.key_valid[seg]
        b, kv = valid.shape
        n = int(valid.sum(1).max())
        if any(cached[i].keys.shape[2] != kv for i in layers):
            return False
        src = torch.argsort(valid.int(), dim=1, stable=True)[:, kv - n:]  # padding first, then the valid keys in order
        for i in layers:
            layer = cached[i]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                index = src.to(t.device)[:, None, :, None].expand(b, t.shape[1], n, t.shape[3])
                setattr(layer, name, torch.gather(t, 2, index))
        segs.key_valid[seg] = torch.gather(valid, 1, src)
        segs.key_bias[seg] = torch.gather(segs.key_bias[seg], 1, src.to(segs.key_bias[seg].device))
        segs.key_visual[seg] = torch.gather(segs.key_visual[seg], 1, src.to(segs.key_visual[seg].device))
        return True

    def _after_prefix(self, rows: Rows, pos: torch.Tensor, stats_in: list[int], records: list[dict[str, Any]],
                      prefix: CacheSegments, cache: Any, kwargs: dict, renumbered_rows: bool) -> torch.Tensor:
        """The rest of a prompt that continues a cached prefix: every layer attends to its segment's
        cached keys and the (vision-reduced) new rows; the bookkeeping grows by the new rows.
        ``renumbered_rows``: the vision stage renumbered the kept rows (decode continues after them)."""
        method = self.llm_method
        if method is not None and not self.bypass and (rows.visual & rows.valid).any():
            _warn_once(f"vlm_prune: {method.name} (llm stage) does not prune images that follow a prefix already in the "
                       "KV cache (its scores would not see the cached rows); the vision / frames stages do. Put the "
                       "images in the first call's prompt to prune them in the LLM as well")
            n = (rows.visual & rows.valid).sum(1).tolist()
            records.append({"stage": "llm", "method": method.name, "skipped": "after a cached prefix",
                            "tokens_in": n, "tokens_out": n, "seconds": 0.0})
        s = pos.shape[-1]
        bias = torch.log(rows.sizes.float()).masked_fill(~rows.valid, 0.0)
        key_valid = [torch.cat([kv, rows.valid.to(kv.device)], 1) for kv in prefix.key_valid]
        key_bias = [torch.cat([kb, bias.to(kb.device)], 1) for kb in prefix.key_bias]
        prefix.key_visual = [torch.cat([kv, (rows.visual & rows.valid).to(kv.device)], 1) for kv in prefix.key_visual]
        prefix.decode_state = {}  # a new prompt: a per-step decode method starts afresh
        blocks = self._blocks_of(rows)  # the new rows' blocks; cached keys belong to none
        masks = self._layer_masks(cache, key_valid, key_bias, prefix.layer_segment, rows.valid, rows.hidden.dtype,
                                  None if blocks is None else (blocks, [torch.cat(
                                      [blocks.new_full((kv.shape[0], kv.shape[1] - blocks.shape[1]), -1), blocks], 1)
                                      for kv in key_valid]))
        if prefix.segment_next_pos is not None:  # the prefix was renumbered: continue each segment's count
            ar = rows.pos - pos[:, :, :1]
            seg_pos = [nxt[:, :, None] + ar for nxt in prefix.segment_next_pos]
            prefix.segment_next_pos = [p + s for p in prefix.segment_next_pos]
        else:
            seg_pos = [rows.pos] * len(key_valid)
        pes = [self._pe(rows.hidden, p) for p in seg_pos]
        hidden = rows.hidden
        layer_visual = []
        for idx in range(len(self.spec.layers)):
            seg = prefix.layer_segment[idx]
            hidden = injected(rows, idx, self._run_layer(idx, hidden, masks[idx], pes[seg], seg_pos[seg], cache, True, kwargs, rows.valid))
            layer_visual.append((rows.visual & rows.valid).sum(1))
        prefix.key_valid, prefix.key_bias = key_valid, key_bias
        prefix.next_pos = (rows.pos if renumbered_rows else pos)[:, :, -1] + 1
        prefix.seen += s
        prefix.prompt = prefix.seen
        rows = replace(rows, hidden=hidden)
        self.state.last_stats = _stats(stats_in, rows, records, layer_visual, self.state)
        self.state.last_rows = rows.origin
        return hidden

    def _decode(self, embeds: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, cache: Any, segs: CacheSegments | None, kwargs: dict) -> torch.Tensor:
        spec = self.spec
        b, s = valid.shape
        if segs is None:  # a cache filled elsewhere: every layer saw every row
            n = len(spec.layers)
            kv = [cache.get_seq_length(i) for i in range(n)]
            segs = CacheSegments(
                list(range(n)),
                [torch.ones(b, k, dtype=torch.bool, device=valid.device) for k in kv],
                [torch.zeros(b, k, device=valid.device) for k in kv],
                next_pos=pos[:, :, 0], seen=kv[0], prompt=kv[0],
            )
            install(cache, segs)
        segs.extend(valid, pos[:, :, -1] + 1)
        masks = self._layer_masks(cache, segs.key_valid, segs.key_bias, segs.layer_segment, valid, embeds.dtype)
        if segs.segment_next_pos is not None:  # renumbered: each segment continues from its own rows
            ar = torch.arange(s, device=valid.device)
            seg_pos = [nxt[:, :, None] + ar for nxt in segs.segment_next_pos]
            segs.segment_next_pos = [p[:, :, -1] + 1 for p in seg_pos]
        else:
            seg_pos = [pos] * len(segs.key_valid)
        pes = [self._pe(embeds, p) for p in seg_pos]
        method = self.decode_method
        step = method.decode_step_layer(len(spec.layers)) if method is not None else None
        if step is not None and s > 1:  # several tokens at once (a new turn's text): never pruned per step
            segs.decode_state = {}
            step = None
        hidden = embeds
        for idx in range(len(spec.layers)):
            seg = segs.layer_segment[idx]
            hidden_in = hidden
            hidden = self._run_layer(idx, hidden, masks[idx], pes[seg], seg_pos[seg], cache, True, kwargs, valid)
            if idx == step:
                masks = self._step_masks(method, idx, hidden_in, seg_pos[seg], cache, segs, valid, masks, embeds.dtype)
        return hidden

    def _step_masks(self, method: Any, layer: int, hidden: torch.Tensor, pos: torch.Tensor, cache: Any,
                    segs: CacheSegments, valid: torch.Tensor, masks: list[Any], dtype: torch.dtype) -> list[Any]:
        """A per-step decode-time KV pruning step (DyCoke): the new row's head-averaged attention in
        ``layer`` (its query projected on the side, the keys read from the layer's cache) goes to
        ``method.decode_step``; the keys it keeps are the only ones layers after ``layer`` attend to in
        this step. The cache itself is untouched, so a later step may choose other keys."""
        seg = segs.layer_segment[layer]
        later = set(segs.layer_segment[layer + 1:])
        if any(not torch.equal(segs.key_valid[j], segs.key_valid[seg]) for j in later):
            raise ValueError(
                f"{method.name}'s decode-time KV pruning needs the decoder layers from {layer} on to hold the same rows, "
                "but an llm-stage method removed rows after it. Use the llm-stage method alone, or turn the decode "
                "stage off")
        attn_mod = getattr(self.spec.layers[layer], "self_attn", None)
        keys = getattr(cache.layers[layer], "keys", None)
        if attn_mod is None or keys is None:
            full = [i for i, m in enumerate(self.spec.layers) if getattr(m, "self_attn", None) is not None]
            raise ValueError(
                f"{method.name}'s decode-time KV pruning reads the attention of decoder layer {layer}, which is not a "
                f"softmax-attention layer with a KV cache in this model (its attention layers: {full}). Choose the "
                "layer so that it reads one of those (DyCoke: layer= one more than such a layer), or turn the decode "
                "stage off")
        q, _ = self.project_qk(layer)(hidden, pos, rope=True)
        key_valid = segs.key_valid[seg]
        if keys.shape[2] != key_valid.shape[1]:
            raise RuntimeError(f"layer {layer} caches {keys.shape[2]} keys but its bookkeeping has {key_valid.shape[1]}")
        from vlm_prune.kernels import attention_to_keys

        scale = getattr(attn_mod, "scaling", None) or q.shape[-1] ** -0.5
        attention = attention_to_keys(q[:, :, -1:], keys.to(q.dtype), key_valid[:, None, :].to(q.device), scale)[:, 0]
        ctx = DecodeStepContext(layer=layer, attention=attention, visual=segs.key_visual[seg], valid=key_valid,
                                state=segs.decode_state)
        with torch.no_grad():
            keep = method.decode_step(ctx)
        if keep is None:
            return masks
        keep = (keep.to(key_valid.device) | ~segs.key_visual[seg]) & key_valid
        kept = [keep if j in later else kv for j, kv in enumerate(segs.key_valid)]
        after = self._layer_masks(cache, kept, segs.key_bias, segs.layer_segment, valid, dtype)
        return masks[: layer + 1] + after[layer + 1:]


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def check_cache(cache: Any) -> None:
    """Refuse caches the pruned decoder cannot keep right (fixed-size ones)."""
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError(
            f"vlm_prune does not support a fixed-size KV cache ({type(cache).__name__}, e.g. generate(..., "
            "cache_implementation='static')): pruned layers hold fewer rows than the prompt. Use the default "
            "dynamic cache (drop cache_implementation), or unwrap the model to use a static cache"
        )


def allowed_keys(key_valid: torch.Tensor, q_valid: torch.Tensor,
                 blocks: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None) -> torch.Tensor:
    """[B, q, kv] bool: which keys each of the newest ``q`` rows (``q_valid`` [B, q]) attends to.

    The new rows are the last ``q`` keys and causality is by row order (rows keep their
    original order): valid keys up to the row itself. As in transformers' own masks, padding
    masks keys, never queries: a right-padding row sees the valid keys before it, a
    left-padding row sees none (eager attention then spreads it evenly over every key, SDPA
    returns zeros). So every row's output is the unwrapped model's; with left padding the last
    padding row predicts the first real token, and the loss and gradients through it match.
    ``blocks`` = (query block ids [B, q], key block ids [B, kv]): a row also sees the valid keys of
    its own block (id >= 0) after it (Gemma 3's bidirectional attention within an image).
    ``window``: a row sees no key ``window`` or more columns before it (a sliding-window layer; as
    transformers' sliding mask, this also bounds the keys of its block).
    """
    q, kv = q_valid.shape[1], key_valid.shape[1]
    qi = torch.arange(q, device=key_valid.device)[:, None] + (kv - q)
    ki = torch.arange(kv, device=key_valid.device)[None, :]
    allowed = (ki <= qi)[None]
    if blocks is not None:
        qb, kb = blocks[0].to(key_valid.device), blocks[1].to(key_valid.device)
        allowed = allowed | ((qb[:, :, None] == kb[:, None, :]) & (qb >= 0)[:, :, None])
    if window is not None:
        allowed = allowed & (ki > qi - window)[None]
    return allowed & key_valid[:, None, :]


def float_mask(key_valid: torch.Tensor, key_bias: torch.Tensor, q_valid: torch.Tensor, dtype: torch.dtype,
               blocks: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None) -> torch.Tensor:
    """[B, 1, q, kv] additive float mask: 0 + log-size bias where allowed, dtype min elsewhere
    (what eager attention needs, and SDPA where merged keys carry a bias)."""
    allowed = allowed_keys(key_valid, q_valid, blocks, window)
    bias = key_bias[:, None, :].to(dtype).masked_fill(~allowed, 0.0)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def segment_mask(
    impl: str, key_valid: torch.Tensor, key_bias: torch.Tensor, q_valid: torch.Tensor, dtype: torch.dtype,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
) -> torch.Tensor | None:
    """The fastest exact mask of the newest ``q`` rows against the ``kv`` keys of one segment.

    - FlashAttention: None without padding (the dense causal kernel, bottom-right aligned, so
      also right for decode steps), else the [B, kv] key-padding mask; merged keys count as one
      token there (no bias).
    - SDPA: None (its causal fast path) when no key is padding, no key carries a log-size bias
      and the rows are the whole segment (prefill) or a single decode row; SDPA's ``is_causal``
      is top-left aligned and crops the keys, so several new rows after a cache need a mask. A
      [B, 1, q, kv] boolean mask where only padding (or that alignment) needs one; the additive
      float mask (:func:`float_mask`) only where merged keys carry log(size).
    - Any other implementation (eager, ...): the additive float mask.
    Every form gives the valid rows the same result as the float mask (tests pin them bit-exact).
    ``blocks`` (see :func:`allowed_keys`) always get an explicit mask; FlashAttention refuses them, and
    a ``window`` shorter than the keys (a sliding-window layer, see :func:`allowed_keys`).
    """
    has_pad = not bool(key_valid.all())
    if window is not None and key_valid.shape[1] <= window:
        window = None
    if blocks is not None and not bool((blocks[0] >= 0).any()):
        blocks = None
    if blocks is not None and "flash" in impl:
        raise ValueError("FlashAttention cannot attend bidirectionally within an image (token_type_ids); use "
                         "attn_implementation='sdpa' or 'eager' for this model")
    if window is not None and "flash" in impl:
        raise ValueError(f"vlm_prune's FlashAttention path has no sliding window ({window} columns) and this call's "
                         "sequence is longer; use attn_implementation='sdpa' or 'eager' for this model")
    if "flash" in impl:
        return key_valid.long() if has_pad else None
    if impl != "sdpa" or bool((key_bias != 0).any()):
        return float_mask(key_valid, key_bias, q_valid, dtype, blocks, window)
    q, kv = q_valid.shape[1], key_valid.shape[1]
    if not has_pad and (q == kv or q == 1) and blocks is None and window is None:
        return None
    return allowed_keys(key_valid, q_valid, blocks, window)[:, None]


def apply(rows: Rows, reds: list[Reduction]) -> Rows:
    """Keep / merge rows per sample and left-pad the ragged result. No-op when nothing changes."""
    b = rows.valid.shape[0]
    unchanged = all(
        r.features is None and r.sizes is None and r.order is None
        and torch.equal(r.indices, torch.nonzero(rows.valid[i]).squeeze(1))
        for i, r in enumerate(reds)
    )
    if unchanged:
        return rows
    for i, r in enumerate(reds):
        if r.indices.numel() and not bool(rows.valid[i, r.indices].all()):
            raise RuntimeError("a method kept padding rows; Reduction.indices must name valid rows only")
    n_max = max(int(r.indices.numel()) for r in reds)
    device = rows.hidden.device
    src = torch.zeros(b, n_max, dtype=torch.long, device=device)
    new_valid = torch.zeros(b, n_max, dtype=torch.bool, device=device)
    for i, r in enumerate(reds):
        k = r.indices.numel()
        if k:
            src[i, n_max - k:] = r.indices.to(device)[_order(r)]
            new_valid[i, n_max - k:] = True
    gather = lambda t: torch.gather(t, 1, src.view(b, n_max, *([1] * (t.dim() - 2))).expand(b, n_max, *t.shape[2:]))
    hidden = gather(rows.hidden).clone()
    sizes = gather(rows.sizes).clone()
    pos = torch.stack([gather(p) for p in rows.pos])
    visual = gather(rows.visual) & new_valid
    origin = torch.where(new_valid, gather(rows.origin), torch.full_like(src, -1))
    inject = None if rows.inject is None else _carry_injections(rows, reds, src, new_valid)
    for i, r in enumerate(reds):
        k = r.indices.numel()
        if r.features is not None and k:
            hidden[i, n_max - k:] = r.features.to(hidden.dtype)[_order(r).to(r.features.device)]
        if r.sizes is not None and k:
            sizes[i, n_max - k:] = r.sizes.to(sizes.dtype)[_order(r).to(r.sizes.device)]
    hidden = hidden.masked_fill(~new_valid[..., None], 0.0)
    sizes = sizes.masked_fill(~new_valid, 1.0)
    return Rows(hidden, pos, new_valid, visual, sizes, origin, inject)


def _order(r: Reduction) -> torch.Tensor:
    """Positions into ``r.indices`` in the order the kept rows take in the new sequence."""
    return torch.arange(r.indices.numel(), device=r.indices.device) if r.order is None else r.order.to(r.indices.device)


def _carry_injections(rows: Rows, reds: list[Reduction], src: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """:attr:`Rows.inject` [n, B, k, D] after a removal: a kept row keeps its own additions, a merged
    row (``Reduction.merged_into``) gets its members' additions averaged with the weights its hidden
    state was averaged with (their sizes), so that merging and adding commute; padding gets zeros."""
    inj = rows.inject
    n, b, k = inj.shape[0], src.shape[0], src.shape[1]
    out = torch.gather(inj, 2, src.view(1, b, k, 1).expand(n, b, k, inj.shape[-1])).clone()
    for i, r in enumerate(reds):
        if r.features is None or not r.indices.numel():
            continue
        if r.merged_into is None:
            raise ValueError(
                "this language model adds features to visual rows after its first layers (DeepStack), and the "
                "method replaced hidden states without saying which rows it merged (Reduction.merged_into), so "
                "those additions cannot follow. Prune after the last layer that adds them, or use a method "
                "that only keeps / drops rows"
            )
        into = r.merged_into.to(inj.device)
        members = torch.nonzero(into >= 0).squeeze(1)
        slot = torch.searchsorted(r.indices.to(inj.device), into[members])
        w = rows.sizes[i, members].to(torch.float32)
        total = torch.zeros(n, r.indices.numel(), inj.shape[-1], dtype=torch.float32, device=inj.device)
        total.index_add_(1, slot, inj[:, i, members].float() * w[None, :, None])
        norm = torch.zeros(r.indices.numel(), dtype=torch.float32, device=inj.device).index_add_(0, slot, w)
        merged = (total / norm[None, :, None]).to(inj.dtype)
        changed = torch.zeros(r.indices.numel(), dtype=torch.bool, device=inj.device)  # rows that absorbed others
        changed[slot[into[members] != members]] = True  # (a recycled row may hold none of its own)
        column = torch.argsort(_order(r).to(inj.device))  # each kept row's place among the sample's new rows
        cols = k - r.indices.numel() + column[changed]
        out[:, i, cols] = merged[:, changed]
    return out.masked_fill(~new_valid[None, :, :, None], 0.0)


def injected(rows: Rows, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` [B, S, D] after decoder ``layer`` with that layer's :attr:`Rows.inject` added to
    the rows that get one (as the model's own loop does: ``h[rows] = h[rows] + features``)."""
    if rows.inject is None or layer >= rows.inject.shape[0]:
        return hidden
    add = rows.inject[layer].to(hidden.device, hidden.dtype)
    return torch.where((add != 0).any(-1, keepdim=True), hidden + add, hidden)


def _append_rows(red: Reduction, rows: Rows, b: int, cut: int) -> Reduction:
    """``red`` (over rows [:cut] of sample b) with the rows from ``cut`` on kept unchanged."""
    tail = torch.arange(cut, rows.valid.shape[1], device=red.indices.device)
    feats = None if red.features is None else torch.cat([red.features, rows.hidden[b, cut:].to(red.features.device)])
    sizes = None if red.sizes is None else torch.cat([red.sizes, rows.sizes[b, cut:].to(red.sizes.device)])
    into = None if red.merged_into is None else torch.cat([red.merged_into, tail.to(red.merged_into.device)])
    order = None if red.order is None else torch.cat([red.order.to(tail.device), red.indices.numel() + tail - cut])
    return Reduction(torch.cat([red.indices, tail]), feats, sizes, into, order)


def merged_into(rows: Rows, reds: list[Reduction], visual_in: torch.Tensor) -> list[list[int]]:
    """An llm-stage record's ``merged_into``: per sample, for each of its visual tokens at the
    model input (numbered 0.. in input order, as ``visual_tokens_in`` counts them), the number of
    the visual token whose row it was folded into by this step (itself when kept as it was), -1
    when dropped now or by an earlier stage."""
    number = visual_in.long().cumsum(1) - 1
    out = []
    for b, red in enumerate(reds):
        res = torch.full((int(visual_in[b].sum()),), -1, dtype=torch.long, device=number.device)
        src = torch.nonzero(rows.visual[b] & rows.valid[b]).squeeze(1)
        dst = red.membership(rows.valid.shape[1]).to(src.device)[src]
        ok = dst >= 0
        res[number[b, rows.origin[b, src[ok]]]] = number[b, rows.origin[b, dst[ok]]]
        out.append(res.tolist())
    return out


def earlier_keys_dropped(key_valid: torch.Tensor, reds: list[Reduction]) -> torch.Tensor:
    """[B, S] the keys of the layers before a removal that later tokens still see: only the rows the
    removal ``reds`` keeps (for a method with ``drops_earlier_keys``, as PruneVid's official cache,
    which removes them from every layer's KV). The prompt has run through those layers already, so
    only decode steps see the difference."""
    kept = torch.zeros_like(key_valid)
    for i, red in enumerate(reds):
        kept[i, red.indices.to(kept.device)] = True
    return key_valid & kept


def renumbered(pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[P, B, S] positions renumbered without gaps: each sample's valid rows count up from its
    first position (what AdaptInfer's official LLaVA code does after each pruning step, and
    VisionZip's after the vision-stage removal)."""
    first = pos.masked_fill(~valid, torch.iinfo(pos.dtype).max).amin(-1, keepdim=True)
    rank = valid.long().cumsum(-1) - 1
    return torch.where(valid, first + rank, pos)


def _stats(stats_in: list[int], rows: Rows, records: list[dict[str, Any]], layer_visual: list[torch.Tensor],
           state: Any) -> dict[str, Any]:
    """last_stats: visual tokens entering the LM (before any stage), reaching its last layer, and
    averaged over its layers (what prefill FLOPs follow), per sample; each stage's record."""
    avg = torch.stack(layer_visual).float().mean(0).tolist() if layer_visual else [float(n) for n in stats_in]
    out = {
        "visual_tokens_in": stats_in,
        "visual_tokens_out": (rows.visual & rows.valid).sum(1).tolist(),
        "visual_tokens_layer_avg": avg,
        "stages": records,
        "seconds": sum(r.get("seconds", 0.0) for r in records),
        "cpu_seconds": sum(r.get("cpu_seconds", 0.0) for r in records),
    }
    notes = list(getattr(state, "budget_notes", None) or []) + [r["note"] for r in records if "note" in r]
    if notes:  # wrap()'s unreachable targets, and this call's (frames methods leaving images whole)
        out["budget_notes"] = notes
    hybrid = [f"{r['method']} before layer {r['layer']}: layer {a} is a linear-attention layer, so the attention "
              f"(queries, keys) came from full-attention layer {f}"
              for r in records for a, f in r.get("attention_layers", {}).items()]
    if hybrid:
        out["notes"] = hybrid
    return out
