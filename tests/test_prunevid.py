"""PruneVid against a small, independently written re-statement of the official algorithm
(Visual-AI/PruneVid@b12600c6176c606ee4b6b7d9e26f4aa46d0dfd42, the PLLaVA release:
models/pllava/modeling_pllava.py ``merge_frames_dynamic`` with ``cluster_dpc_knn``,
``refine_clusters``, ``segment_lengths``, ``spatial_merge_tokens``; models/pllava/elastic_cache.py
``VTPWindowCache.process_attention``; models/pllava/llama.py ``LlamaModelVTP``: the attention of
``selected_layer`` from the rows after the video), then through wrap() on LLaVA-OneVision and
Qwen2-VL video: budgets, batch = samples alone, refusals.

The re-statement follows the official control flow (batch of one, index loops); none of its code
is copied. Its one change: DPC-kNN's 1e-6 random density noise is left out (no ties arise here).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import tiny_models as T
import vlm_prune
from vlm_prune.frames.prunevid import (
    PruneVid,
    keep_per_group,
    prunevid_plan,
    question_attention,
    refine_labels,
    temporal_segments,
)

from test_budgets import _one_thread  # noqa: E402,F401  (autouse: one thread)


# ---- the official algorithm, restated ----------------------------------------------------------
def ref_dpc_knn(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """cluster_dpc_knn on one sample [N, C]: the cluster index of every token."""
    c = x.shape[1]
    dist = torch.cdist(x.float(), x.float()) / c ** 0.5
    near = torch.topk(dist, k=k, dim=-1, largest=False).values
    density = (-(near ** 2).mean(-1)).exp()
    denser = (density[None, :] > density[:, None]).float()
    delta = (dist * denser + dist.max() * (1 - denser)).min(-1).values
    down = torch.topk(delta * density, k=n).indices
    idx = dist[down].argmin(0)
    idx[down] = torch.arange(n)
    return idx


def ref_cluster_vectors(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """compute_cluster_vectors: each cluster's mean through a one-hot matrix product."""
    onehot = F.one_hot(idx, num_classes=n).float()
    return (onehot.t() @ x.float()) / onehot.sum(0).clamp(min=1)[:, None]


def ref_refine(labels: list[int]) -> list[int]:
    """refine_clusters, index by index."""
    n = len(labels)
    out = list(labels)
    for lab in sorted(set(labels)):
        idx = [i for i in range(n) if labels[i] == lab]
        segs, start, prev = [], idx[0], idx[0]
        for i in idx[1:]:
            if i == prev + 1:
                prev = i
            else:
                segs.append((start, prev))
                start = prev = i
        segs.append((start, prev))
        longest = max(e - s + 1 for s, e in segs)
        for s, e in segs:
            if longest == 1 or e - s + 1 != longest:
                for i in range(s, e + 1):
                    out[i] = -1
    i = 0
    while i < n:
        if out[i] != -1:
            i += 1
            continue
        start = i
        while i < n and out[i] == -1:
            i += 1
        end = i - 1
        left = right = None
        left_len = right_len = 0
        if start > 0:
            left = out[start - 1]
            j = start - 1
            while j >= 0 and out[j] == left:
                j -= 1
            left_len = start - j - 1
        if end < n - 1:
            right = out[end + 1]
            j = end + 1
            while j < n and out[j] == right:
                j += 1
            right_len = j - end - 1
        if left_len > right_len:
            new = left
        elif right_len > left_len:
            new = right
        else:
            new = left if left is not None else right
        for j in range(start, end + 1):
            out[j] = 0 if new is None else new
    return out


def ref_segment_lengths(labels: list[int]) -> list[int]:
    change = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    bounds = [0, *change, len(labels)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def ref_merge(video: torch.Tensor, tau: float, temporal_ratio: float, cluster_ratio: float):
    """merge_frames_dynamic on one video [T, L, C]: (features in the official order, static sizes,
    dynamic sizes, window sizes)."""
    t, l, c = video.shape
    idx = ref_dpc_knn(video.mean(1), int(t * temporal_ratio), k=min(7, t))
    windows = ref_segment_lengths(ref_refine(idx.tolist()))

    def spatial(feat):
        n = int(feat.shape[0] * cluster_ratio)
        return ref_cluster_vectors(feat, ref_dpc_knn(feat, n, 7), n)

    feats, static_sizes, dynamic_sizes, start = [], [], [], 0
    for w in windows:
        cur = video[start:start + w]
        u = F.normalize(cur.float(), dim=-1)
        sim = torch.einsum("wlc,tlc->wtl", u, u)
        sim = (sim.sum(-2) - 1).sum(-2) / (w * (w - 1))  # a 1-frame window: 0 / 0 (nan or inf), never above tau
        mask = sim > tau
        static = cur[:, mask].float().mean(0)
        if static.shape[0] > 14:
            static = spatial(static)
        dynamic = []
        for f in range(w):
            d = cur[f, ~mask].float()
            dynamic.append(spatial(d) if d.shape[0] > 14 else d)
        feats += [static, *dynamic]
        static_sizes.append(static.shape[0])
        dynamic_sizes.append(sum(d.shape[0] for d in dynamic))
        start += w
    return torch.cat(feats), static_sizes, dynamic_sizes, windows


def ref_select(scores: torch.Tensor, static_sizes, dynamic_sizes, windows, alpha: float) -> torch.Tensor:
    """VTPWindowCache.process_attention: the kept token indices (official order) from one score per token."""
    kept, start = [], 0
    for s, d, w in zip(static_sizes, dynamic_sizes, windows):
        window = scores[start:start + s + d]
        kept.append(torch.topk(window[:s], int(s * alpha)).indices + start)
        dyn = window[s:].view(w, -1)
        top = torch.topk(dyn, int(dyn.shape[-1] * alpha), dim=-1).indices
        kept += [top[i] + start + s + dyn.shape[-1] * i for i in range(w)]
        start += s + d
    return torch.cat(kept)


# ---- inputs ------------------------------------------------------------------------------------
def scenes_video(seed: int = 0, t: int = 8, n: int = 36, dim: int = 16) -> torch.Tensor:
    """[t, n, dim]: two scenes of t / 2 frames; in each, a random half of the slots barely moves
    (static) and the others change every frame."""
    g = torch.Generator().manual_seed(seed)
    frames = []
    for _ in range(2):
        base = torch.randn(n, dim, generator=g)
        still = torch.rand(n, generator=g) < 0.5
        for _ in range(t // 2):
            noise = torch.where(still[:, None], 0.05, 1.5) * torch.randn(n, dim, generator=g)
            frames.append(base + noise)
    return torch.stack(frames)


def match(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """The permutation p with ours[p[i]] == theirs[i] (asserted: a bijection, equal within 1e-5)."""
    dist = torch.cdist(theirs.float(), ours.float())
    p = dist.argmin(-1)
    assert sorted(p.tolist()) == list(range(ours.shape[0])), "not a one-to-one match"
    torch.testing.assert_close(ours[p].float(), theirs.float(), atol=1e-5, rtol=1e-5)
    return p


# ---- fidelity ----------------------------------------------------------------------------------
def test_refine_labels_equals_the_official_refine_clusters():
    rng = random.Random(0)
    for _ in range(300):
        labels = [rng.randrange(4) for _ in range(rng.randrange(1, 17))]
        assert refine_labels(labels) == ref_refine(labels), labels


@pytest.mark.parametrize("seed", range(3))
def test_temporal_segments_equal_the_official_windows(seed):
    video = scenes_video(seed, t=16)
    idx = ref_dpc_knn(video.mean(1), 4, k=7)
    assert temporal_segments(video, 0.25, 7) == ref_segment_lengths(ref_refine(idx.tolist()))


@pytest.mark.parametrize("seed", range(3))
def test_merge_and_selection_equal_the_official_at_its_defaults(seed):
    """No keep / budget: the merged tokens are the official ones (as a set, each once), and the
    selection keeps the same tokens as the official process_attention given the same scores."""
    video = scenes_video(seed, t=16)
    theirs, static_sizes, dynamic_sizes, windows = ref_merge(video, 0.8, 0.25, 0.5)
    assert len(windows) > 1 and any(s > 7 for s in static_sizes)  # scenes cut; a static group (> 14) clustered
    plan = prunevid_plan(video)
    ours = plan.reduction.features
    p = match(ours, theirs)
    # the groups: every official group's tokens are one of our groups, in the official order
    official_group = torch.cat([torch.full((s,), i) for i, s in enumerate(
        x for s, d, w in zip(static_sizes, dynamic_sizes, windows) for x in [s] + [d // w] * w)])
    assert torch.equal(plan.groups[p], official_group)
    scores = torch.rand(ours.shape[0], generator=torch.Generator().manual_seed(seed))
    kept_theirs = set(p[ref_select(scores[p], static_sizes, dynamic_sizes, windows, 0.4)].tolist())
    red = keep_per_group(scores, plan.groups, plan.group_keep, torch.ones(ours.shape[0], dtype=torch.bool))
    assert set(red.indices.tolist()) == kept_theirs
    assert len(kept_theirs) == sum(plan.group_keep)


def test_merged_tokens_sit_at_their_centres_and_record_their_members():
    video = scenes_video(1)
    t, n, _ = video.shape
    plan = prunevid_plan(video)
    red = plan.reduction
    into = red.merged_into
    assert bool((into >= 0).all())  # nothing dropped by the merge: every token folded into one
    flat = video.reshape(t * n, -1).float()
    for j, slot in enumerate(red.indices.tolist()):
        members = torch.nonzero(into == slot).flatten()
        assert slot in members.tolist()  # the centre is its own member
        torch.testing.assert_close(red.features[j].float(), flat[members].mean(0), atol=1e-5, rtol=1e-5)
    assert plan.tokens_per_frame == torch.bincount(red.indices // n, minlength=t).tolist()


@pytest.mark.parametrize("target", [10, 40, 73, 150, 250])
def test_a_target_is_reached_exactly(target):
    """keep / budget: the official merge, then target tokens shared over its groups (each within
    one token of its real share) when the merge leaves more; else the merge itself leaves target."""
    video = scenes_video(2)
    official = prunevid_plan(video)
    merged = official.reduction.indices.numel()
    plan = prunevid_plan(video, target=target)
    assert sum(plan.group_keep) == target
    sizes = torch.bincount(plan.groups).tolist()
    assert all(k <= s for k, s in zip(plan.group_keep, sizes))
    if target <= merged:
        assert torch.equal(plan.reduction.indices, official.reduction.indices)
        assert all(abs(k - s * target / merged) < 1 for k, s in zip(plan.group_keep, sizes))
    else:
        assert plan.reduction.indices.numel() == target and plan.group_keep == sizes


def test_question_attention_equals_the_eager_attention_weights():
    """The llm stage's score of every row: max over heads and over the rows after the video of the
    layer's softmax attention, as the official reads it from output_attentions (eager), here from
    the unwrapped layer run eagerly on the same hidden states."""
    model = T.tiny_onevision(attn="eager")
    inp = T.onevision_video_inputs(model, batch=1, frames=8)
    seen = []
    method = PruneVid(layer=2)
    select = method.select

    def recording(ctx):
        seen.append((ctx, question_attention(ctx)))
        return select(ctx)

    method.select = recording
    vlm_prune.wrap(model, method)
    T.forward_stats(model, inp)
    (ctx, ours), = seen
    layer = ctx.layer_module
    assert layer is model.model.language_model.layers[1]  # scored in the layer before the removal
    lm = model.model.language_model
    x = layer.input_layernorm(ctx.hidden)
    pe = lm.rotary_emb(x, ctx.positions)
    s = x.shape[1]
    causal = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad():
        _, weights = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=causal)
    last_visual = int(torch.nonzero(ctx.visual[0]).max())
    ref = weights[0, :, last_visual + 1:].amax(0).amax(0)
    torch.testing.assert_close(ours[0], ref.float(), atol=1e-6, rtol=1e-5)


# ---- through wrap() ----------------------------------------------------------------------------
CASES = {
    "onevision": (T.tiny_onevision, lambda m, batch=2: T.onevision_video_inputs(m, batch=batch, frames=8)),
    "qwen2_vl": (T.tiny_qwen2_vl, lambda m, batch=2: T.qwen2_vl_inputs(m, batch=batch, video=True)),
    "qwen2_5_vl": (lambda: T.tiny_qwen2_vl(v25=True), lambda m, batch=2: T.qwen2_vl_inputs(m, batch=batch, video=True)),
}


def _run(case: str, method, **kw):
    make, inputs = CASES[case]
    model = make()
    inp = inputs(model)
    vlm_prune.wrap(model, method, **kw)
    return T.forward_stats(model, inp)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kw, expect", [({"keep": 0.5}, 16), ({"keep": 0.25}, 8), ({"budget": 3}, 3),
                                        ({"keep": 1.0}, 32)])
def test_the_video_keeps_its_target(case, kw, expect):
    stats = _run(case, PruneVid(layer=2, tau=0.0), **kw)
    assert stats["visual_tokens_in"] == [32, 32]
    assert stats["visual_tokens_out"] == [expect, expect]
    frames, llm = [r for r in stats["stages"] if r["stage"] in ("frames", "llm")]
    assert frames["method"] == llm["method"] == "prunevid" and llm["layer"] == 2
    assert llm["tokens_out"] == [expect, expect]


def test_official_counts_without_a_target():
    """No keep / budget: the merge's official counts, then int(0.4 m) of each of its groups in the LLM."""
    seen = []

    class Recording(PruneVid):
        def select(self, ctx):
            seen.append((ctx.extras["groups"].clone(), ctx.extras["group_keep"], ctx.valid.clone()))
            return super().select(ctx)

    stats = _run("qwen2_vl", Recording(layer=2))
    (groups, keep, valid), = seen
    frames = next(r for r in stats["stages"] if r["stage"] == "frames")
    for b in range(2):
        mine = torch.unique(groups[b][valid[b] & (groups[b] >= 0)]).tolist()
        sizes = [int((groups[b] == g).sum()) for g in mine]
        assert sum(sizes) == frames["tokens_out"][b]
        assert [keep[g] for g in mine] == [int(0.4 * m) for m in sizes]
        assert stats["visual_tokens_out"][b] == sum(int(0.4 * m) for m in sizes)


def test_refusals():
    with pytest.raises(ValueError, match="frames stage.*llm stage.*does not offer 'frames'"):
        vlm_prune.wrap(T.tiny_llava(), "prunevid", keep=0.25)
    with pytest.raises(ValueError, match="early_kv must be 'keep'.*or 'drop'"):
        PruneVid(early_kv="official")
    with pytest.raises(ValueError, match="'prunevid' and 'pact' both act in the 'llm' stage"):
        vlm_prune.wrap(T.tiny_onevision(), ["prunevid", "pact"], keep=0.25)
    for other in ("uniform", "divprune"):
        with pytest.raises(ValueError, match=f"cannot be combined with '{other}': wrap with 'prunevid' alone"):
            vlm_prune.wrap(T.tiny_onevision(), [other, "prunevid"], keep=0.25)
    with pytest.raises(ValueError, match="alpha must be a fraction"):
        PruneVid(alpha=0.0)
    with pytest.raises(ValueError, match="layer must be a whole number"):
        PruneVid(layer=0)
    model = T.tiny_onevision()
    with pytest.raises(ValueError, match="layer=11 but the model has only 6 decoder layers"):  # default layer 11
        vlm_prune.wrap(model, "prunevid", keep=0.25)
    assert not hasattr(model, "vlm_prune")


def test_listed_as_one_method_in_two_stages():
    entry = next(m for m in vlm_prune.describe_methods() if m["name"] == "prunevid")
    assert entry["stage"] == "frames+llm" and entry["own_defaults"]
    assert entry["knobs"] == {"tau": 0.8, "temporal_ratio": 0.25, "cluster_ratio": 0.5, "alpha": 0.4, "layer": 11, "k": 7,
                              "early_kv": "keep"}
    assert entry["supported"] == ["llava_onevision", "qwen2_vl", "llava_next_video", "llava_onevision15", "qwen3_vl",
                                  "glm4v", "qwen3_5"]


def test_a_deep_copy_keeps_one_method_in_two_stages():
    """copy.deepcopy of a wrapped model: the copy's merge reads the copy's PruneVid (its knobs and
    budget), not the original's, and prunes the same."""
    import copy

    make, inputs = CASES["qwen2_vl"]
    model = make()
    inp = inputs(model)
    vlm_prune.wrap(model, PruneVid(layer=2), budget=5)
    clone = copy.deepcopy(model)
    try:
        methods = clone.vlm_prune.methods
        assert methods["frames"].owner is methods["llm"] and methods["llm"] is not model.vlm_prune.methods["llm"]
        assert T.forward_stats(clone, inp)["visual_tokens_out"] == [5, 5]
    finally:
        vlm_prune.unwrap(model)


def test_early_kv_drop_decodes_as_the_official_cache():
    """early_kv="drop": each decode step equals the official VTPWindowCache decode - the unwrapped model
    on the merged video's rows with the llm stage's dropped rows hidden from the pruning layer on in
    the prompt, then removed from EVERY layer's KV cache (the earlier layers' too) before the decode
    steps, which continue the positions. The default (early_kv="keep") decodes otherwise."""
    from test_generate_matrix import pipeline_reference, record_prefill

    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, batch=1, frames=8)
    steps = 4

    def decode_logits(early_kv):
        vlm_prune.wrap(model, PruneVid(layer=3, tau=2.0, early_kv=early_kv), keep=0.25)  # nothing static
        try:
            rec = record_prefill(model, inp)
            with torch.no_grad():
                out = model.generate(**inp, max_new_tokens=steps, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
            if early_kv == "drop":
                with pytest.raises(ValueError, match="early_kv='drop'.*use_cache=False"):
                    model.generate(**inp, max_new_tokens=2, do_sample=False, use_cache=False)
        finally:
            vlm_prune.unwrap(model)
        return rec, out.sequences[:, inp["input_ids"].shape[1]:], torch.stack(out.logits, 1)

    rec, tokens, logits = decode_logits("drop")
    ref, hooks = pipeline_reference(model, inp, rec)
    dropped = hooks.hidden[3][0]
    assert bool(dropped.any()) and hooks.hidden[2] is None
    with torch.no_grad():
        with hooks:
            first = model(**ref, use_cache=True)
        cache = first.past_key_values
        for layer in cache.layers:  # the official cache surgery: every layer keeps the kept rows only
            layer.keys, layer.values = layer.keys[:, :, ~dropped], layer.values[:, :, ~dropped]
        ref_logits = [first.logits[:, -1]]
        pos = int(rec["pos"][0, 0].max()) + 1
        for step in range(steps - 1):
            tok = tokens[:, step:step + 1]
            n = cache.get_seq_length()
            out = model(input_ids=tok, past_key_values=cache, position_ids=torch.tensor([[pos + step]]),
                        attention_mask=torch.ones(1, n + 1, dtype=torch.long))
            cache = out.past_key_values
            ref_logits.append(out.logits[:, -1])
    torch.testing.assert_close(logits, torch.stack(ref_logits, 1), atol=1e-5, rtol=1e-5)
    _, _, kept_logits = decode_logits("keep")
    torch.testing.assert_close(kept_logits[:, 0], logits[:, 0], atol=1e-5, rtol=1e-5)  # the same prefill
    assert float((kept_logits[:, 1:] - logits[:, 1:]).abs().max()) > 1e-4  # decode steps differ


def test_early_kv_drop_batch_and_beams_equal_each_sample_alone():
    """early_kv="drop" keeps the cache bookkeeping right through padding, beams and returned sequences:
    a padded batch of 2 decodes as each sample alone (greedy and 3 beams)."""
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=8)
    vlm_prune.wrap(model, PruneVid(layer=3, tau=2.0, early_kv="drop"), keep=0.25)
    try:
        with torch.no_grad():
            for kw in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
                both = model.generate(**inp, max_new_tokens=6, **kw)
                for b in range(2):
                    valid = inp["attention_mask"][b].bool()
                    one = {"input_ids": inp["input_ids"][b:b + 1, valid], "attention_mask": inp["attention_mask"][b:b + 1, valid],
                           "pixel_values_videos": inp["pixel_values_videos"][b:b + 1]}
                    alone = model.generate(**one, max_new_tokens=6, **kw)
                    assert torch.equal(both[b, -6:], alone[0, -6:]), (kw, b)
    finally:
        vlm_prune.unwrap(model)
