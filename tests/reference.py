"""Slow references for the invariants of DESIGN.md, built only from the model's own modules."""
from __future__ import annotations

import contextlib
import importlib
import inspect

import torch


def language_model_of(model):
    """The model's language model (``model.model.language_model``; SmolVLM / Idefics3: ``text_model``)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


@contextlib.contextmanager
def capture_lm_inputs(model):
    """Record the kwargs the language model receives (inputs_embeds, position_ids, ...)."""
    seen: list[dict] = []
    lm = language_model_of(model)
    handle = lm.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def positions_of(captured: dict, b: int, s: int) -> torch.Tensor:
    """[P, B, S] positions as the language model would use them for a prefill."""
    pos = captured.get("position_ids")
    if pos is None:
        return torch.arange(s).view(1, 1, s).expand(1, b, s)
    pos = pos[None] if pos.dim() == 2 else pos
    return pos.expand(pos.shape[0], b, s) if pos.shape[1] == 1 else pos  # one row for the batch (LLaVA-OV-1.5)


def multi_axis(model) -> bool:
    """True for models with M-RoPE's 3-D positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.xV)."""
    return hasattr(model.model, "get_rope_index")


def injections_of(captured: dict):
    """(mask [B, S], features [n, B, S, D]) of the DeepStack additions a language-model call got
    (Qwen3-VL's ``visual_pos_masks`` / ``deepstack_visual_embeds``), or None."""
    mask, feats = captured.get("visual_pos_masks"), captured.get("deepstack_visual_embeds")
    if mask is None or not feats:
        return None
    stacked = torch.stack(feats)
    full = stacked.new_zeros(len(feats), *mask.shape, stacked.shape[-1])
    full[:, mask] = stacked
    return mask, full


def injection_kwargs(inject, rows: torch.Tensor) -> dict:
    """The language model's DeepStack kwargs for the rows ``rows`` [B, k] (long, per sample) of a
    call whose additions were ``inject`` (from :func:`injections_of`); {} when there are none."""
    if inject is None:
        return {}
    mask, full = inject
    sub = torch.gather(mask, 1, rows)
    feats = torch.stack([torch.gather(f, 1, rows[..., None].expand(-1, -1, f.shape[-1])) for f in full])
    return {"visual_pos_masks": sub, "deepstack_visual_embeds": [f[sub] for f in feats]}


def split_positions(model, pos: torch.Tensor):
    """(rotary positions, decoder-layer position_ids) for the model family."""
    if multi_axis(model):
        return (pos[1:] if pos.shape[0] == 4 else pos), (pos[0] if pos.shape[0] == 4 else None)
    return pos[0], pos[0]


def run_layers(model, embeds, pos, masks_for_layer, replace_at=None, inject=None):
    """Run the decoder layers with an explicit 4-D float mask per layer; returns logits.
    replace_at: (layer, fn(hidden) -> hidden) applied to the hidden states entering that layer, or a
    list of them (merges at several layers). inject: (mask [B, S], features [n, B, S, D]) added after
    layers 0..n-1 (DeepStack)."""
    replacements = [] if replace_at is None else [replace_at] if isinstance(replace_at[0], int) else list(replace_at)
    lm = language_model_of(model)
    rope_pos, layer_pos = split_positions(model, pos)
    types = getattr(lm.config, "layer_types", None)
    if "layer_type" in inspect.signature(lm.rotary_emb.forward).parameters:  # Gemma 3: a table per layer type
        tables = {t: lm.rotary_emb(embeds, rope_pos, t) for t in set(types)}
        pe_of = lambda idx: tables[types[idx]]
    else:
        pe = lm.rotary_emb(embeds, rope_pos)
        pe_of = lambda idx: pe
    h = embeds
    for idx, layer in enumerate(lm.layers):
        for at, fn in replacements:
            if idx == at:
                h = fn(h)
        out = layer(h, attention_mask=masks_for_layer(idx), position_embeddings=pe_of(idx), position_ids=layer_pos)
        h = out[0] if isinstance(out, tuple) else out
        if inject is not None and idx < inject[1].shape[0]:
            h = h.clone()
            h[inject[0]] = h[inject[0]] + inject[1][idx][inject[0]].to(h.dtype)
    return model.lm_head(lm.norm(h))


def float_mask(allowed: torch.Tensor, dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, S, S] additive mask from a [B, S, S] boolean; bias [B, S] added to allowed keys."""
    m = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    if bias is not None:
        m = m + bias[:, None, :].to(dtype).masked_fill(~allowed, 0.0)
    return m[:, None]


def masked_llm_reference(model, inputs, layer: int, kept: torch.Tensor, merged=None, grad: bool = False):
    """Invariant 3: the full sequence with removed tokens masked as keys from ``layer`` on.

    kept: [B, S] bool rows that survive at ``layer``. merged: optional (centre [B, S] bool,
    features [B, S, D] merged hidden states at those centres, sizes [B, S]) - the centres'
    hidden states are replaced at ``layer`` and log(size) is added to their key logits.
    grad: keep the autograd graph of the decoder layers (the input embeddings are detached).
    """
    with torch.no_grad(), capture_lm_inputs(model) as seen:
        model(**inputs)
    cap = seen[0]
    embeds = cap["inputs_embeds"]
    b, s, _ = embeds.shape
    pos = positions_of(cap, b, s)
    valid = inputs["attention_mask"].bool()
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    if inputs.get("token_type_ids") is not None:  # Gemma 3: an image's tokens see each other both ways
        blocks = importlib.import_module(type(model.model).__module__).get_block_sequence_ids_for_mask(inputs["token_type_ids"])
        causal = causal | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks >= 0)[:, :, None])
    before = causal & valid[:, None, :]
    after = before & kept[:, None, :]
    bias = None
    replace = None
    if merged is not None:
        centre, feats, sizes = merged
        bias = torch.log(sizes.float()).masked_fill(~kept, 0.0)
        replace = (layer, lambda h: torch.where(centre[..., None], feats.to(h.dtype), h))
    dtype = embeds.dtype
    m_before = float_mask(before, dtype)
    m_after = float_mask(after, dtype, bias)
    with torch.set_grad_enabled(grad):
        return run_layers(model, embeds.detach(), pos, lambda i: m_before if i < layer else m_after, replace,
                          injections_of(cap))


# ---- generate() references: the unwrapped model driven by its own generate(), with hooks -------------
def renumber(pos: torch.Tensor, keep: torch.Tensor, rank: torch.Tensor | None = None) -> torch.Tensor:
    """[P, B, k] positions of the rows ``keep`` [B, k] counted up without gaps from each sample's
    first kept position (what a method that renumbers after a removal defines), in column order or
    in the order of ``rank`` [B, k] (rows a method moved); others unchanged."""
    big = torch.iinfo(pos.dtype).max
    first = pos.masked_fill(~keep, big).amin(-1, keepdim=True)
    if rank is None:
        count = keep.long().cumsum(-1) - 1
    else:  # each kept row's place among the kept rows, by rank
        count = ((rank[:, None, :] < rank[:, :, None]) & keep[:, None, :]).sum(-1)
    return torch.where(keep, first + count, pos)


class HookedReference:
    """The UNWRAPPED model, run by its own forward / generate(), with hooks that only:

    - give the ``k`` prompt columns the positions ``positions`` [P, B, k] (P = 1, or M-RoPE's 3
      axes) and every later column c the next one, ``positions[..., -1] + 1 + (c - k)`` (text
      continues on every axis), whatever the model computed;
    - per decoder layer i, hide the prompt's key columns ``hidden[i]`` [B, k] and add ``bias[i]``
      [B, k] (log merge sizes) to their logits, through an explicit float mask built on the
      model's own mask (None: the layer's mask is left alone);
    - per layer, rope positions ``layer_positions[i]`` [P, B, k] (renumbered after a removal;
      later columns continue from their last one);
    - ``replace`` = (layer, rows [B, k] bool, feats [B, k, D]), or a list of them (merges at several
      layers): the prompt rows' hidden states entering that layer (merged cluster centres), in calls
      that hold the prompt;
    - per layer, ``order[i]`` [B, k] long: the causal rank of each prompt column in that layer (a
      method that moves rows, as SparseVLM's recycled tokens after the kept ones): a prompt row
      attends to the prompt keys of lower or equal rank (and, as the model's own mask, to the keys of
      its bidirectional block); None: column order;
    - ``inject`` = (mask [B, k], features [n, B, k, D]): the prompt rows' DeepStack additions
      (Qwen3-VL), given to calls that hold the prompt;
    - decode-time KV pruning (MustDrop's output-aware cache): per layer, the prompt key columns
      ``decode_hidden[i]`` [B, k] that rows AFTER the prompt (generated tokens) also miss, and the
      table ``decode_positions[i]`` [P, B, k] whose last column the generated rows continue from.

    - ``steps``: a per-step decode rule (:class:`DyCokeSteps`): at every single-token decode call it
      reads the new row's attention in layer ``steps.layer - 1`` and hides, for that row only, the
      prompt keys it returns in the layers from ``steps.layer`` on.

    Batch rows repeated by generate() (beams, num_return_sequences) take their sample's plan.
    """

    def __init__(self, model, k: int, positions=None, hidden=None, bias=None, layer_positions=None, replace=None,
                 inject=None, decode_hidden=None, decode_positions=None, order=None, steps=None):
        self.model, self.k = model, k
        self.lm = language_model_of(model)
        n = len(self.lm.layers)
        self.positions = positions
        self.hidden = hidden or [None] * n
        self.decode_hidden = decode_hidden or [None] * n
        self.decode_positions = decode_positions or [None] * n
        self.bias = bias or [None] * n
        self.layer_positions = layer_positions or [None] * n
        self.replace = [] if not replace else [replace] if isinstance(replace[0], int) else list(replace)
        self.order = order or [None] * n
        self.inject = inject  # (mask [B, k], features [n, B, k, D]): DeepStack additions of the prompt rows
        self.steps = steps
        self.step_hidden: torch.Tensor | None = None  # [B, kv] keys the current decode row misses from steps.layer on
        self.cache = None
        self.handles: list = []
        self.call = (0, 0, 1)

    # columns of the current call -> positions [P, B, q]
    def _at(self, table: torch.Tensor, past: int, q: int, b: int, later: torch.Tensor | None = None) -> torch.Tensor:
        table = table.repeat_interleave(b // table.shape[1], dim=1)
        last = table if later is None else later.repeat_interleave(b // later.shape[1], dim=1)
        cols = torch.arange(past, past + q)
        inside = table[..., cols.clamp(max=self.k - 1)]
        after = last[..., -1:] + 1 + (cols - self.k)
        return torch.where(cols < self.k, inside, after)

    def _per_sample(self, t: torch.Tensor, b: int) -> torch.Tensor:
        return t.repeat_interleave(b // t.shape[0], dim=0)

    def _lm_hook(self, mod, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        x = kwargs.get("inputs_embeds")
        if x is None:
            x = kwargs.get("input_ids", args[0] if args else None)
        b, q = x.shape[:2]
        past = int(cache.get_seq_length()) if cache is not None else 0  # (Qwen3.5: a tensor the cache grows in place)
        self.call = (past, q, b)
        self.cache, self.step_hidden = cache, None
        if self.inject is not None and past == 0:  # the prompt (again, without a cache): its DeepStack rows
            mask = self._per_sample(self.inject[0], b)[:, :q]
            mask = torch.cat([mask, mask.new_zeros(b, q - mask.shape[1])], 1)
            feats = torch.stack([self._per_sample(f, b)[:, : min(q, self.k)] for f in self.inject[1]])
            kwargs["visual_pos_masks"] = mask
            kwargs["deepstack_visual_embeds"] = [f[mask[:, : f.shape[1]]] for f in feats]
        if self.positions is None:
            return args, kwargs
        new = self._at(self.positions, past, q, b)
        given = kwargs.get("position_ids")
        if given is not None and given.dim() == 3 and given.shape[0] == new.shape[0] + 1:
            new = torch.cat([new[:1], new])  # Qwen2-VL's text row in front of the M-RoPE axes
        elif given is None or given.dim() == 2:
            new = new[0]
        kwargs["position_ids"] = new.to(x.device)
        return args, kwargs

    def _layer_hook(self, i: int):
        def hook(mod, args, kwargs):
            past, q, b = self.call
            h = args[0] if args else kwargs.pop("hidden_states")
            hide, bias, later_hide = self.hidden[i], self.bias[i], self.decode_hidden[i]
            order = self.order[i] if past < self.k else None  # only calls holding prompt queries
            # (a linear-attention layer, Qwen3.5's, keeps its own state: no keys to hide)
            step_hide = self.step_hidden if self.steps is not None and i >= self.steps.layer and \
                getattr(mod, "self_attn", None) is not None else None
            if hide is not None or bias is not None or later_hide is not None or order is not None or step_hide is not None:
                mask = kwargs.get("attention_mask")
                kv = past + q if mask is None else mask.shape[-1]
                if mask is None:
                    qi = torch.arange(q)[:, None] + (kv - q)
                    allowed = (torch.arange(kv)[None] <= qi)[None, None].expand(b, 1, q, kv)
                elif mask.dtype == torch.bool:
                    allowed = mask
                else:
                    allowed = mask > torch.finfo(mask.dtype).min / 2
                n = min(self.k, kv)
                cols_hidden = torch.zeros(b, kv, dtype=torch.bool)
                cols_bias = torch.zeros(b, kv)
                if hide is not None:
                    cols_hidden[:, :n] = self._per_sample(hide, b)[:, :n]
                if bias is not None:
                    cols_bias[:, :n] = self._per_sample(bias, b)[:, :n]
                if order is not None:
                    allowed = self._ordered(allowed.expand(b, 1, q, kv).clone(), self._per_sample(order, b), past, n)
                allowed = allowed & ~cols_hidden[:, None, None, :]
                if later_hide is not None:  # rows after the prompt (generated tokens) also miss these prompt keys
                    later = torch.zeros(b, kv, dtype=torch.bool)
                    later[:, :n] = self._per_sample(later_hide, b)[:, :n]
                    after_prompt = (torch.arange(past, past + q) >= self.k)[None, None, :, None]
                    allowed = allowed & ~(after_prompt & later[:, None, None, :])
                if step_hide is not None:  # the decode row's keys chosen away in this step
                    allowed = allowed & ~step_hide[:, None, None, :kv]
                dtype = h.dtype
                kwargs["attention_mask"] = cols_bias[:, None, None, :].to(dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            if self.layer_positions[i] is not None:
                pos = self._at(self.layer_positions[i], past, q, b, self.decode_positions[i])
                kwargs["position_embeddings"] = self.lm.rotary_emb(h, pos if pos.shape[0] > 1 else pos[0])
            if self.steps is not None and i == self.steps.layer - 1 and q == 1 and past >= self.k:
                self.probe = (h, kwargs.get("attention_mask"), kwargs["position_embeddings"])
            for at, rows, feats in self.replace:
                if i == at and past == 0:
                    rows = self._per_sample(rows, b)[:, : min(q, self.k)]
                    feats = self._per_sample(feats, b)[:, : rows.shape[1]].to(h.dtype)
                    h = h.clone()
                    h[:, : rows.shape[1]] = torch.where(rows[..., None], feats, h[:, : rows.shape[1]])
            return (h, *args[1:]), kwargs

        return hook

    def _ordered(self, allowed: torch.Tensor, rank: torch.Tensor, past: int, n: int) -> torch.Tensor:
        """``allowed`` [B, 1, q, kv] of a call holding the whole prompt (past 0) with the prompt rows'
        prompt keys (the first ``n``) chosen by ``rank`` [B, k]: keys of lower or equal rank, and the
        keys the model's own mask lets the row see both ways (a bidirectional block, Gemma 3's image)."""
        if past != 0 or allowed.shape[2] < n:
            raise ValueError("a moved row order applies to calls that hold the whole prompt")
        own = allowed[:, 0, :n, :n]
        by_rank = rank[:, None, :n] <= rank[:, :n, None]  # [B, n, n]: query row, key column
        allowed[:, 0, :n, :n] = by_rank | (own & own.transpose(1, 2))
        return allowed

    def __enter__(self) -> "HookedReference":
        self.handles.append(self.lm.register_forward_pre_hook(self._lm_hook, with_kwargs=True))
        prepare = self.model.prepare_inputs_for_generation
        if "inputs_embeds" not in inspect.signature(prepare).parameters:
            # generate() takes inputs_embeds only from models whose prepare_inputs_for_generation names
            # it (Gemma 3's takes **kwargs and forwards them): name it, on this instance, while hooked
            self.model.prepare_inputs_for_generation = lambda input_ids, inputs_embeds=None, **kwargs: prepare(
                input_ids, inputs_embeds=inputs_embeds, **kwargs)
            self.named_embeds = True
        for i, layer in enumerate(self.lm.layers):
            self.handles.append(layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
        if self.steps is not None:
            self.probe = None
            self.handles.append(self.lm.layers[self.steps.layer - 1].register_forward_hook(self._step_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if getattr(self, "named_embeds", False):
            del self.model.prepare_inputs_for_generation
            self.named_embeds = False

    def _step_hook(self, mod, args, out) -> None:
        """After layer L - 1 of a decode call: the new row's head-averaged attention over that layer's
        cached keys (its own weights and mask), handed to the step rule."""
        if self.probe is None:
            return
        h, mask, (cos, sin) = self.probe
        self.probe = None
        attn = mod.self_attn
        x = mod.input_layernorm(h)
        b, hd = x.shape[0], attn.head_dim
        q = attn.q_proj(x)
        heads = attn.config.num_attention_heads
        if q.shape[-1] == 2 * heads * hd:  # a gated query (Qwen3.5): the query half of each head
            q = q.view(b, 1, heads, 2 * hd)[..., :hd]
        q = q.reshape(b, 1, heads, hd)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        q = q.transpose(1, 2)
        rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb
        q = rope(q, q, cos, sin)[0]
        keys = self.cache.layers[self.steps.layer - 1].keys  # [B, H_kv, kv, d], rotated
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        logits = (q @ keys.transpose(-1, -2))[:, :, 0] * attn.scaling  # [B, H, kv]
        kv = keys.shape[2]
        if mask is None:
            allowed = torch.ones(b, kv, dtype=torch.bool)
        elif mask.dtype == torch.bool:
            allowed = mask[:, 0, -1].expand(b, kv)
        else:
            allowed = (mask[:, 0, -1] > torch.finfo(mask.dtype).min / 2).expand(b, kv)
        attention = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), -1).mean(1)  # [B, kv]
        self.step_hidden = self.steps(attention, keys, self._per_sample(self.steps.visual, b), self.k)


class DyCokeSteps:
    """DyCoke's decode-time KV pruning, re-stated from the official code (KD-TAO/DyCoke@dd74634,
    llava/model/language_model/modeling_qwen2.py ``PrunableDynamicCache.dycoke_pruning`` /
    ``update_cache``), one decode row at a time: the row's attention over the visual prompt keys but
    the last (the official span is the TTM output less one token; the last always stays) is compared
    (cosine) with the one its previous step remembered (none after a prompt or a new turn: 0); below
    ``threshold`` only the top int((n - 1) (1 - p)) of those n - 1 stay for this step in the layers
    from ``layer`` on; the row's attention is remembered either way. The memory follows each
    sequence through beams and repeated rows: it is keyed by the cached key of the row that made it,
    in layer ``layer`` - 1 (a function of the tokens so far, as the attention itself).

    ``visual`` [B, k]: the visual columns of the prompt."""

    def __init__(self, visual: torch.Tensor, layer: int = 3, p: float = 0.8, threshold: float = 0.9) -> None:
        self.visual, self.layer, self.p, self.threshold = visual, layer, p, threshold
        self.memory: dict[bytes, torch.Tensor] = {}
        self.pruned = 0  # decode rows that dropped visual keys (a test asserts the rule acted)

    def __call__(self, attention: torch.Tensor, keys: torch.Tensor, visual: torch.Tensor, k: int) -> torch.Tensor:
        b, kv = attention.shape
        hide = torch.zeros(b, kv, dtype=torch.bool)
        for i in range(b):
            cols = torch.nonzero(visual[i]).squeeze(1)[:-1]
            att = attention[i, cols]
            previous = self.memory.get(keys[i, :, -2].numpy().tobytes()) if kv >= 2 else None
            self.memory[keys[i, :, -1].numpy().tobytes()] = att
            similarity = 0.0 if previous is None else float(torch.nn.functional.cosine_similarity(att, previous, dim=0))
            if similarity < self.threshold:
                top = torch.topk(att, int(cols.numel() * (1 - self.p))).indices
                hide[i, cols] = True
                hide[i, cols[top]] = False
                self.pruned += 1
        return hide



def recording(method_cls, **knobs):
    """``method_cls(**knobs)`` (an llm-stage method) whose ``seen`` dict holds the rows' input
    indices (``origin``) and the reductions of its last ``select`` (also in the copy wrap() makes)."""
    seen: dict = {}

    class Recording(method_cls):
        def select(self, ctx):
            reds = super().select(ctx)
            seen.update(origin=ctx.extras["origin"], reds=reds)
            return reds

    method = Recording(**knobs)
    method.seen = seen
    return method


def grid_recording(method_cls, **knobs):
    """``method_cls(**knobs)`` (a vision-stage method) whose ``grids`` list holds the grid of every
    image it reduced, in order (also in the copy wrap() makes)."""
    grids: list = []

    class Recording(method_cls):
        def reduce_image(self, ctx):
            grids.append(ctx.grid)
            return super().reduce_image(ctx)

    method = Recording(**knobs)
    method.grids = grids
    return method
