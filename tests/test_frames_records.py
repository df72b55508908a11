"""Fidelity of the video token-reduction records (frames stage) against small, independently
written re-statements of their official algorithms, named with the commit read:

- VidCom2: xuyang-liu16/VidCom2@944a17d14f4848ad080a65eab2b0711a760fa154,
  token_compressor/vidcom2/vidcom2.py (``vidcom2_compression`` with the "linear" mapper).

The re-statements follow the official control flow; none of their code is copied.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.frames.vidcom2 import VidCom2, apportion
from vlm_prune.methods.base import FramesContext


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.mark.parametrize("family", ["onevision", "qwen2_vl"])
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
        model = T.tiny_qwen2_vl()
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
