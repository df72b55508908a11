"""LLaVA-PruMerge (42Shawn/LLaVA-PruMerge@1ca8b2b, clip_encoder.py ``token_prune_merge_advanced`` with
``if_adaptive=True``, the default of ``CLIPVisionTower.forward`` there; ``outlier_dectection``) and
PruMerge+ (``token_prune_merge_advanced_plus``, the default from 5632f5a on) against an
independent re-statement of the official code on the unwrapped tiny LLaVA's own tensors (hooks on the
tower's last layer's q / k projections, the merge loop token by token, numpy quartiles); none of its
code is copied. The tiny tower has 64 patches, so the official 32 neighbours exist.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tiny_models as T
import vlm_prune
from vlm_prune.methods.prumerge import PruMerge, iqr_outliers, plus_supplement, prumerge_tokens, spread
from test_budgets import _one_thread  # noqa: F401  (autouse fixture)
from test_fidelity_image_methods import official_sequence, tiny_llava_64, wrapped


@pytest.fixture(scope="module")
def model():
    return tiny_llava_64()


def image_inputs(seed: int, scale: float = 1.0) -> dict:
    inp = T.llava_inputs(batch=1, n_img_tokens=64)
    inp["pixel_values"] = scale * torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    return inp


@torch.no_grad()
def official_prumerge(model, pixels: torch.Tensor, count: int | None = None, neighbours: int = 32,
                      feature_layer: int = -2, plus: bool = False) -> list[torch.Tensor]:
    """The official ``token_prune_merge_advanced`` (``plus``: ``token_prune_merge_advanced_plus``, on
    batch 1 as its concatenation requires) on a batch of images, then the projector: per image
    [k + 1, D] tokens. ``count``: the kept patches (None: the adaptive IQR ratio of
    ``outlier_dectection``, over the whole batch's [CLS] rows flattened, its count applied to every
    image); ``feature_layer``: the hidden state merged (the official select_layer -2)."""
    tower = model.model.vision_tower
    last = getattr(tower, "vision_model", tower).encoder.layers[-1]
    seen = {}
    hooks = [last.self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o)),
             last.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o))]
    out = tower(pixels, output_hidden_states=True)
    for h in hooks:
        h.remove()
    feats = out.hidden_states[feature_layer][:, 1:]
    b, n, c = feats.shape
    attn = F.softmax((seen["q"] @ seen["k"].transpose(-2, -1)) * c**-0.5, dim=-1)
    cls_attn = attn[:, 0, 1:]
    if count is None:
        a = cls_attn.float().numpy().flatten()
        q1, q3 = np.percentile(a, 25), np.percentile(a, 75)
        ratio = len(np.where(a > q3 + 1.5 * (q3 - q1))[0]) / len(a)
        count = int(n * ratio)
    _, idx = torch.topk(cls_attn, count, dim=1)
    if plus:  # positions 0, s, 2s, ... below 575 (= 576 - 1, the official's patches; here n - 1) not already kept
        grid = torch.arange(0, n - 1, int(int(1 / ratio) / 3)).tolist()
        idx = torch.cat([idx, torch.tensor([[x for x in grid if x not in idx.flatten().tolist()]])], dim=1)
    keys = seen["k"][:, 1:]
    tokens = []
    for s in range(b):
        kept = idx[s].tolist()
        kept_x, kept_attn, kept_k = feats[s, kept], cls_attn[s, kept], F.normalize(keys[s, kept], dim=-1)
        others = [j for j in range(n) if j not in kept]
        rest_x, rest_attn, rest_k = feats[s, others], cls_attn[s, others], F.normalize(keys[s, others], dim=-1)
        updated = []
        for i in range(len(kept)):
            pool_x = torch.cat([kept_x[:i], kept_x[i + 1:], rest_x])
            pool_attn = torch.cat([kept_attn[:i], kept_attn[i + 1:], rest_attn])
            pool_k = torch.cat([kept_k[:i], kept_k[i + 1:], rest_k])
            near = torch.topk(kept_k[i] @ pool_k.T, neighbours).indices
            updated.append(kept_x[i] + (pool_x[near] * pool_attn[near, None]).sum(0))
        extra = (rest_x * rest_attn[:, None]).sum(0)
        tokens.append(model.model.multi_modal_projector(torch.stack([*updated, extra])))
    return tokens


@pytest.mark.parametrize("seed, scale", [(5, 1.0), (6, 3.0), (7, 0.5)])
def test_official_defaults_equal_the_official_merge(model, seed, scale):
    inp = image_inputs(seed, scale)
    tokens = official_prumerge(model, inp["pixel_values"])[0]
    with torch.no_grad():
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    logits, _ = wrapped(model, inp, PruMerge())
    assert model_count(model, inp) == tokens.shape[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed, scale", [(5, 0.5), (7, 0.5), (11, 1.0)])
def test_plus_equals_the_official_plus(model, seed, scale):
    """PruMerge+ (the top patches, then every s-th position not among them): the official's tokens,
    about three times PruMerge's."""
    inp = image_inputs(seed, scale)
    tokens = official_prumerge(model, inp["pixel_values"], plus=True)[0]
    assert tokens.shape[0] > official_prumerge(model, inp["pixel_values"])[0].shape[0] + 1  # the supplement acts
    with torch.no_grad():
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    logits, _ = wrapped(model, inp, PruMerge(plus=True))
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_plus_supplement_where_the_official_fails_and_under_a_budget():
    top = torch.tensor([7, 3])
    assert plus_supplement(top, 64, 2 / 64).tolist() == [0, 10, 20, 30, 40, 50, 60]  # s = int(32 / 3) = 10
    assert plus_supplement(top, 64, 0.0).numel() == 0  # no outliers: the official divides by zero
    assert plus_supplement(top, 8, 0.5).tolist() == [0, 1, 2, 4, 5, 6]  # s = int(2 / 3) = 0: the official's arange fails
    assert spread(top, 10, 4).tolist() == [0, 2, 5, 8]  # of the 8 others, every second
    inp = image_inputs(11)
    vlm_prune.wrap(model := tiny_llava_64(), PruMerge(plus=True), budget=12)
    try:
        with torch.no_grad():
            model(**inp)
        assert model.vlm_prune.last_stats["visual_tokens_out"][0] == 12
    finally:
        vlm_prune.unwrap(model)


def test_batch_outliers_equal_the_official_batch_count(model):
    """outliers="batch": two images whose own outlier counts differ (2 and 4 of 64) both keep the count
    of the batch's rows pooled, as the official ``outlier_dectection`` of the whole [B, N] attention;
    each sample's logits equal the official tokens'. The default counts each image alone."""
    first, second = image_inputs(5), image_inputs(11)
    pixels = torch.cat([first["pixel_values"], second["pixel_values"]])
    alone = [official_prumerge(model, p[None])[0].shape[0] - 1 for p in pixels]
    batch = official_prumerge(model, pixels)
    assert alone == [2, 4] and batch[0].shape[0] - 1 == 2  # the pooled rows' quartiles: 2 each, the second too
    inp = {"input_ids": first["input_ids"].repeat(2, 1), "attention_mask": torch.ones(2, first["input_ids"].shape[1],
           dtype=torch.long), "pixel_values": pixels}
    for outliers, tokens in (("batch", batch), ("image", [official_prumerge(model, p[None])[0] for p in pixels])):
        vlm_prune.wrap(model, PruMerge(outliers=outliers))
        try:
            with torch.no_grad():
                logits = model(**inp).logits
            assert model.vlm_prune.last_stats["visual_tokens_out"] == [t.shape[0] for t in tokens]
        finally:
            vlm_prune.unwrap(model)
        for b in range(2):
            with torch.no_grad():
                ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][b], tokens[b])).logits[0]
            torch.testing.assert_close(logits[b, -ref.shape[0]:], ref, atol=1e-5, rtol=0)


def model_count(model, inp) -> int:
    vlm_prune.wrap(model, PruMerge())
    try:
        with torch.no_grad():
            model(**inp)
        return model.vlm_prune.last_stats["visual_tokens_out"][0]
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("k", [16, 5, 1])
def test_budget_keeps_the_top_k_minus_one_and_the_extra_token(model, k):
    inp = image_inputs(5)
    tokens = official_prumerge(model, inp["pixel_values"], count=k - 1)[0]
    with torch.no_grad():
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    logits, _ = wrapped(model, inp, PruMerge(), budget=k)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_adaptive_counts_differ_by_image_and_match_numpy(model):
    counts = []
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.rand(576, generator=g) ** 4
        x = a.numpy()
        q1, q3 = np.percentile(x, 25), np.percentile(x, 75)
        assert iqr_outliers(a) == int(576 * (int((x > q3 + 1.5 * (q3 - q1)).sum()) / 576))
        counts.append(iqr_outliers(a))
    assert len(set(counts)) > 1


def test_merge_is_the_official_weighted_neighbour_sum():
    g = torch.Generator().manual_seed(1)
    feats, keys, att = torch.randn(10, 4, generator=g), torch.randn(10, 3, generator=g), torch.rand(10, generator=g)
    order = torch.argsort(att, descending=True)[:3]
    merged = prumerge_tokens(feats, att, keys, order, neighbours=4)
    kn = F.normalize(keys, dim=-1)
    for row, i in zip(merged[:3], order.tolist()):
        sim = kn[i] @ kn.T
        sim[i] = -2
        near = sim.topk(4).indices
        torch.testing.assert_close(row, feats[i] + (feats[near] * att[near, None]).sum(0))
    rest = [j for j in range(10) if j not in order.tolist()]
    torch.testing.assert_close(merged[3], (feats[rest] * att[rest, None]).sum(0))


@pytest.mark.parametrize("plus", [False, True])
def test_a_batch_equals_each_sample_alone(plus):
    model = T.tiny_llava()
    inp = T.llava_inputs()
    for kw in ({}, {"keep": 0.3}):
        vlm_prune.wrap(model, PruMerge(neighbours=8, plus=plus), **kw)
        try:
            with torch.no_grad():
                logits = model(**inp).logits
                rows = model.vlm_prune.last_rows
                for b in range(2):
                    valid = inp["attention_mask"][b].bool()
                    alone = {"input_ids": inp["input_ids"][b : b + 1, valid], "pixel_values": inp["pixel_values"][b : b + 1]}
                    got = model(**alone).logits[0]
                    assert model.vlm_prune.last_rows[0].tolist() == (rows[b][rows[b] >= 0] - int((~valid).sum())).tolist()
                    torch.testing.assert_close(logits[b, -got.shape[0]:], got, atol=1e-5, rtol=0)
        finally:
            vlm_prune.unwrap(model)


def test_refusals_say_what_is_allowed():
    for kw, msg in (({"neighbours": 0}, "neighbours must be a whole number >= 1"),
                    ({"positions": "gap"}, "positions must be"), ({"plus": 1}, "plus must be True"),
                    ({"outliers": "all"}, "outliers must be 'image'")):
        with pytest.raises(ValueError, match=msg):
            PruMerge(**kw)
    with pytest.raises(ValueError, match="supports llava models"):
        vlm_prune.wrap(T.tiny_llava_next(), "prumerge", keep=0.5)
    other = T.tiny_llava(tower_layers=3)
    other.config.vision_feature_layer = -3
    with pytest.raises(ValueError, match="needs vision_feature_layer -2 .* or -1; this model uses -3"):
        vlm_prune.wrap(other, "prumerge")
    full = T.tiny_llava()
    full.config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="vision_feature_select_strategy='default'"):
        vlm_prune.wrap(full, "prumerge")


def test_feature_layer_minus_one_reads_the_last_layer_from_its_input():
    """The project's synthetic LLaVA projects the last layer's output (-1): the attention is still the
    last layer's (from its input, the tapped row), the merge runs on what the projector reads."""
    model = tiny_llava_64()
    model.config.vision_feature_layer = -1
    inp = image_inputs(6, 3.0)
    for kw, count in (({}, None), ({"budget": 9}, 8)):
        tokens = official_prumerge(model, inp["pixel_values"], count=count, feature_layer=-1)[0]
        with torch.no_grad():
            ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
        logits, _ = wrapped(model, inp, PruMerge(), **kw)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
