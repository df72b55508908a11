"""HiRED (hasanar1f/HiRED@42be984, modeling_llava_next.py ``HiRED_token_selection``,
``HiRED_sub_img_budgets``, ``pack_HiRED_image_features``) against an independent re-statement of
its official selection, on the tiny LLaVA-NeXT (3 tower layers: the early layer 0 and the feature
layer 1 differ) with an image whose high-resolution rows the model's unpadding crops.

The re-statement follows the official control flow on the unwrapped tower's own eager attention
(multi-head [CLS] rows summed over heads, the budget shares floored, masks applied before the
unpadding); none of its code is copied. Its packing is the installed transformers' own
``pack_image_features`` (the official fork packs with its own transformers version's layout and
leaves the image_newline tokens out; here they stay: they are no visual tokens).
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.methods.hired import HiRED, TileAttention, band_counts, official_masks, weighted_shares
from test_budgets import _one_thread  # noqa: F401  (autouse fixture)
from test_fidelity_image_methods import image_rows, official_sequence, tiny_llava_64, wrapped

SIZES = [[20, 64], [32, 64]]  # sample 0: 2 of the 4 high-resolution rows are padding the model crops


@pytest.fixture(scope="module")
def model():
    return T.tiny_llava_next("eager", tower_layers=3)  # eager: the tower returns its attention weights


def next_inputs(model, sizes: list[list[int]], seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(len(sizes), 3, 3, 32, 32, generator=g)  # base + 2 tiles each
    image_sizes = torch.tensor(sizes)
    with torch.no_grad():
        feats = model.model.get_image_features(pixels, image_sizes).pooler_output
    ids, mask = T.prompts([[(T.IMAGE_TOKEN, f.shape[0])] for f in feats], "left", seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_sizes": image_sizes}


@pytest.fixture(scope="module")
def inp(model):
    return next_inputs(model, SIZES)


@torch.no_grad()
def eager_cls_rows(model, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([tiles, H, n] layer-0 [CLS] attention, the same in the feature layer) of one image's tiles,
    from the tower's own attention weights."""
    out = model.model.vision_tower(pixels, output_attentions=True, output_hidden_states=True)
    return out.attentions[0][:, :, 0, 1:], out.attentions[1][:, :, 0, 1:]


def official_selection(top: torch.Tensor, bottom: torch.Tensor, rate: float, alpha: float) -> torch.Tensor:
    """The official ``HiRED_token_selection`` for one image: [tiles, n] bool."""
    top, bottom = top.sum(1), bottom.sum(1)  # aggregate over heads
    tiles, n = bottom.shape
    mask = torch.zeros(tiles, n, dtype=torch.bool)
    total = int(tiles * n * rate)
    full = min(int(total * alpha), n)
    sub = min(total - full, (tiles - 1) * n)
    mask[0, bottom[0].topk(full).indices] = True
    if sub > 0:
        spatial = torch.zeros(n, dtype=torch.bool)
        spatial[top[0].topk(int(n * (1 - alpha))).indices] = True
        per_tile = spatial.reshape(1, tiles - 1, -1).sum(-1).reshape(-1)  # official reshape(h, w, -1)
        budgets = ((per_tile / per_tile.sum()) * sub).int().clamp(max=n)
        for i, k in enumerate(budgets.tolist()):
            mask[i + 1, bottom[i + 1].topk(k).indices] = True
    return mask


def packed_keep(model, mask: torch.Tensor, size: list[int]) -> torch.Tensor:
    """The kept packed tokens of one image: its [tiles, n] mask packed by the model's own layout
    (unpadding included), newline tokens kept."""
    packed, _ = model.model.pack_image_features(
        [mask.float()[..., None]], torch.tensor([size]), "default", image_newline=torch.ones(1))
    return packed[0][:, 0] > 0.5


def wrapped_rows(model, inp, method, **kw) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """(per sample: the kept image placeholders, as indices into that sample's image tokens;
    logits; last_stats) of one wrapped prefill."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            logits = model(**inp).logits
        rows, stats = model.vlm_prune.last_rows, model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    out = []
    for b in range(inp["input_ids"].shape[0]):
        img = torch.nonzero(inp["input_ids"][b] == T.IMAGE_TOKEN).squeeze(1)
        kept = rows[b][rows[b] >= 0]
        out.append(torch.nonzero(torch.isin(img, kept)).squeeze(1))
    return out, logits, stats


@pytest.mark.parametrize("tiles, n", [(3, 16), (5, 16), (3, 576), (5, 576), (4, 576)])
@pytest.mark.parametrize("rate, alpha", [(0.2, 0.5), (0.1, 0.5), (0.4, 0.3), (0.05, 0.8)])
def test_official_masks_equal_the_official_selection(tiles, n, rate, alpha):
    g = torch.Generator().manual_seed(tiles * 1000 + n)
    top = torch.rand(tiles, 4, n, generator=g).softmax(-1)
    bottom = torch.rand(tiles, 4, n, generator=g).softmax(-1)
    got = official_masks(TileAttention(top.mean(1), bottom.mean(1), torch.zeros(0), torch.zeros(0)), rate, alpha)
    assert torch.equal(got, official_selection(top, bottom, rate, alpha))


def test_band_counts_cut_the_base_image_into_runs_in_tile_order():
    early = torch.arange(16, dtype=torch.float)  # the 8 highest: patches 8..15, all in the second half
    assert band_counts(early, 8, 2).tolist() == [0, 8]
    assert band_counts(early, 8, 4).tolist() == [0, 0, 4, 4]
    assert band_counts(early, 6, 3).tolist() == [0, 1, 5]  # 16 = 6 + 5 + 5: the official reshape cannot


def test_weighted_shares_are_exact_and_capped():
    assert weighted_shares(5, [3, 1], [16, 16]) == [4, 1]
    assert weighted_shares(10, [8, 0], [6, 8]) == [6, 4]  # the capped tile's excess goes on
    assert weighted_shares(7, [0, 0, 0], [2, 8, 8]) == [1, 3, 3]  # no weight: by capacity
    assert weighted_shares(40, [1, 1], [8, 8]) == [8, 8]


def test_tower_tiles_are_the_towers_own_attention(model, inp):
    """What the adapter hands HiRED: each tile's [CLS] attention in layer 0 and the feature layer,
    equal to the tower's eager weights (mean over heads), and the tile / patch of every token."""
    seen = []

    class Spy(HiRED):
        def reduce_crops(self, ctx, crops):
            seen.append((ctx.tower_tiles(), crops))
            return super().reduce_crops(ctx, crops)

    wrapped_rows(model, inp, Spy(), keep=0.5)
    assert len(seen) == 2
    for b, (tiles, crops) in enumerate(seen):
        top, bottom = eager_cls_rows(model, inp["pixel_values"][b])
        torch.testing.assert_close(tiles.early, top.mean(1), atol=1e-6, rtol=0)
        torch.testing.assert_close(tiles.late, bottom.mean(1), atol=1e-6, rtol=0)
        assert torch.equal(tiles.crop, crops)
        rows = 2 if b == 0 else 4  # the unpadding keeps the 2 middle rows of 4 in sample 0
        first = 1 if b == 0 else 0
        expected_local = list(range(16))
        for r in range(first, first + rows):
            expected_local += [r * 4 + c for c in range(4)] * 2 + [-1]  # tile 1's row, tile 2's, newline
        assert tiles.local.tolist() == expected_local


@pytest.mark.parametrize("rate, alpha", [(0.2, 0.5), (0.4, 0.3), (0.5, 0.6)])
def test_official_defaults_equal_the_official_selection(model, inp, rate, alpha):
    kept, _, stats = wrapped_rows(model, inp, HiRED(rate=rate, alpha=alpha))
    for b, size in enumerate(SIZES):
        top, bottom = eager_cls_rows(model, inp["pixel_values"][b])
        expected = torch.nonzero(packed_keep(model, official_selection(top, bottom, rate, alpha), size)).squeeze(1)
        assert kept[b].tolist() == expected.tolist()
    assert stats["visual_tokens_in"] == [32, 48]


@pytest.mark.parametrize("kw", [{"keep": 0.5}, {"keep": 0.25}, {"budget": 5}, {"budget": 40}])
def test_keep_and_budget_are_met_exactly_with_each_tile_ranking_its_own_tokens(model, inp, kw):
    kept, _, stats = wrapped_rows(model, inp, HiRED(), **kw)
    n_vis = [32, 48]
    targets = [max(1, int(kw["keep"] * n)) if "keep" in kw else min(kw["budget"], n) for n in n_vis]
    assert stats["visual_tokens_out"] == targets
    for b, size in enumerate(SIZES):
        top, bottom = eager_cls_rows(model, inp["pixel_values"][b])
        present = packed_keep(model, torch.ones(3, 16, dtype=torch.bool), size)  # every packed token
        crop = packed_keep_values(model, size, lambda t, i: t)
        local = packed_keep_values(model, size, lambda t, i: i)
        caps = [int((crop == t).sum()) for t in range(3)]
        base = min(int(targets[b] * 0.5), caps[0])
        rest = min(targets[b] - base, caps[1] + caps[2])
        base = targets[b] - rest
        counts = band_counts(top.mean(1)[0], 8, 2).tolist()
        shares = [base] + weighted_shares(rest, counts, caps[1:])
        expected = set(torch.nonzero(crop < 0).squeeze(1).tolist())  # the newlines
        for t, k in enumerate(shares):
            idx = torch.nonzero(crop == t).squeeze(1)
            scores = bottom.sum(1)[t][local[idx]]
            expected |= set(idx[scores.topk(k).indices].tolist())
        assert present.all()
        assert kept[b].tolist() == sorted(expected)


def packed_keep_values(model, size: list[int], value) -> torch.Tensor:
    """[N] long: ``value(tile, patch)`` of every packed token of one image, -1 for newlines."""
    grid = torch.tensor([[value(t, i) + 1 for i in range(16)] for t in range(3)], dtype=torch.float)
    packed, _ = model.model.pack_image_features([grid[..., None]], torch.tensor([size]), "default",
                                                image_newline=torch.zeros(1))
    return packed[0][:, 0].round().long() - 1


@pytest.mark.parametrize("kw", [{}, {"keep": 0.3}])
def test_a_batch_equals_each_sample_alone(model, inp, kw):
    kept, logits, _ = wrapped_rows(model, inp, HiRED(), **kw)
    for b, size in enumerate(SIZES):
        alone = next_inputs(model, [size])
        alone["pixel_values"] = inp["pixel_values"][b : b + 1]
        alone["input_ids"] = inp["input_ids"][b : b + 1][:, inp["attention_mask"][b].bool()]
        alone["attention_mask"] = torch.ones_like(alone["input_ids"])
        kept1, logits1, _ = wrapped_rows(model, alone, HiRED(), **kw)
        assert kept1[0].tolist() == kept[b].tolist()
        n = logits1.shape[1]
        torch.testing.assert_close(logits[b, -n:], logits1[0], atol=1e-5, rtol=0)


def test_renumbered_by_default_and_original_positions_on_request(model, inp):
    _, renumbered, _ = wrapped_rows(model, inp, HiRED(), keep=0.3)
    _, kept, _ = wrapped_rows(model, inp, HiRED(positions="keep"), keep=0.3)
    assert not torch.allclose(renumbered[:, -1], kept[:, -1], atol=1e-4)


def test_refusals_say_what_is_allowed(model, inp):
    for kw, msg in (({"rate": 0}, "rate .*in \\(0, 1\\]"), ({"alpha": 1.5}, "alpha .*\\[0, 1\\]"),
                    ({"early_layer": -1}, "early_layer must be"), ({"positions": "gap"}, "positions must be")):
        with pytest.raises(ValueError, match=msg):
            HiRED(**kw)
    with pytest.raises(ValueError, match="early_layer=3 is beyond the tower's 3 layers"):
        vlm_prune.wrap(model, HiRED(early_layer=3))
    with pytest.raises(ValueError, match="supports llava, llava_next, llava_next_video models"):
        vlm_prune.wrap(T.tiny_onevision(), "hired", keep=0.5)
    full = T.tiny_llava_next(tower_layers=3)
    full.config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="vision_feature_select_strategy='default'"):
        vlm_prune.wrap(full, "hired")


@pytest.mark.parametrize("kw, k", [({}, 12), ({"rate": 0.5}, 32), ({"budget": 7}, 7)])
def test_llava_single_partition_equals_the_official_llava_path(kw, k):
    """LLaVA-1.5 (the official modeling_llava.py): the min(n, int(n rate)) patches of highest
    feature-layer [CLS] attention summed over heads, fed as the shorter sequence."""
    llava = tiny_llava_64()
    inp = T.llava_inputs(batch=1, n_img_tokens=64)
    inp["pixel_values"] = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = llava.model.vision_tower(inp["pixel_values"], output_attentions=True, output_hidden_states=True)
        attn = out.attentions[-2][0, :, 0, 1:].sum(0)
        mask = torch.zeros(64, dtype=torch.bool)
        mask[attn.topk(k).indices] = True
        tokens = llava.model.multi_modal_projector(out.hidden_states[-2][0, 1:])[mask]
        ref = llava(inputs_embeds=official_sequence(llava, inp["input_ids"][0], tokens)).logits[0]
    budget = {"budget": kw.pop("budget")} if "budget" in kw else {}
    logits, rows = wrapped(llava, inp, HiRED(**kw), **budget)
    img = image_rows(inp)
    assert [r for r in rows.tolist() if r in img.tolist()] == img[mask].tolist()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
