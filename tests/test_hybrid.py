"""Invariant 6: in-LLM pruning on hybrid language models (Qwen3.5 / Qwen3.5-MoE: Gated DeltaNet
linear-attention layers 0 and 2, full attention 1 and 3 in the tiny models).

A removal there is no key mask: the reference is hand-built from transformers' own decoder layers.
Each sample alone runs layers 0..L-1 on its full sequence, then the rows the method kept (merged rows
with their features and sizes) through layers L..end, with one fresh transformers cache filled layer
by layer (so a later linear layer's recurrent state and convolution window are built from the kept
rows only), full-attention layers at the kept rows' original M-RoPE positions with the log-size bias
of merged keys; then greedy decode steps on that cache. The wrapped model's batched ``generate()``
(left padding) must give every sample the reference's tokens and logits.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models_qwen3 as Q
import vlm_prune
from reference import capture_lm_inputs, positions_of
from vlm_prune.registry import method_class

STEPS = 8


def capture_selections(model) -> list[tuple[int, torch.Tensor, list]]:
    """Record every llm-stage selection of the wrapped ``model``: (the layer it prunes before, the
    [B, S] valid rows it chose from, its reductions)."""
    method = model.vlm_prune.methods["llm"]
    seen: list[tuple[int, torch.Tensor, list]] = []
    select = method.select

    def recording(ctx):
        reds = select(ctx)
        if reds is not None:
            seen.append((ctx.extras["prune_before"], ctx.valid.clone(), reds))
        return reds

    method.select = recording
    return seen


def sample_plan(selections, b: int) -> dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Sample ``b``'s removals on its own rows (no padding): layer -> (kept rows in their new order,
    their replacement features or None, their sizes or None)."""
    plan = {}
    for layer, valid, reds in selections:
        r = reds[b]
        offset = valid.shape[1] - int(valid[b].sum())  # left padding before the sample's rows
        order = torch.arange(r.indices.numel()) if r.order is None else r.order
        plan[layer] = (r.indices[order] - offset, None if r.features is None else r.features[order],
                       None if r.sizes is None else r.sizes[order])
    return plan


def reference(model, embeds: torch.Tensor, pos: torch.Tensor, plan, steps: int,
              final_from: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of each step for one sample: prompt rows ``embeds`` [S, D] at M-RoPE
    positions ``pos`` [3, S], the removals ``plan`` applied before their layers, through the language
    model's own decoder layers with one fresh cache. ``final_from`` (MustDrop's decoding stage): decode
    steps of the full-attention layers from there on attend only to the prompt rows that reached the
    last layer (the linear layers' states keep what they folded in)."""
    from transformers import DynamicCache

    lm = model.model.language_model
    types = lm.config.layer_types
    cache = DynamicCache(config=lm.config)
    h, p = embeds[None], pos[:, None]
    sizes = torch.ones(embeds.shape[0])
    origin = torch.arange(embeds.shape[0])  # each row's prompt row
    bias: dict[int, torch.Tensor] = {}  # per layer, the log sizes of its cached keys
    origins: dict[int, torch.Tensor] = {}

    def run(idx: int, x: torch.Tensor, positions: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        mask = None  # linear-attention layers: no padding, no mask
        if types[idx] == "full_attention":  # causal, log sizes added to merged keys
            q, kv = x.shape[1], key_bias.shape[0]
            allowed = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
            mask = torch.where(allowed, key_bias[None], torch.finfo(x.dtype).min)[None, None]
        out = lm.layers[idx](x, position_embeddings=lm.rotary_emb(x, positions), attention_mask=mask,
                             position_ids=positions[0], cache=cache, use_cache=True)
        return out[0] if isinstance(out, tuple) else out

    for idx in range(len(lm.layers)):
        if idx in plan:
            rows, feats, new_sizes = plan[idx]
            h, p = h[:, rows].clone(), p[:, :, rows]
            sizes = sizes[rows] if new_sizes is None else new_sizes.float()
            origin = origin[rows]
            if feats is not None:
                h[0] = feats.to(h.dtype)
        bias[idx], origins[idx] = torch.log(sizes), origin
        h = run(idx, h, p, bias[idx])
    for idx in range(final_from if final_from is not None else len(lm.layers), len(lm.layers)):
        bias[idx] = bias[idx].masked_fill(~torch.isin(origins[idx], origin), torch.finfo(h.dtype).min)
    suppress = list(model.generation_config.suppress_tokens or [])
    tokens, logits = [], []
    nxt = pos[:, -1:] + 1
    for step in range(steps):
        out = model.lm_head(lm.norm(h[:, -1]))[0]
        logits.append(out)
        tokens.append(int(out.clone().index_fill_(0, torch.tensor(suppress, dtype=torch.long), -torch.inf).argmax())
                      if suppress else int(out.argmax()))
        if step == steps - 1:
            break
        h = lm.embed_tokens(torch.tensor([[tokens[-1]]]))
        for idx in range(len(lm.layers)):
            bias[idx] = torch.cat([bias[idx], torch.zeros(1)])
            h = run(idx, h, (nxt + step)[:, None], bias[idx])
    return tokens, logits


def prompts_of(model, inp) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, the unwrapped model's language-model input without padding: (embeddings [S, D],
    M-RoPE positions [3, S])."""
    with torch.no_grad(), capture_lm_inputs(model) as seen:
        model(**inp)
    embeds = seen[0]["inputs_embeds"]
    b, s = embeds.shape[:2]
    pos = positions_of(seen[0], b, s)[-3:]
    valid = inp["attention_mask"].bool()
    return [(embeds[i, valid[i]], pos[:, i, valid[i]]) for i in range(b)]


_MODELS: dict[tuple[bool, str], object] = {}


def tiny(moe: bool, attn: str = "sdpa"):
    if (moe, attn) not in _MODELS:
        _MODELS[moe, attn] = Q.tiny_qwen3_5(attn=attn, moe=moe)
    return _MODELS[moe, attn]


CASES = [  # (method, knobs, video, moe, attention implementation)
    ("fastv", {}, False, False, "sdpa"), ("fastv", {}, False, True, "sdpa"),
    ("pact", {"layer": 2}, False, False, "sdpa"), ("pact", {"layer": 3}, False, True, "eager"),
    ("pdrop", {}, False, False, "sdpa"), ("sparsevlm", {}, False, False, "eager"), ("adaptinfer", {}, False, False, "sdpa"),
    ("dart", {}, False, False, "sdpa"), ("mustdrop", {"decode": False}, False, False, "sdpa"),
    ("mustdrop", {}, False, False, "sdpa"),  # with its decoding stage
    ("framefusion", {"similarity": 0.1}, True, False, "sdpa"),  # a threshold the random frames reach: merges
]


@pytest.mark.parametrize("name, knobs, video, moe, attn", CASES,
                         ids=[f"{c[0]}{'_moe' if c[3] else ''}{'' if c[1].get('decode', True) else '_prefill'}-{c[4]}" for c in CASES])
def test_in_llm_pruning_equals_the_hand_built_hybrid_reference(name, knobs, video, moe, attn):
    """Batch 2 with left padding, keep 0.25: each sample's greedy tokens and every step's logits equal
    the reference on that sample alone (removals at linear and full-attention layers alike, merged rows
    of PACT / SparseVLM / FrameFusion with their sizes)."""
    model = tiny(moe, attn)
    inp = Q.qwen3_vl_inputs(model, batch=2, video=video)
    assert int((inp["attention_mask"] == 0).sum()) > 0  # the samples differ in length
    prompts = prompts_of(model, inp)
    vlm_prune.wrap(model, method_class(name)(**knobs), keep=0.25)
    try:
        selections = capture_selections(model)
        method = model.vlm_prune.methods["llm"]
        final_from = method.decode_final_rows_from(4) if getattr(method, "decode_kv", False) else None
        with torch.no_grad():
            out = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    assert selections and stats["visual_tokens_out"] != stats["visual_tokens_in"]
    reds = [r for _, _, sample_reds in selections for r in sample_reds]
    if name == "pact":  # merged rows reach the later layers with their sizes (log-size bias)
        assert any(r.features is not None and r.sizes is not None and bool((r.sizes > 1).any()) for r in reds)
    if name in ("sparsevlm", "framefusion"):  # merged features (SparseVLM's recycled rows after the kept visual ones)
        assert any(r.features is not None and (name == "framefusion" or r.order is not None) for r in reds)
    width = inp["input_ids"].shape[1]
    for b, (embeds, pos) in enumerate(prompts):
        with torch.no_grad():
            tokens, logits = reference(model, embeds, pos, sample_plan(selections, b), STEPS, final_from)
        assert out.sequences[b, width:].tolist() == tokens, f"sample {b}"
        torch.testing.assert_close(torch.stack([lg[b] for lg in out.logits]), torch.stack(logits), atol=1e-5, rtol=0,
                                   msg=f"sample {b}")


def test_a_linear_layer_reads_the_full_attention_layer_before_it():
    """Qwen3.5's pattern (full attention every fourth layer): a method reading a linear-attention layer
    reads the nearest full-attention layer before it, the first one when none precedes."""
    from vlm_prune.engine import LMSpec, PrunedDecoder

    class Full(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.Identity()

    layers = torch.nn.ModuleList([torch.nn.Identity() if i % 4 != 3 else Full() for i in range(12)])
    decoder = PrunedDecoder(LMSpec(lm=None, layers=layers, family="qwen3_5", apply_rope=None), None, lambda: "sdpa")
    assert [decoder.attention_layer(i) for i in range(12)] == [3, 3, 3, 3, 3, 3, 3, 7, 7, 7, 7, 11]


def test_fastv_scores_a_linear_layer_through_the_full_attention_layer_before_it():
    """FastV K=3 scores layer 2, a Gated DeltaNet layer: its side attention runs full-attention layer 1's
    norm and projections on the rows entering layer 2, and last_stats says so; K=2 scores layer 1 itself."""
    model = tiny(False)
    inp = Q.qwen3_vl_inputs(model, batch=1)
    lm = model.model.language_model
    for k, read in ((3, {2: 1}), (2, None)):
        normed, entering = [], []
        hooks = [lm.layers[1].input_layernorm.register_forward_hook(lambda m, a, out: normed.append(a[0])),
                 lm.layers[2].register_forward_pre_hook(
                     lambda m, a, kw: entering.append(a[0] if a else kw["hidden_states"]), with_kwargs=True)]
        vlm_prune.wrap(model, method_class("fastv")(layer=k), keep=0.25)
        try:
            with torch.no_grad():
                model(**inp)
            stats = model.vlm_prune.last_stats
        finally:
            vlm_prune.unwrap(model)
            for h in hooks:
                h.remove()
        record = stats["stages"][0]
        assert record["layer"] == k and record.get("attention_layers") == read
        if read is None:
            assert len(normed) == 2 and "notes" not in stats  # layer 1's own forward and the side scores
            continue
        assert stats["notes"] == ["fastv before layer 3: layer 2 is a linear-attention layer, so the attention "
                                  "(queries, keys) came from full-attention layer 1"]
        assert len(normed) == 2 and torch.equal(normed[1], entering[0])  # the side scores: layer 2's input
