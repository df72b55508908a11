"""HoliTom's inner-LLM merge (``holitom`` with inner=True) against an independent re-statement of the
official algorithm, and its budget split, defaults, refusals and invariants.

Official: cokeshao/HoliTom@e9b2972f6895c9e7d7fe74eb8c3a2ecaab8056e0, ``holitom/modeling_qwen2.py``
(``Qwen2Model_holitom.forward``: before layer HOLITOM_k, the last row's head-averaged attention of
layer HOLITOM_k - 1 over the video's rows picks round(L (1 - HOLITOM_r)) of them; every other row,
in row order, halves into the picked row it is most similar to (cosine); the picked rows and the
text go on at their own position ids), ``holitom/main.py`` (the merge runs only when HOLITOM_k and
HOLITOM_r are both set) and ``scripts/eval_ov-7b_holitom.sh`` (k=18, r=0.5). The re-statement
follows the official control flow; none of its code is copied.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from reference import capture_lm_inputs, positions_of
from vlm_prune.frames.holitom import HoliTom
from vlm_prune.methods.holitom_llm import HoliTomMerge, merge_video

from test_budgets import _one_thread  # noqa: E402,F401  (autouse: one thread)


def official_merge(hidden: torch.Tensor, last_row: torch.Tensor, start: int, length: int, r: float):
    """The official merge on one sample: hidden [S, D] entering layer k, last_row [S] the head-averaged
    attention the last row pays every row in layer k - 1. Returns (kept rows ascending, hidden [S, D]
    after the in-place averaging)."""
    h = hidden.clone()
    img = last_row[start:start + length]
    top = img.topk(round(length * (1 - r))).indices + start  # in score order, as the official
    every = torch.arange(length)
    non = every[~torch.isin(every, top - start)] + start
    a, b = h[non], h[top]
    sim = (a @ b.T) / (a.norm(dim=-1, keepdim=True) * b.norm(dim=-1, keepdim=True).T)
    best = sim.max(-1).indices
    for i in range(len(non)):
        t = top[best[i]]
        h[t] = (h[t] + h[non[i]]) / 2
    keep = torch.cat([torch.arange(start), top, torch.arange(start + length, h.shape[0])]).sort().values
    return keep, h


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("length, r", [(12, 0.5), (30, 0.5), (30, 0.8), (7, 0.3)])
def test_merge_equals_the_official_loop(seed, length, r):
    """Kept rows and every state after the merge, bit for bit (float32); text rows around the video."""
    g = torch.Generator().manual_seed(seed)
    s, start, dim = length + 9, 4, 16
    hidden = torch.randn(s, dim, generator=g)
    hidden[start:start + 6] += 2 * torch.randn(dim, generator=g)  # a few rows alike: several join one top row
    last_row = torch.rand(s, generator=g)
    keep, ref = official_merge(hidden, last_row, start, length, r)
    rows = torch.arange(start, start + length)
    n_keep = round(length * (1 - r))
    top, states, merged, joined = merge_video(hidden, last_row, rows, n_keep)
    assert torch.equal(top, keep[(keep >= start) & (keep < start + length)])
    assert torch.equal(states, ref[top])
    assert sorted(merged.tolist() + top.tolist()) == rows.tolist()
    # each merged row joined its most similar top row
    cos = torch.nn.functional.cosine_similarity(hidden[merged][:, None], hidden[top][None], dim=-1)
    assert torch.equal(joined, top[cos.argmax(-1)])


def test_merge_halves_in_row_order_in_the_hidden_dtype():
    """bfloat16: each top row's state is the official sequence of in-place halvings, in row order,
    rounded to bfloat16 at every step (the same joins, from the float32 similarity)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(20, 8, generator=g).to(torch.bfloat16)
    scores = torch.rand(20, generator=g)
    rows = torch.arange(20)
    top, states, merged, joined = merge_video(hidden, scores, rows, 4)
    ref = hidden.clone()
    for m, t in zip(merged.tolist(), joined.tolist()):  # merged rows ascending
        ref[t] = (ref[t] + ref[m]) / 2
    assert states.dtype == torch.bfloat16 and torch.equal(states, ref[top])
    assert int(torch.bincount(joined).max()) >= 3  # some top row took several, so the order matters


# ---- in the model ------------------------------------------------------------------------------
def _lm_input(model, inp, method, **kw):
    """(LM input embeds [1, S, D], positions [S], kept input rows) of a wrapped prefill."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad(), capture_lm_inputs(model) as seen:
            logits = model(**inp).logits
        rows = model.vlm_prune.last_rows[0]
    finally:
        vlm_prune.unwrap(model)
    s = inp["input_ids"].shape[1]
    return seen[0]["inputs_embeds"], positions_of(seen[0], 1, s)[0, 0], rows, logits


def official_forward(model, embeds: torch.Tensor, pos: torch.Tensor, start: int, length: int, k: int, r: float):
    """The official Qwen2Model_holitom forward (batch 1, eager): layers < k as they are, layer k - 1's
    attention weights read, the merge before layer k, the kept rows on at their position ids."""
    lm = model.model.language_model
    h, p = embeds, pos[None]
    causal = lambda n: torch.full((n, n), torch.finfo(h.dtype).min).triu(1)[None, None]
    pe = lm.rotary_emb(h, p)
    keep = torch.arange(h.shape[1])
    for idx, layer in enumerate(lm.layers):
        if idx == k:
            last = weights.mean(1)[0, -1]
            keep, merged = official_merge(h[0], last, start, length, r)
            h, p = merged[keep][None], p[:, keep]
            pe = lm.rotary_emb(h, p)
        if idx == k - 1:
            _, weights = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=pe,
                                         attention_mask=causal(h.shape[1]))
        out = layer(h, attention_mask=causal(h.shape[1]), position_embeddings=pe, position_ids=p)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(lm.norm(h)), keep


@pytest.mark.parametrize("tau, layer", [(0.8, 2), (-1.0, 3)])
def test_in_the_model_equals_the_official_forward(tau, layer):
    """The wrapped model (inner merge before ``layer``, scored by layer - 1's attention on the side)
    equals the official forward run on the outer stage's output: the same rows reach the last layer,
    the same logits. keep=0.25 of 32 tokens: the outer stage keeps round(8 / 0.5) = 16, as
    inner=False does at budget 16, and the merge round(16 (1 - 0.5)) = 8, the official count."""
    model = T.tiny_onevision(attn="eager")
    inp = T.onevision_video_inputs(model, batch=1, frames=8)
    knobs = dict(tau=tau, max_window=2, layer=layer)
    embeds, pos, outer_rows, _ = _lm_input(model, inp, HoliTom(inner=False, **knobs), budget=16)
    _, _, rows, logits = _lm_input(model, inp, HoliTom(**knobs), keep=0.25)
    short = embeds[:, outer_rows]
    video = torch.nonzero(inp["input_ids"][0, outer_rows] == T.VIDEO_TOKEN).flatten()
    start, length = int(video[0]), video.numel() - 1  # the video's visual rows (its newline after them)
    assert length == 16
    with torch.no_grad():
        ref_logits, keep = official_forward(model, short, pos[outer_rows], start, length, layer, 0.5)
    assert torch.equal(rows[rows >= 0], outer_rows[keep])
    assert int((inp["input_ids"][0, rows[rows >= 0]] == T.VIDEO_TOKEN).sum()) == 8 + 1
    torch.testing.assert_close(logits[0, -1], ref_logits[0, -1], atol=1e-5, rtol=1e-5)


CASES = {"batch1": 1, "batch2": 2}


def _stats(method, batch=2, **kw):
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, batch=batch, frames=8)
    vlm_prune.wrap(model, method, **kw)
    return T.forward_stats(model, inp)


@pytest.mark.parametrize("kw, outer, final", [
    ({"keep": 0.25}, 16, 8), ({"keep": 0.125}, 8, 4), ({"budget": 3}, 6, 3), ({"budget": 5}, 10, 5),
    ({"keep": 0.75}, 32, 24), ({"keep": 1.0}, 32, 32), ({}, 3, 2),  # no target: floor(0.1 * 32), round(3 / 2)
])
def test_budget_split_and_official_defaults(kw, outer, final):
    """The video's tokens reaching the last layer are the target; the outer stage keeps
    min(T N, round(target / (1 - r))); without keep / budget the official retain=0.1 then r=0.5."""
    stats = _stats(HoliTom(layer=2), **kw)
    assert stats["visual_tokens_in"] == [32, 32] and stats["visual_tokens_out"] == [final, final]
    frames = next(r for r in stats["stages"] if r["stage"] == "frames")
    assert frames["method"] == "holitom" and frames["tokens_out"] == [outer, outer]
    llm = [r for r in stats["stages"] if r["stage"] == "llm"]
    if final < outer:
        assert [(r["method"], r["layer"], r["tokens_in"], r["tokens_out"]) for r in llm] == \
            [("holitom", 2, [outer, outer], [final, final])]
        for m in llm[0]["merged_into"]:  # every token entering the LLM joined one of the kept ones
            assert len(set(m) - {-1}) == final and sum(x >= 0 for x in m) == outer
    else:
        assert llm == []  # nothing to merge: no record


@pytest.mark.parametrize("kw, outer", [({"keep": 0.25}, 8), ({"budget": 5}, 5), ({}, 3)])
def test_inner_false_is_the_outer_stage_alone(kw, outer):
    """inner=False (the paper's "w/o M"): one frames stage that keeps the target (retain=0.1 without one)."""
    stats = _stats(HoliTom(inner=False), **kw)
    assert stats["visual_tokens_out"] == [outer, outer]
    assert [r["stage"] for r in stats["stages"]] == ["frames"]


def test_other_r_and_retain():
    stats = _stats(HoliTom(layer=1, r=0.75), keep=0.125)  # target 4: outer round(4 / 0.25) = 16
    assert next(r for r in stats["stages"] if r["stage"] == "frames")["tokens_out"] == [16, 16]
    assert stats["visual_tokens_out"] == [4, 4]
    stats = _stats(HoliTom(layer=1, retain=0.5, r=0.25))  # official counts: floor(16), round(16 * 0.75) = 12
    assert stats["visual_tokens_out"] == [12, 12]
    stats = _stats(HoliTom(layer=1, r=0.0), keep=0.25)  # r = 0: the outer stage keeps the target, nothing merged
    assert stats["visual_tokens_out"] == [8, 8] and [r["stage"] for r in stats["stages"]] == ["frames"]
    stats = _stats(HoliTom(layer=1, retain=0.04, r=0.9))  # official counts floor(1.28) = 1, round(0.1) = 0: one stays
    assert stats["visual_tokens_out"] == [1, 1]


def test_refusals_name_the_fix():
    model = T.tiny_onevision()
    with pytest.raises(ValueError, match="holitom layer=18 but the model has only 6 decoder layers.*inner=False"):
        vlm_prune.wrap(model, "holitom", keep=0.25)  # the official layer 18 on a 6-layer model: refused at wrap
    assert not hasattr(model, "vlm_prune")
    for other in ("divprune", "fastv"):
        with pytest.raises(ValueError, match=f"cannot be combined with '{other}'.*inner=False"):
            vlm_prune.wrap(T.tiny_onevision(), ["holitom", other], keep=0.25)
    stats = _stats([HoliTom(inner=False), "divprune"], keep=0.25)  # the outer stage alone combines
    assert [r["stage"] for r in stats["stages"]] == ["frames", "vision"] and stats["visual_tokens_out"] == [8, 8]
    for bad, match in (({"r": 1.0}, "r .*must be in \\[0, 1\\)"), ({"retain": 0.0}, "retain .*must be in \\(0, 1\\]"),
                       ({"layer": 0}, "layer must be a whole number >= 1"), ({"inner": 1}, "inner must be True")):
        with pytest.raises(ValueError, match=match):
            HoliTom(**bad)
    with pytest.raises(ValueError, match="'holitom' works in the 'frames' stage, which the llava adapter does not offer"):
        vlm_prune.wrap(T.tiny_llava(), "holitom")


def test_listed_as_one_method_in_two_stages():
    entry = next(m for m in vlm_prune.describe_methods() if m["name"] == "holitom")
    assert entry["stage"] == "frames+llm" and entry["own_defaults"]
    assert entry["knobs"] == {"tau": 0.8, "d": 0.0, "beta": 0.6, "k": 7, "max_window": 1024, "inner": True,
                              "layer": 18, "r": 0.5, "retain": 0.1}
    assert "round(target / (1 - r))" in entry["budget_note"]


def test_a_deep_copy_keeps_its_own_stages():
    import copy

    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=8)
    vlm_prune.wrap(model, HoliTom(layer=2), budget=5)
    clone = copy.deepcopy(model)
    try:
        methods = clone.vlm_prune.methods
        assert isinstance(methods["llm"], HoliTomMerge) and methods["llm"].owner is methods["frames"]
        assert methods["frames"] is not model.vlm_prune.methods["frames"]
        assert T.forward_stats(clone, inp)["visual_tokens_out"] == [5, 5]
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_keep_one_is_the_unwrapped_model(attn):
    """keep=1.0: prefill logits and a 10-step greedy generate equal the unwrapped model's, bit for bit."""
    model = T.tiny_onevision(attn=attn)
    inp = T.onevision_video_inputs(model, frames=8)
    with torch.no_grad():
        ref = model(**inp).logits
        ref_gen = model.generate(**inp, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    vlm_prune.wrap(model, HoliTom(layer=2), keep=1.0)
    try:
        with torch.no_grad():
            logits = model(**inp).logits
            gen = model.generate(**inp, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    assert torch.equal(logits, ref) and torch.equal(gen, ref_gen)
    assert stats["visual_tokens_out"] == stats["visual_tokens_in"]
    with torch.no_grad():
        assert torch.equal(model(**inp).logits, ref) and not hasattr(model, "vlm_prune")  # unwrapped


def test_eager_equals_sdpa():
    """The merge reads its attention on the side: eager and SDPA keep the same rows, equal logits."""
    out = {}
    for attn in ("eager", "sdpa"):
        model = T.tiny_onevision(attn=attn)
        inp = T.onevision_video_inputs(model, frames=8)
        vlm_prune.wrap(model, HoliTom(layer=3), keep=0.25)
        try:
            with torch.no_grad():
                logits = model(**inp).logits
                gen = model.generate(**inp, max_new_tokens=8, do_sample=False)
            out[attn] = (logits, model.vlm_prune.last_rows.clone(), gen)
        finally:
            vlm_prune.unwrap(model)
    (l1, r1, g1), (l2, r2, g2) = out["eager"], out["sdpa"]
    assert torch.equal(r1, r2) and torch.equal(g1, g2)
    kept = r1 >= 0
    assert int(kept.sum()) < r1.numel()
    torch.testing.assert_close(l1[kept], l2[kept], atol=1e-5, rtol=0)


def test_each_video_of_a_sample_is_merged_on_its_own():
    """Two videos in one prompt: each is one group with its own count (budget 5 each), and every token of
    a video is merged into a kept token of the same video."""
    model = T.tiny_onevision()
    vids = torch.randn(2, 8, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    ids, mask = T.prompts([[(T.VIDEO_TOKEN, 8 * 4 + 1), (T.VIDEO_TOKEN, 8 * 4 + 1)]], start=(7,))
    inp = {"input_ids": ids, "attention_mask": mask, "pixel_values_videos": vids}
    vlm_prune.wrap(model, HoliTom(layer=2), budget=5)
    method = model.vlm_prune.methods["llm"]
    seen = []
    select = method.select

    def recording(ctx):
        reds = select(ctx)
        seen.append((ctx.extras["groups"][0].clone(), ctx.extras["group_keep"], ctx.valid[0].clone(), reds[0]))
        return reds

    method.select = recording
    stats = T.forward_stats(model, inp)
    assert stats["visual_tokens_in"] == [64] and stats["visual_tokens_out"] == [10]
    (groups, keep, valid, red), = seen
    ids_ = torch.unique(groups[valid & (groups >= 0)]).tolist()
    assert len(ids_) == 2 and [keep[g] for g in ids_] == [5, 5]
    assert [int((groups == g).sum()) for g in ids_] == [10, 10]  # each video's outer stage: round(5 / 0.5)
    kept = torch.zeros_like(valid)
    kept[red.indices] = True
    for g in ids_:
        rows = torch.nonzero(groups == g).flatten()
        assert int(kept[rows].sum()) == 5
        assert bool((groups[red.merged_into[rows]] == g).all())  # merged within its own video
