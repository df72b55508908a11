"""KeyScore + STACFP (arXiv 2510.06509): scores, proposals, the Method, the uniform baseline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm_prune.frames.keyscore import KeyScore, keyscore, minmax, pixels_to_rgb, top_k_in_order
from vlm_prune.frames.stacfp import (
    cluster_proposals,
    hsv_histograms,
    medoids,
    pairwise_distances,
    stacfp_features,
    stacfp_proposals,
)
from vlm_prune.frames.uniform import Uniform, uniform_indices
from vlm_prune.methods.base import FramesContext

pytest.importorskip("cv2")

COLOURS = [(220, 30, 30), (30, 200, 40), (40, 40, 210)]


def colour_segments(per: int = 4, size: int = 16) -> np.ndarray:
    """per frames each of red, green and blue, in that order: uint8 [3 * per, size, size, 3]."""
    return np.stack([np.full((size, size, 3), c, dtype=np.uint8) for c in COLOURS for _ in range(per)])


# ---- KeyScore -------------------------------------------------------------------------------
def test_frame_matching_the_caption_ranks_first():
    emb = torch.eye(8)[:6]  # six mutually orthogonal frames
    ks = keyscore(emb, torch.eye(8)[3])
    assert int(torch.argmax(ks.score)) == 3
    # S_sem is one-hot, S_temp is constant (every neighbour orthogonal) so it normalises to 0,
    # S_drop is 1/sqrt(6) for frame 3 and 1/sqrt(6) - 1/sqrt(5) for the others
    torch.testing.assert_close(ks.sem, torch.eye(6)[3])
    torch.testing.assert_close(ks.temp, torch.zeros(6))
    torch.testing.assert_close(ks.drop, torch.eye(6)[3])
    torch.testing.assert_close(ks.score, torch.eye(6)[3] * 2 / 3)


def test_temporal_term_and_weights():
    e0, e1 = torch.eye(2)
    ks = keyscore(torch.stack([e0, e0, e1]), None)
    torch.testing.assert_close(ks.temp, torch.tensor([0.0, 0.0, 1.0]))  # 1 - max neighbour cosine
    torch.testing.assert_close(ks.sem, torch.zeros(3))
    ks = keyscore(torch.stack([e0, e0, e1]), e0, weights=(1.0, 0.0, 0.0))
    torch.testing.assert_close(ks.score, torch.tensor([1.0, 1.0, 0.0]))


def test_keyscore_helpers():
    torch.testing.assert_close(minmax(torch.tensor([2.0, 4.0, 3.0])), torch.tensor([0.0, 1.0, 0.5]))
    torch.testing.assert_close(minmax(torch.full((3,), 5.0)), torch.zeros(3))
    assert top_k_in_order(torch.tensor([0.1, 0.9, 0.5, 0.9]), 2) == [1, 3]
    assert top_k_in_order(np.array([0.3, 0.3, 0.3]), 2) == [0, 1]  # ties: earlier first
    ks = keyscore(torch.ones(1, 4), torch.ones(4))  # a single candidate scores 0 everywhere
    torch.testing.assert_close(ks.score, torch.zeros(1))


# ---- STACFP ---------------------------------------------------------------------------------
def test_hsv_histograms_separate_colours():
    h = hsv_histograms(colour_segments(per=1))
    assert h.shape == (3, 128)
    np.testing.assert_allclose(np.linalg.norm(h, axis=1), 1.0)
    np.testing.assert_allclose(h @ h.T, np.eye(3), atol=1e-12)  # flat frames: one bin each
    with pytest.raises(ValueError, match="uint8"):
        hsv_histograms(np.zeros((2, 4, 4, 3), dtype=np.float32))


def test_stacfp_finds_one_medoid_per_colour_segment():
    props = stacfp_proposals(colour_segments(per=4), k_range=(2, 6))
    assert props.k == 3
    assert props.labels.tolist() == [props.labels[0]] * 4 + [props.labels[4]] * 4 + [props.labels[8]] * 4
    # the time term makes the inner frames of each segment its medoid (lowest index on ties)
    assert props.indices.tolist() == [1, 5, 9]


def test_stacfp_time_term_and_medoids():
    x = stacfp_features(np.zeros((5, 2)), gamma_time=0.5)
    np.testing.assert_allclose(x[:, -1], [0.0, 0.125, 0.25, 0.375, 0.5])
    pts = np.array([[0.0], [1.0], [1.5], [10.0], [11.0]])
    assert medoids(pairwise_distances(pts), np.array([0, 0, 0, 1, 1])).tolist() == [1, 3]
    few = cluster_proposals(np.arange(4.0).reshape(2, 2))  # under 3 rows: every row proposes
    assert few.indices.tolist() == [0, 1]
    with pytest.raises(ValueError, match="k_range"):
        cluster_proposals(np.zeros((5, 2)), k_range=(1, 3))


# ---- the Method -----------------------------------------------------------------------------
def _one_hot_video(t: int = 5, n: int = 4, d: int = 8) -> torch.Tensor:
    """Frame i: n copies of the basis vector e_i."""
    return torch.eye(d)[:t, None, :].expand(t, n, d).clone()


def test_negated_relevance_is_the_cosine_to_the_opposite_caption():
    g = torch.Generator().manual_seed(0)
    frames, text = torch.randn(7, 5, generator=g), torch.randn(5, generator=g)
    neg, flipped = keyscore(frames, text, negate=True), keyscore(frames, -text)
    for part in ("sem", "temp", "drop", "score"):
        torch.testing.assert_close(getattr(neg, part), getattr(flipped, part))
    assert not torch.allclose(neg.sem, keyscore(frames, text).sem)


def test_keyscore_method_keeps_the_frame_matching_the_query():  # scoring only: every frame a candidate
    feats = _one_hot_video()
    # in-model embeddings: relevance is the negated cosine (vlm_prune.relevance), so the frame the
    # question's embedding points away from is the relevant one; an encoder keeps the plain cosine
    ctx = FramesContext(features=feats, grid=(2, 2), n_total=4, text_features=torch.eye(8)[[2, 2, 2]])
    assert KeyScore(budget=4, proposals="all", negate_relevance=False).allocate(ctx).kept_frames == [2]
    ctx.text_features = -torch.eye(8)[[2, 2, 2]]
    plan = KeyScore(budget=4, proposals="all").allocate(ctx)
    assert plan.kept_frames == [2] and plan.tokens_per_frame == [0, 0, 4, 0, 0]
    assert plan.reduction.indices.tolist() == [8, 9, 10, 11] and plan.reduction.features is None
    assert int(torch.argmax(plan.frame_scores)) == 2
    ctx.n_total = 8
    assert 2 in KeyScore(proposals="all").allocate(ctx).kept_frames and len(KeyScore(proposals="all").allocate(ctx).kept_frames) == 2
    ctx.n_total = 3  # below one frame: the best frame keeps 3 evenly spaced tokens
    plan = KeyScore(proposals="all").allocate(ctx)
    assert plan.reduction.indices.tolist() == [8, 10, 11] and plan.tokens_per_frame == [0, 0, 3, 0, 0]


def test_keyscore_method_with_encoder_and_stacfp_proposals():
    frames = colour_segments(per=3, size=8)  # red x3, green x3, blue x3
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    calls = []

    def encoder(rgb, texts):  # frame embedding = its mean colour; "green" -> (0, 1, 0)
        calls.append((len(rgb), list(texts)))
        return torch.from_numpy(rgb.reshape(len(rgb), -1, 3).mean(1)).float(), torch.tensor([[0.0, 1.0, 0.0]])

    ctx = FramesContext(features=torch.randn(9, 4, 5), grid=(2, 2), n_total=4, query="green", pixels=pixels)
    plan = KeyScore(encoder=encoder).allocate(ctx)  # STACFP proposals by default, as in the paper
    assert plan.kept_frames == [4]  # the middle green frame, the green segment's medoid
    assert calls == [(3, ["green"])]  # only the three proposals were embedded


def test_pixels_to_rgb_rescales_each_frame():
    px = torch.stack([torch.linspace(-1, 1, 12).reshape(3, 2, 2), torch.zeros(3, 2, 2)])
    rgb = pixels_to_rgb(px)
    assert rgb.shape == (2, 2, 2, 3) and rgb.dtype == np.uint8
    assert rgb[0].min() == 0 and rgb[0].max() == 255 and rgb[1].max() == 0


# ---- uniform --------------------------------------------------------------------------------
def test_uniform_indices():
    assert uniform_indices(6, 2) == [0, 5]
    assert uniform_indices(10, 4) == [0, 3, 6, 9]
    assert uniform_indices(5, 1) == [2]
    assert uniform_indices(3, 8) == [0, 1, 2]


def test_uniform_method():
    feats = torch.randn(6, 4, 3)
    plan = Uniform(budget=8).allocate(FramesContext(features=feats, grid=(2, 2), n_total=8))
    assert plan.kept_frames == [0, 5] and plan.tokens_per_frame == [4, 0, 0, 0, 0, 4]
    assert plan.reduction.indices.tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    plan = Uniform(budget=3).allocate(FramesContext(features=feats, grid=(2, 2), n_total=3))
    assert plan.kept_frames == [2] and plan.reduction.indices.tolist() == [8, 10, 11]
    plan = Uniform(keep=1.0).allocate(FramesContext(features=feats, grid=(2, 2), n_total=24))
    assert plan.reduction.indices.tolist() == list(range(24))


def test_stacfp_without_its_packages_says_what_to_install(hide_module):
    hide_module("cv2")
    with pytest.raises(ImportError, match=r"opencv-python-headless: pip install 'vlm-prune\[video\]'"):
        KeyScore(keep=0.5)
    assert KeyScore(keep=0.5, proposals="all").proposals == "all"  # scoring every frame needs neither
