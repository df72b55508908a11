"""Fidelity of the image baselines of issue 30 against independent re-statements of their official code.

- FasterVLM (Theia-4869/FasterVLM@f5d5f120, llava_arch.py ``encode_images``): top-k patches by the
  head-averaged [CLS] attention of the tower's feature layer, the kept tokens concatenated into a
  shorter sequence numbered 0..n-1.
- VisPruner (Theia-4869/VisPruner@aefa01ad, llava_arch.py ``encode_images``): important tokens by
  the same attention, then duplicates removed from the rest 8 at a time by even / odd matching.
- DART (ZichenWen1/DART@9fee9fa1 via its mirror xqy1111111/DART, modeling_llama_self.py
  ``get_retained_image_token``): key-L1 pivots of layer K-1, each pivot keeping the least similar
  image tokens (final-normed rows entering layer K), Python-set iteration order, original positions.
- PyramidDrop (Cooperx521/PyramidDrop@6444f304, modeling_llama_pdrop.py ``pdrop_rank_drop``): the
  last instruction token's head-averaged attention in layer l, int(n * 0.5 ** s) kept after stage s,
  the rows renumbered 0..n-1 after each stage.

The re-statements follow the official control flow (batch 1, eager attention, no padding: the
official scripts' setting) on the unwrapped model's own tensors; none of their code is copied.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tiny_models as T
import vlm_prune
from vlm_prune.methods import DART, FasterVLM, PyramidDrop, VisPruner
from vlm_prune.methods.dart import per_pivot_counts
from vlm_prune.methods.vispruner import drop_duplicates
from test_budgets import _one_thread  # noqa: F401  (autouse fixture)
from test_fidelity_llm import image_rows, inp, lm_of, model, run_layers  # noqa: F401  (model, inp: fixtures)


def wrapped(model, inp, method, **kw):
    """(logits [S', V] of the first sample, its kept input rows) of the wrapped model."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            logits = model(**inp).logits[0]
        rows = model.vlm_prune.last_rows[0]
    finally:
        vlm_prune.unwrap(model)
    return logits, rows[rows >= 0]


# ---- vision stage: FasterVLM, VisPruner ---------------------------------------------------------
@torch.no_grad()
def tower_outputs(model, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(CLS attention [B, N] averaged over heads, feature-layer patch outputs [B, N, C]) as the
    official clip_encoder.feature_select with select_layer -2 and 'patch' features."""
    out = model.model.vision_tower(pixels, output_attentions=True, output_hidden_states=True)
    return out.attentions[-2][:, :, 0, 1:].mean(1), out.hidden_states[-2][:, 1:]


@torch.no_grad()
def official_sequence(model, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One sample as the official LLaVA code feeds the LLM: the image placeholders replaced by the
    kept tokens (a shorter sequence, the model numbers it 0..n-1)."""
    embed = model.get_input_embeddings()
    img = torch.nonzero(ids == T.IMAGE_TOKEN).squeeze(1)
    return torch.cat([embed(ids[: int(img[0])]), tokens, embed(ids[int(img[-1]) + 1:])])[None]


def official_fastervlm_keep(att: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(att.numel(), dtype=torch.bool)
    mask[att.topk(k).indices] = True
    return mask


@pytest.mark.parametrize("k", [8, 3])
def test_fastervlm_equals_the_official_llava_path(model, inp, k):
    att, feats = tower_outputs(model, inp["pixel_values"])
    mask = official_fastervlm_keep(att[0], k)
    with torch.no_grad():
        tokens = model.model.multi_modal_projector(feats[0])[mask]
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    logits, rows = wrapped(model, inp, FasterVLM(), budget=k)
    img = image_rows(inp)
    assert [r for r in rows.tolist() if r in img.tolist()] == img[mask].tolist()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    kept, rows_keep = wrapped(model, inp, FasterVLM(positions="keep"), budget=k)
    assert torch.equal(rows_keep, rows) and not torch.allclose(kept[-1], logits[-1], atol=1e-4)


def official_vispruner_keep(att: torch.Tensor, feats: torch.Tensor, k: int, ratio: float) -> torch.Tensor:
    """VisPruner's encode_images for one image (B = 1): the index mask of the kept tokens."""
    n_imp = int(k * ratio)
    n_div = k - n_imp
    order = att.argsort(descending=True)
    important, residual = order[:n_imp], order[n_imp:]
    normed = feats / feats.norm(dim=-1, keepdim=True)
    while n_div > 0:
        big_r = residual.numel()
        r = min(8, big_r - n_div)
        if r <= 0:
            break
        toks = normed[residual]
        a, b = toks[::2], toks[1::2]
        best = (a @ b.T).max(dim=-1).values
        distinct = best.argsort(descending=True)[r:]
        residual = torch.cat([residual[::2][distinct], residual[1::2]])
    chosen = torch.cat([important, residual]) if n_div > 0 else important
    mask = torch.zeros(att.numel(), dtype=torch.bool)
    mask[chosen] = True
    return mask


def tiny_llava_64():
    """The tiny LLaVA with a 64 x 64 image (8 x 8 = 64 patches), so several matching rounds run."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=64, patch_size=8),
        text_config=T._llama(), image_token_id=T.IMAGE_TOKEN, vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return T._finish(LlavaForConditionalGeneration(cfg), "eager")


@pytest.mark.parametrize("k, ratio", [(16, 0.5), (12, 0.75), (8, 0.0)])
def test_vispruner_equals_the_official_llava_path(k, ratio):
    model = tiny_llava_64()
    inp = T.llava_inputs(batch=1, n_img_tokens=64)
    inp["pixel_values"] = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    att, feats = tower_outputs(model, inp["pixel_values"])
    mask = official_vispruner_keep(att[0], feats[0], k, ratio)
    with torch.no_grad():
        tokens = model.model.multi_modal_projector(feats[0])[mask]
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    logits, rows = wrapped(model, inp, VisPruner(important_ratio=ratio), budget=k)
    img = image_rows(inp)
    assert [r for r in rows.tolist() if r in img.tolist()] == img[mask].tolist()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n, n_keep", [(200, 40), (64, 30), (10, 1)])
def test_vispruner_duplicate_removal_equals_the_official_rounds(n, n_keep):
    g = torch.Generator().manual_seed(n)
    feats = torch.randn(n, 16, generator=g)
    att = torch.rand(n, generator=g)
    # the official loop with nothing important: every token is residual, in attention order
    expected = torch.nonzero(official_vispruner_keep(att, feats, n_keep, 0.0)).squeeze(1)
    got = drop_duplicates(feats, att.argsort(descending=True), n_keep)
    assert sorted(got.tolist()) == expected.tolist()


def test_vispruner_handles_an_odd_residual_count():
    """The official code needs an even residual count (it indexes R // 2 rows); an odd one keeps
    exactly n_keep distinct tokens here."""
    feats = torch.randn(31, 8, generator=torch.Generator().manual_seed(0))
    got = drop_duplicates(feats, torch.arange(31), 10)
    assert got.numel() == 10 and len(set(got.tolist())) == 10


# ---- in the LLM: DART, PyramidDrop -------------------------------------------------------------
def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    hd = t.shape[-1]
    return t * cos[:, None] + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin[:, None]


def layer_qk(model, layer: int, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [H, S, d] of decoder ``layer`` on rows h [S, D] at positions pos, RoPE applied, the
    key heads repeated to the query heads (the official attention's repeat_kv)."""
    lm = lm_of(model)
    mod = lm.layers[layer]
    attn = mod.self_attn
    x = mod.input_layernorm(h[None])
    s, hd = h.shape[0], attn.head_dim
    q = attn.q_proj(x).view(1, s, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(1, s, -1, hd).transpose(1, 2)
    cos, sin = lm.rotary_emb(x, pos[None])
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    return q[0], k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)[0]


def logits_of(model, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head(lm_of(model).norm(h))


def official_dart_keep(keys: torch.Tensor, last_state: torch.Tensor, start: int, length: int,
                       pivot_image: int, pivot_text: int, topk: int) -> list[int]:
    """get_retained_image_token: keys [S, H*d] of layer K-1, last_state [S, D] the final-normed
    rows entering layer K; image block [start, start + length)."""
    l1_img = keys[start:start + length].abs().sum(-1)
    l1_txt = keys[start + length:].abs().sum(-1)
    image_idx = (l1_img.topk(pivot_image).indices + start).tolist()
    query_idx = (l1_txt.topk(pivot_text).indices + start + length).tolist()
    chosen = set(image_idx + query_idx)
    valid = set(range(start, start + length)) - set(image_idx)
    valid_list = list(valid)
    for item in list(chosen):
        cos = -F.cosine_similarity(last_state[item], last_state[valid_list], dim=-1)
        picked = [valid_list[i] for i in cos.topk(topk).indices.tolist()]
        chosen.update(picked)
        valid.difference_update(picked)
        valid_list = list(valid)
    chosen.difference_update(query_idx)
    return sorted(chosen)


@torch.no_grad()
def official_dart(model, inp, k_layer: int, topk: int, pivots=(4, 4)) -> tuple[torch.Tensor, list[int]]:
    """(logits [S', V], kept rows) of DART's forward: prune before layer K with the keys of layer
    K-1 and the final-normed output of layer K-1; kept rows keep their position ids."""
    hs = model(**inp, output_hidden_states=True).hidden_states
    s = inp["input_ids"].shape[1]
    pos = torch.arange(s)
    _, k = layer_qk(model, k_layer - 1, hs[k_layer - 1][0], pos)
    keys = k.transpose(0, 1).reshape(s, -1)
    img = image_rows(inp)
    start, length = int(img[0]), img.numel()
    kept_img = official_dart_keep(keys, lm_of(model).norm(hs[k_layer][0]), start, length, *pivots, topk)
    keep = torch.tensor(sorted(list(range(start)) + kept_img + list(range(start + length, s))))
    h = run_layers(model, hs[k_layer][0][keep], keep, k_layer)
    return logits_of(model, h), keep.tolist()


@pytest.mark.parametrize("max_num_trunction, pivots, topk", [(8, (4, 4), 1), (8, (2, 2), 2), (9, (3, 1), 2)])
def test_dart_official_defaults_equal_the_official_selection(model, inp, max_num_trunction, pivots, topk):
    """Without keep / budget: max_num_trunction // (pivots) picks per pivot plus the image pivots."""
    ref, rows_ref = official_dart(model, inp, 2, topk, pivots)
    logits, rows = wrapped(model, inp, DART(pivot_image=pivots[0], pivot_text=pivots[1],
                                            max_num_trunction=max_num_trunction))
    assert rows.tolist() == rows_ref
    assert sum(r in image_rows(inp).tolist() for r in rows.tolist()) == pivots[0] + sum(pivots) * topk
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_dart_budget_splits_the_picks_over_the_pivots(model, inp):
    """budget=12 is the official count of 1 pick per pivot exactly; budget=10 keeps 10 (the first
    six pivots in the official order pick 1 - the official code cannot express it), a superset of
    the image pivots; budget=3 keeps the 3 strongest image pivots."""
    ref, rows_ref = official_dart(model, inp, 2, 1)
    logits, rows = wrapped(model, inp, "dart", budget=12)
    assert rows.tolist() == rows_ref
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    img = set(image_rows(inp).tolist())
    assert per_pivot_counts(8, 4, 10) == (4, [1, 1, 1, 1, 1, 1, 0, 0])
    for budget in (10, 3):
        _, rows = wrapped(model, inp, "dart", budget=budget)
        assert len(img & set(rows.tolist())) == budget
    assert set(wrapped(model, inp, "dart", budget=3)[1].tolist()) < set(rows_ref)


def test_dart_batched_equals_each_sample_alone():
    """Left padding does not change a sample's pivots, their order or its picks."""
    model = T.tiny_llava()
    inp = T.llava_inputs(batch=2)
    vlm_prune.wrap(model, "dart", budget=6)
    try:
        with torch.no_grad():
            pos = (inp["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
            batched = model(**inp, position_ids=pos).logits
            for b in range(2):
                valid = inp["attention_mask"][b].bool()
                alone = model(input_ids=inp["input_ids"][b:b + 1, valid], pixel_values=inp["pixel_values"][b:b + 1]).logits
                torch.testing.assert_close(batched[b, -alone.shape[1]:], alone[0], atol=1e-5, rtol=0)
    finally:
        vlm_prune.unwrap(model)


@torch.no_grad()
def official_pdrop(model, inp, layers: list[int], counts: list[int], renumber: bool) -> tuple[torch.Tensor, list[int]]:
    """(logits, kept rows) of pdrop_forward + pdrop_rank_drop: before each layer l of ``layers`` the
    last row's head-averaged attention in layer l over the image rows, top counts[s] kept; the
    position ids renumbered 0..n-1 (official) or kept."""
    h = model(**inp, output_hidden_states=True).hidden_states[0][0]
    rows = torch.arange(h.shape[0])
    pos = rows.clone()
    img = set(image_rows(inp).tolist())
    start = 0
    for stage, layer in enumerate(layers):
        h = run_layers(model, h, pos, start, layer)
        q, k = layer_qk(model, layer, h, pos)
        probs = torch.softmax((q[:, -1:] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1).mean(0)[0]
        is_img = torch.tensor([int(r) in img for r in rows])
        v = torch.nonzero(is_img).squeeze(1)
        top = v[probs[v].topk(counts[stage]).indices]
        keep = torch.cat([torch.nonzero(~is_img).squeeze(1), top]).sort().values
        h, rows = h[keep], rows[keep]
        pos = torch.arange(keep.numel()) if renumber else pos[keep]
        start = layer
    h = run_layers(model, h, pos, start)
    return logits_of(model, h), rows.tolist()


@pytest.mark.parametrize("positions", [None, "keep"])
def test_pdrop_defaults_equal_the_official_schedule(model, inp, positions):
    """No keep / budget: layers 8, 16, 24 of 32 scaled to the 6-layer model (2, 3, 4), int(16 * 0.5 ** s)
    kept after stage s; on LLaVA the official renumbering by default."""
    n = image_rows(inp).numel()
    counts = [int(n * 0.5 ** (s + 1)) for s in range(3)]
    ref, rows_ref = official_pdrop(model, inp, [2, 3, 4], counts, positions is None)
    logits, rows = wrapped(model, inp, PyramidDrop(positions=positions))
    assert rows.tolist() == rows_ref
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_pdrop_budget_is_the_final_count_with_an_even_share_per_stage(model, inp):
    n = image_rows(inp).numel()
    target = math.floor(0.25 * n)
    counts = [round(n * (target / n) ** (i / 3)) for i in (1, 2)] + [target]
    ref, rows_ref = official_pdrop(model, inp, [1, 3, 5], counts, True)
    logits, rows = wrapped(model, inp, PyramidDrop(layers=[1, 3, 5]), keep=0.25)
    assert rows.tolist() == rows_ref
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_new_methods_refuse_bad_knobs_with_what_is_allowed():
    with pytest.raises(ValueError, match="positions must be 'renumber' or 'keep'"):
        FasterVLM(positions="gaps")
    with pytest.raises(ValueError, match="important_ratio must be in"):
        VisPruner(important_ratio=1.5)
    with pytest.raises(ValueError, match="DART layer K must be an integer >= 1"):
        DART(layer=0)
    with pytest.raises(ValueError, match="at least one pivot"):
        DART(pivot_image=0, pivot_text=0)
    with pytest.raises(ValueError, match="distinct increasing"):
        PyramidDrop(layers=[3, 2])
    with pytest.raises(ValueError, match="ratio"):
        PyramidDrop(ratio=0)
    with pytest.raises(ValueError, match="renumber.*M-RoPE"):
        vlm_prune.wrap(T.tiny_qwen2_vl(), PyramidDrop(positions="renumber"))


# ---- DivPrune / CDPruner: the official shorter sequence -----------------------------------------
@pytest.mark.parametrize("name", ["divprune", "cdpruner"])
def test_divprune_and_cdpruner_feed_the_official_shorter_sequence(model, inp, name):
    """The official LLaVA code (vbdi/divprune, Theia-4869/CDPruner@ed9c12d prepare_inputs_labels_for_multimodal)
    concatenates the kept tokens between the text pieces and numbers the sequence 0..n-1: the default
    equals the unwrapped model on that sequence; positions="keep" keeps the kept set and the gaps."""
    from vlm_prune.registry import method_class

    logits, rows = wrapped(model, inp, name, budget=5)
    img = image_rows(inp)
    kept = [r for r in rows.tolist() if r in img.tolist()]
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=inp["pixel_values"]).pooler_output[0]
        tokens = feats[torch.tensor(kept) - int(img[0])]
        ref = model(inputs_embeds=official_sequence(model, inp["input_ids"][0], tokens)).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    gaps, rows_keep = wrapped(model, inp, method_class(name)(positions="keep"), budget=5)
    assert torch.equal(rows_keep, rows) and not torch.allclose(gaps[-1], logits[-1], atol=1e-4)


def test_qwen2_vl_keeps_its_m_rope_positions_under_divprune():
    from vlm_prune.methods import DivPrune

    qwen = T.tiny_qwen2_vl()
    vlm_prune.wrap(qwen, "divprune", keep=0.5)
    assert qwen.vlm_prune.methods["vision"].positions == "keep"
    vlm_prune.unwrap(qwen)
    with pytest.raises(ValueError, match="divprune positions='renumber' is for 1-D positions"):
        vlm_prune.wrap(qwen, DivPrune(positions="renumber"), keep=0.5)
