"""Fidelity of the video token-reduction records (frames stage) against small, independently
written re-statements of their official algorithms, named with the commit read:

- VidCom2: xuyang-liu16/VidCom2@944a17d14f4848ad080a65eab2b0711a760fa154,
  token_compressor/vidcom2/vidcom2.py (``vidcom2_compression`` with the "linear" mapper).
- FastVID: LunarShen/FastVID@a40a109cb8df20e8c2c17c6850f8269717369990, the LLaVA-OneVision
  version (fastvid_llavaonevision/.../language_model/modeling_qwen2.py, the "FastVID" block).
- HoliTom: cokeshao/HoliTom@e9b2972f6895c9e7d7fe74eb8c3a2ecaab8056e0, holitom/llava_arch.py
  (the video branch of prepare_inputs_labels_for_multimodal and the methods it calls).
- DyCoke: KD-TAO/DyCoke@dd7463498203479d0ff6f2d29c4e72928c0af244, llava/model/llava_arch.py
  (``dycole_ttm``).

The re-statements follow the official control flow; none of their code is copied.
"""
from __future__ import annotations

import math

import pytest
import torch

import tiny_models as T
import tiny_models_qwen3 as Q
import vlm_prune
from vlm_prune.frames.dycoke import DyCoke, ttm_plan, ttm_references
from vlm_prune.frames.fastvid import FastVID, fastvid_plan, frame_counts
from vlm_prune.frames.holitom import HoliTom, holitom_plan, static_windows
from vlm_prune.frames.vidcom2 import VidCom2, apportion
from vlm_prune.methods.base import FramesContext


from test_budgets import _one_thread  # noqa: E402,F401  (autouse: one thread)


# ---- VidCom2 ----------------------------------------------------------------------------------
def official_vidcom2(flat: torch.Tensor, tpf: int, base: float) -> tuple[torch.Tensor, list[int]]:
    """The official pipeline on a flattened video [T * tpf, D]: (kept global indices, tokens per frame).

    Half the channels with the lowest variance; per-token L2 norm; Gaussian similarity (widths
    1/8 .. 2) to the video centre and to each frame centre; frame rate base (1 + p - mean p) with
    p = softmax((s - max s) / 0.01), s = -mean video similarity, capped at 1; k = round(rate tpf),
    at least 1; the k lowest summed similarities of each frame; frame offsets added."""
    var = flat.var(dim=0, unbiased=False)
    chans = torch.topk(var, k=int(flat.shape[1] * 0.5), largest=False).indices
    x = flat[:, chans].view(-1, tpf, len(chans))
    x = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    def sim(c):
        d = ((x - c) ** 2).sum(-1)
        return sum(torch.exp(-d / (2 * a)) for a in (0.125, 0.25, 0.5, 1.0, 2.0))
    v, f = sim(x.mean(dim=(0, 1), keepdim=True)), sim(x.mean(dim=1, keepdim=True))
    s = -v.mean(-1)
    p = torch.softmax((s - s.max()) / 0.01, 0)
    rate = (base * (1 + p - p.mean())).clamp(max=1.0)
    ks = [max(1, int(k)) for k in (rate * tpf).round().long().tolist()]
    out = []
    for i, k in enumerate(ks):
        out.append(torch.topk((v + f)[i], k, largest=False).indices.sort().values + i * tpf)
    return torch.cat(out), ks


def _video(t: int, n: int, d: int, distinct: int | None, seed: int = 0) -> torch.Tensor:
    """[t, n, d] frames of one scene with noise; frame ``distinct`` (if any) shows its negative."""
    g = torch.Generator().manual_seed(seed)
    scene = torch.randn(n, d, generator=g)
    frames = scene + 0.3 * torch.randn(t, n, d, generator=g)
    if distinct is not None:
        frames[distinct] = -scene + 0.3 * torch.randn(n, d, generator=g)
    return frames


def test_vidcom2_keeps_the_official_tokens_when_the_official_counts_add_up():
    t, n = 4, 16
    feats = _video(t, n, 24, distinct=2)
    ref, ks = official_vidcom2(feats.reshape(t * n, -1), n, base=0.25)
    assert ks == [3, 3, 7, 3]  # the distinct frame gets 0.25 (1 + 1 - 1/4) of its tokens: the case holds
    plan = VidCom2().allocate(FramesContext(features=feats, grid=(4, 4), n_total=16))
    assert torch.equal(plan.reduction.indices, ref)
    assert plan.tokens_per_frame == ks and plan.kept_frames == [0, 1, 2, 3]
    assert plan.reduction.features is None and plan.reduction.sizes is None  # kept where they were


@pytest.mark.parametrize("seed", range(4))
def test_vidcom2_spends_exactly_the_budget_within_a_token_of_each_official_frame(seed):
    t, n = 6, 9
    feats = _video(t, n, 16, distinct=seed % t if seed % 2 else None, seed=seed)
    for n_total in (5, 13, 27, 40):
        base = n_total / (t * n)
        ref, ks = official_vidcom2(feats.reshape(t * n, -1), n, base)
        plan = VidCom2().allocate(FramesContext(features=feats, grid=(3, 3), n_total=n_total))
        got = plan.tokens_per_frame
        assert sum(got) == n_total == plan.reduction.indices.numel()
        assert all(abs(a - b) <= 1 for a, b in zip(got, ks)), (got, ks)
        ref_sets = [set(ref[(ref >= i * n) & (ref < (i + 1) * n)].tolist()) for i in range(t)]
        for i, k in enumerate(got):  # each frame keeps the official ranking's first k
            mine = set(plan.reduction.indices[(plan.reduction.indices >= i * n) & (plan.reduction.indices < (i + 1) * n)].tolist())
            assert mine <= ref_sets[i] or ref_sets[i] <= mine, (i, mine, ref_sets[i])


def test_apportion_is_exact_capped_and_keeps_a_token_per_frame():
    assert apportion([2.5, 2.5, 3.0], 8, cap=4) == [3, 2, 3]  # ties of the remainder: the earlier frame
    assert apportion([4.0, 1.0, 1.0], 9, cap=4) == [4, 3, 2]  # capped: the rest to the largest shares with room
    assert apportion([5.6, 0.2, 0.2], 6, cap=9) == [4, 1, 1]  # the official clamp(min=1), when the total allows
    assert apportion([0.9, 0.05, 0.05], 1, cap=4) == [1, 0, 0]
    assert apportion([1.0] * 3, 50, cap=4) == [4, 4, 4]


@pytest.mark.parametrize("family", ["onevision", "qwen2_vl", "qwen2_5_vl"])
def test_vidcom2_in_the_model_sees_the_projected_frame_tokens(family):
    """Through wrap(): the method gets the video's own [T, N, D] tokens (those the unwrapped model
    feeds the LLM) and the kept rows are the plan's slots, for each sample of a batch of 2."""
    if family == "onevision":
        model = T.tiny_onevision()
        inp = T.onevision_video_inputs(model, frames=6)
        with torch.no_grad():
            feats = model.model.get_video_features(pixel_values_videos=inp["pixel_values_videos"]).pooler_output
        videos = [f[:-1].reshape(6, 4, -1) for f in feats]  # the video newline is not a frame token
    else:
        model = T.tiny_qwen2_vl(v25=family == "qwen2_5_vl")
        inp = T.qwen2_vl_inputs(model, video=True)
        with torch.no_grad():
            feats = model.model.get_video_features(pixel_values_videos=inp["pixel_values_videos"],
                                                   video_grid_thw=inp["video_grid_thw"]).pooler_output
        videos = [f.reshape(2, 16, -1) for f in feats]
    vlm_prune.wrap(model, "vidcom2", keep=0.25)
    stats = T.forward_stats(model, inp)  # (unwraps)
    rec = stats["stages"][0]
    for b, video in enumerate(videos):
        t, n, _ = video.shape
        plan = VidCom2(keep=0.25).allocate(FramesContext(features=video, grid=None, n_total=t * n // 4))
        assert rec["videos"][b]["tokens_per_frame"] == plan.tokens_per_frame
        assert rec["tokens_out"][b] == stats["visual_tokens_out"][b] == t * n // 4


@pytest.mark.parametrize("method", ["vidcom2", "dycoke"])
def test_records_generate_on_qwen2_5_vl_video_batch2(method):
    """Qwen2.5-VL video (2 temporal slices of 16 tokens), batch 2 with padding, SDPA: a 6-step greedy
    generate; each video keeps its budget and the answer equals the unwrapped model's own generate()
    on the kept rows at their original M-RoPE positions (the matrix's vision-stage reference)."""
    from test_generate_matrix import record_prefill, vision_reference

    model = T.tiny_qwen2_vl(v25=True)
    inp = T.qwen2_vl_inputs(model, video=True)
    vlm_prune.wrap(model, method, keep=0.75)
    try:
        rec = record_prefill(model, inp)
        with torch.no_grad():
            got = model.generate(**inp, max_new_tokens=6, do_sample=False)
    finally:
        vlm_prune.unwrap(model)
    assert rec["stats"]["visual_tokens_out"] == [24, 24]
    ref_inp, hooks = vision_reference(model, inp, rec)
    with torch.no_grad(), hooks:
        ref = model.generate(**ref_inp, max_new_tokens=6, do_sample=False)
    assert torch.equal(got[:, inp["input_ids"].shape[1]:], ref)


# ---- FastVID ----------------------------------------------------------------------------------
def official_fastvid(video: torch.Tensor, attn: torch.Tensor, retention: float, c: int, tau: float, d: float,
                     p: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The official OneVision block, batched over frames as the official: (kept slot indices in
    order, their features). Global features = frame means (the Qwen2.5-VL version's); the density's
    1e-6 random tie-break noise is left out."""
    t, n, dim = video.shape
    ar = torch.arange(t)[:, None]
    slots = torch.arange(t * n).view(t, n)
    g = video.mean(1)
    g = g / g.norm(dim=1, keepdim=True)
    sim = (g[:-1] * g[1:]).sum(1)
    cuts = torch.unique(torch.cat([torch.topk(sim, c - 1, largest=False).indices,
                                   torch.nonzero(sim < tau).squeeze(1)])).sort().values
    padded = torch.nn.functional.pad(cuts, (1, 1), value=-1)
    padded[-1] = t - 1
    sizes = padded.diff().tolist()
    retain = int(n * retention)
    n_sal = retain - int(retain * d)
    n_ctx = retain - n_sal
    ctx_list = torch.zeros(t, dtype=torch.long)
    off = 0
    for length in sizes:
        cur = n_ctx * length // ((length + p - 1) // p)
        anchor = (torch.arange(length - 1, -1, -1) % p) == 0
        ctx_list[off:off + length][anchor] = cur
        off += length
    sal = torch.topk(attn, n_sal, dim=1).indices
    keep, feats = [slots[ar.expand(-1, n_sal), sal].flatten()], [video[ar.expand(-1, n_sal), sal].reshape(-1, dim)]
    mask = torch.ones(t, n, dtype=torch.bool)
    mask.scatter_(1, sal, False)
    rest = torch.arange(n).expand(t, -1)[mask].view(t, n - n_sal)
    tok = video[ar.expand(-1, n - n_sal), rest]
    tok_slots = slots[ar.expand(-1, n - n_sal), rest]
    dist = torch.cdist(tok, tok) / dim ** 0.5
    near = torch.topk(dist, k=4, dim=-1, largest=False).values
    dens = (-(near ** 2).mean(-1)).exp()
    higher = (dens[:, None, :] > dens[:, :, None]).float()
    dmax = dist.flatten(1).max(-1)[0][:, None, None]
    score = (dist * higher + dmax * (1 - higher)).min(-1)[0] * dens

    def dtm(anchors, members):  # anchors [K, D], members [M, D]
        s = (members / members.norm(dim=-1, keepdim=True)) @ (anchors / anchors.norm(dim=-1, keepdim=True)).t()
        one = torch.zeros(members.shape[0], anchors.shape[0])
        one.scatter_(1, s.argmax(1, keepdim=True), 1)
        w = (1 / (one.sum(0)[:, None] + 1)).clamp(min=beta)
        agg = one.t() @ members / one.sum(0).clamp(min=1)[:, None]
        return w * anchors + (1 - w) * agg

    single = ctx_list == n_ctx
    for f in torch.nonzero(single).flatten().tolist():
        pick = torch.topk(score[f], n_ctx).indices
        keep.append(tok_slots[f, pick])
        feats.append(dtm(tok[f, pick], tok[f]))
    off = 0
    for length in sizes:
        if length > 1:
            seg = slice(off, off + length)
            pool = tok[seg].reshape(-1, dim)
            cur = int(ctx_list[seg][-1])
            for f in [off + j for j in range(length) if ctx_list[off + j] > n_ctx]:
                pick = torch.topk(score[f], cur).indices
                keep.append(tok_slots[f, pick])
                feats.append(dtm(tok[f, pick], pool))
        off += length
    keep, feats = torch.cat(keep), torch.cat(feats)
    order = torch.argsort(keep)
    return keep[order], feats[order]


def _two_scenes(t: int, n: int, dim: int, cut: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g)
    video = torch.stack([(a if i < cut else b) for i in range(t)]) + 0.4 * torch.randn(t, n, dim, generator=g)
    return video


@pytest.mark.parametrize("case", ["segments", "single frames"])
def test_fastvid_equals_the_official_block(case):
    """Two 3-frame segments merged across frames at their anchor frame (c=2, tau=-1, p=3), and
    four one-frame segments merged within each frame (c=4): kept slots and merged features equal
    the official block's where its counts spend the budget exactly (they do here: asserted)."""
    t = 6 if case == "segments" else 4
    n, dim = 16, 12
    video = _two_scenes(t, n, dim, cut=3 if case == "segments" else 2)
    attn = torch.rand(t, n, generator=torch.Generator().manual_seed(5))
    c, p = (2, 3) if case == "segments" else (4, 4)
    retention, d, beta, tau = 0.5, 0.4, 0.6, (-1.0 if case == "segments" else 0.9)
    ref_slots, ref_feats = official_fastvid(video, attn, retention, c, tau, d, p, beta)
    n_total = int(retention * t * n)
    assert ref_slots.numel() == n_total  # the official counts spend the budget: the case holds
    plan = fastvid_plan(video, attn, n_total, c=c, tau=tau, d=d, p=p, beta=beta)
    assert torch.equal(plan.reduction.indices, ref_slots)
    torch.testing.assert_close(plan.reduction.features, ref_feats, atol=1e-6, rtol=1e-6)
    merged = ~(plan.reduction.features == video.reshape(t * n, dim)[plan.reduction.indices]).all(-1)
    assert int(merged.sum()) == (2 * 9 if case == "segments" else 4 * 3)  # every anchor changed, no salient token did


def test_fastvid_counts_spend_the_budget_exactly():
    # 3 + 1 frames, retain 5 each: 3 salient + context 2 (one-frame segment: 2; 3 frames, p=4: one anchor with 6)
    assert frame_counts([3, 1], n=16, n_total=20, d=0.4, p=4) == ([3, 3, 3, 3], [0, 0, 6, 2])
    sal, ctx = frame_counts([3, 1], n=16, n_total=23, d=0.4, p=4)  # 3 left by the floors go to salient tokens
    assert sal == [4, 4, 4, 3] and sum(sal) + sum(ctx) == 23
    # top_up=False: the official counts, retain int(23 / 4) = 5 per frame as at 20, 3 short
    assert frame_counts([3, 1], n=16, n_total=23, d=0.4, p=4, top_up=False) == ([3, 3, 3, 3], [0, 0, 6, 2])
    sal, ctx = frame_counts([2], n=4, n_total=3, d=0.4, p=4)  # below a token per frame
    assert sum(sal) + sum(ctx) == 3 and all(s + c <= 4 for s, c in zip(sal, ctx))


def test_fastvid_needs_the_tower_attention():
    with pytest.raises(ValueError, match="supports llava_onevision, qwen2_vl"):
        vlm_prune.wrap(Q.tiny_qwen3_vl(), "fastvid", keep=0.25)  # no tap on Qwen3-VL's tower
    with pytest.raises(ValueError, match="tower's attention"):
        FastVID(keep=0.5).allocate(FramesContext(features=torch.randn(2, 4, 8), grid=(2, 2), n_total=4))


def test_fastvid_in_the_model_ranks_by_the_pooled_tower_attention():
    """Through wrap() on LLaVA-OneVision: salient tokens are the top of the tower attention the
    adapter pools to each frame's grid (d=0: all salient)."""
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=4)
    seen = []

    class Recording(FastVID):
        def allocate(self, ctx):
            plan = super().allocate(ctx)
            seen.append((torch.stack([ctx.tower_attention(i)[0] for i in range(4)]), plan))
            return plan

    vlm_prune.wrap(model, Recording(d=0.0), keep=0.5)
    stats = T.forward_stats(model, inp)
    assert stats["visual_tokens_out"] == [8, 8] and len(seen) == 2
    for attn, plan in seen:
        assert attn.shape == (4, 4) and torch.allclose(attn.sum(), attn.sum())
        top = torch.cat([torch.topk(attn[i], 2).indices.sort().values + 4 * i for i in range(4)])
        assert torch.equal(plan.reduction.indices, top)


# ---- HoliTom ----------------------------------------------------------------------------------
def official_windows(sim: torch.Tensor, tau: float, max_window: int) -> list[tuple[int, int]]:
    """select_static_windows: the [T, T] saved-token table from cumulative products of the
    thresholded similarities, then the DP over window ends and the backtrack."""
    t = sim.shape[0] + 1
    table = torch.ones(t, t, sim.shape[1])
    for s in range(t - 1):
        cum = torch.cumprod(sim[s:] > tau, dim=0)
        table[s, s + 1:s + 1 + len(cum)] = cum.float()
    lengths = (torch.arange(t)[None] - torch.arange(t)[:, None]).clamp(min=0)
    saved = table.sum(-1) * lengths
    dp, prev = torch.zeros(t), torch.zeros(t, dtype=torch.long)
    for i in range(t):
        best, at = (dp[i - 1] if i > 0 else 0), i
        for w in range(2, min(i + 1, max_window) + 1):
            j = i - w
            val = (dp[j] if j >= 0 else 0) + saved[j + 1, i]
            if val > best:
                best, at = val, j + 1
        dp[i], prev[i] = best, at
    out, i = [], t - 1
    while i >= 0:
        out.append((int(prev[i]), i))
        i = int(prev[i]) - 1
    return out[::-1]


def official_holitom(video: torch.Tensor, attn: torch.Tensor, retain: float, tau: float, beta: float, k: int):
    """The official outer stage with D = 0 (its default): (kept slots ascending, their features),
    each token placed at its slot (static ones in the window's first frame), the density's random
    tie-break left out. Also returns the official counts' total."""
    t, n, dim = video.shape
    x = torch.nn.functional.normalize(video, dim=-1)
    sim = torch.nn.functional.cosine_similarity(x[:-1], x[1:], dim=-1)
    windows = official_windows(sim, tau, 1024)
    reduced = sum(int((sim[s:e] > tau).all(0).sum()) * (e - s) for s, e in windows if e > s)
    r = min(retain / ((t * n - reduced) / (t * n)), 1)
    slots, feats = [], []

    def by_density(feat, pos):  # merge_tokens_by_density + merge_tokens_by_clustering, one sample
        m = round(feat.shape[0] * r)
        dist = torch.cdist(feat[None], feat[None])[0] / dim ** 0.5
        near = torch.topk(dist, min(k, m), dim=-1, largest=False).values
        dens = (-(near ** 2).mean(-1)).exp()
        higher = (dens[None, :] > dens[:, None]).float()
        score = (dist * higher + dist.max() * (1 - higher)).min(-1)[0] * dens
        centres = torch.topk(score, m).indices.sort().values
        others = torch.tensor([i for i in range(feat.shape[0]) if i not in centres.tolist()], dtype=torch.long)
        owner = dist[others][:, centres].argmin(-1)
        out = []
        for c in range(m):
            members = feat[others[owner == c]]
            out.append(beta * feat[centres[c]] + (1 - beta) * members.mean(0) if len(members) else feat[centres[c]])
        return pos[centres], torch.stack(out)

    for s, e in windows:
        mask = torch.zeros(n, dtype=torch.bool) if s == e else (sim[s:e] > tau).all(0)
        if s < e and mask.any():
            pos, f = by_density(video[s:e + 1][:, mask].mean(0), torch.nonzero(mask).flatten())
            slots.append(pos + s * n)
            feats.append(f)
        dyn = torch.nonzero(~mask).flatten()
        keep = math.ceil(len(dyn) * r)  # round(ceil(L r) (1 - 0))
        for f in range(s, e + 1):
            top = attn[f, dyn].topk(keep).indices
            slots.append(dyn[top] + f * n)
            feats.append(video[f, dyn[top]])
    slots, feats = torch.cat(slots), torch.cat(feats)
    order = torch.argsort(slots)
    return slots[order], feats[order]


def _static_video(seed: int = 0) -> torch.Tensor:
    """4 frames of 16 tokens: slots 0-7 stay put through frames 0-2, the rest change every frame."""
    g = torch.Generator().manual_seed(seed)
    still = torch.randn(8, 12, generator=g)
    video = torch.randn(4, 16, 12, generator=g)
    video[:3, :8] = still + 0.01 * torch.randn(3, 8, 12, generator=g)
    return video


def test_holitom_windows_equal_the_official_dp():
    for seed in range(3):
        video = _static_video(seed)
        if seed:
            video[2:, 3:5] = video[1, 3:5]  # another still patch, over a different span
        x = torch.nn.functional.normalize(video, dim=-1)
        sim = (x[:-1] * x[1:]).sum(-1)
        for max_window in (2, 3, 1024):
            assert static_windows(sim, 0.8, max_window)[0] == official_windows(sim, 0.8, max_window)
    assert static_windows(sim, 0.8, 1024)[0] == [(0, 2), (3, 3)]


def test_holitom_equals_the_official_outer_stage():
    """Frames 0-2 form a window whose 8 still slots average into 8 static tokens (16 saved); at
    retain 3/8 the official keeps round(8 r) = 4 static clusters, ceil(8 r) = 4 dynamic tokens per
    window frame and 8 of the last frame: 24 = the budget, and the same tokens here."""
    video = _static_video()
    attn = torch.rand(4, 16, generator=torch.Generator().manual_seed(3))
    ref_slots, ref_feats = official_holitom(video, attn, retain=24 / 64, tau=0.8, beta=0.6, k=7)
    assert ref_slots.numel() == 24  # the official counts spend the budget: the case holds
    plan = holitom_plan(video, attn, 24)
    assert torch.equal(plan.reduction.indices, ref_slots)
    torch.testing.assert_close(plan.reduction.features, ref_feats, atol=1e-6, rtol=1e-6)
    assert plan.tokens_per_frame == [8, 4, 4, 8]  # static tokens sit in the window's first frame


def test_holitom_tau_065_equals_the_official_outer_stage_at_its_10_percent_setting():
    """The official 10% scripts run T=0.65 (the others 0.8): slots 8-11 drift (cosine 0.71 - 0.90
    through frames 0-2), static at 0.65 only; HoliTom(tau=0.65) keeps the official T=0.65 tokens."""
    video = _static_video()
    g = torch.Generator().manual_seed(10)
    video[:3, 8:12] = torch.randn(4, 12, generator=g) + 0.5 * torch.randn(3, 4, 12, generator=g)
    attn = torch.rand(4, 16, generator=torch.Generator().manual_seed(3))
    ref_slots, ref_feats = official_holitom(video, attn, retain=20 / 64, tau=0.65, beta=0.6, k=7)
    assert ref_slots.numel() == 20  # the official counts spend the budget: the case holds
    assert not torch.equal(official_holitom(video, attn, retain=20 / 64, tau=0.8, beta=0.6, k=7)[0], ref_slots)
    plan = holitom_plan(video, attn, 20, tau=0.65)
    assert torch.equal(plan.reduction.indices, ref_slots)
    torch.testing.assert_close(plan.reduction.features, ref_feats, atol=1e-6, rtol=1e-6)


def test_holitom_spends_the_budget_exactly_and_forgoes_windows_that_undercut_it():
    video = _static_video()
    attn = torch.rand(4, 16, generator=torch.Generator().manual_seed(3))
    for n_total in (3, 10, 25, 47):
        assert int(holitom_plan(video, attn, n_total).reduction.indices.numel()) == n_total
    plan = holitom_plan(video, attn, 60)  # 48 tokens would remain after averaging: no windows
    assert plan.reduction.indices.numel() == 60 and plan.reduction.features is not None
    assert torch.equal(plan.reduction.features, video.reshape(64, 12)[plan.reduction.indices])


def test_holitom_needs_the_tower_attention():
    with pytest.raises(ValueError, match="supports llava_onevision, qwen2_vl"):
        vlm_prune.wrap(Q.tiny_qwen3_vl(), "holitom", keep=0.25)  # no tap on Qwen3-VL's tower
    with pytest.raises(ValueError, match="tower's attention"):
        HoliTom(keep=0.5).allocate(FramesContext(features=torch.randn(2, 4, 8), grid=(2, 2), n_total=4))


# ---- DyCoke (TTM) -----------------------------------------------------------------------------
def official_ttm(video: torch.Tensor, k: float) -> list[set[int]]:
    """dycole_ttm on [T, N, D] (T even): the slots each frame keeps. Pairs (i, i+1): frame i whole,
    frame i+1 its int((1 - k) N) tokens least similar to frame i; then for i in range(0, T - 4, 4)
    frame i+2 is replaced by its int((1 - k) N) tokens least similar to frame i."""
    t, n, _ = video.shape
    m = int((1 - k) * n)
    kept = []
    for i in range(0, t - 1, 2):
        sim = torch.nn.functional.cosine_similarity(torch.nn.functional.normalize(video[i], dim=1),
                                                    torch.nn.functional.normalize(video[i + 1], dim=1), dim=1)
        kept.append(set(range(n)))
        kept.append(set(sim.topk(m, largest=False).indices.tolist()))
    for i in range(0, t - 4, 4):
        sim = torch.nn.functional.cosine_similarity(video[i], video[i + 2], dim=1)
        kept[i + 2] = set(sim.topk(m, largest=False).indices.tolist())
    return kept


@pytest.mark.parametrize("t, n, k, n_total", [
    (8, 16, 0.3, 3 * 16 + 5 * 11),  # compared frames keep int(0.7 * 16) = 11; pivots 0, 4, 6 keep 16
    (32, 196, 0.7, 3098),  # the official evaluation's k at 32 x 196: budget=3098 (keep=0.494), as the docstring says
])
def test_dycoke_ttm_equals_the_official_at_its_k(t, n, k, n_total):
    video = _video(t, n, 12, distinct=None, seed=2)
    if t == 8:
        assert ttm_references(t) == [None, 0, 0, 2, None, 4, None, 6]
    ref = official_ttm(video, k=k)
    assert sum(len(r) for r in ref) == n_total
    if t == 32:
        assert DyCoke(keep=0.494).n_keep(t * n) == n_total
    plan = ttm_plan(video, n_total)
    got = [set(((plan.reduction.indices[(plan.reduction.indices >= i * n) & (plan.reduction.indices < (i + 1) * n)])
                - i * n).tolist()) for i in range(t)]
    assert got == ref and plan.tokens_per_frame == [len(r) for r in ref]
    assert plan.reduction.features is None


def test_dycoke_spends_the_budget_down_to_its_pivots():
    video = _video(5, 9, 12, distinct=None, seed=3)
    assert ttm_references(5) == [None, 0, 0, 2, 3]  # odd last frame: against its predecessor (the official drops it)
    for n_total in (9, 20, 33, 44):  # one pivot frame of 9 tokens
        assert ttm_plan(video, n_total).reduction.indices.numel() == n_total
    assert ttm_plan(video, 7).reduction.indices.numel() == 9  # below the pivot: it stays whole


@pytest.mark.parametrize("method", ["uniform", "fastvid", "vidcom2"])
def test_a_frames_method_alone_on_images_says_they_stay_whole(method):
    """Frames methods act on videos: on an images-only call they keep every image token, which the
    call's stage record and budget_notes say, and a BudgetWarning says once per wrapped model; the
    output is the unwrapped model's. A video call carries no such note, nor does a pipeline whose
    vision stage prunes the images."""
    import warnings

    from vlm_prune.methods.base import BudgetWarning

    model = T.tiny_onevision()
    images, video = T.onevision_image_inputs(model), T.onevision_video_inputs(model)
    with torch.no_grad():
        ref = model(**images).logits
    vlm_prune.wrap(model, method, keep=0.5)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            assert torch.equal(model(**images).logits, ref)
            model(**images)
        notes = [w for w in caught if issubclass(w.category, BudgetWarning) and "keep all their tokens" in str(w.message)]
        assert len(notes) == 1
        stats = model.vlm_prune.last_stats
        assert stats["visual_tokens_out"] == stats["visual_tokens_in"] == [32, 32]  # (the newline rows are no visual tokens)
        record = stats["stages"][-1]
        assert record["skipped"] == "images" and record["tokens_in"] == record["tokens_out"] == [32, 32]  # one image each
        assert str(notes[0].message) == record["note"] and record["note"] in stats["budget_notes"]
        assert record["note"].startswith(f"{method} selects and reduces the frames of videos; this call's images keep all "
                                         f"their tokens. Add a vision- or llm-stage method")
        with torch.no_grad():
            model(**video)
        assert not any("note" in r for r in model.vlm_prune.last_stats["stages"])
    finally:
        vlm_prune.unwrap(model)
    vlm_prune.wrap(model, frames=method, tokens="random", keep=0.5)
    try:
        with torch.no_grad():
            model(**images)
        assert not any("note" in r for r in model.vlm_prune.last_stats["stages"])
    finally:
        vlm_prune.unwrap(model)
