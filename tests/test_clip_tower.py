"""AS-ViT and ToMe inside the CLIP tower of LLaVA-1.5 and LLaVA-NeXT (vlm_prune.adapters.clip_tower).

References are built only from the unwrapped model's own modules: an eager CLIP tower that
masks pruned tokens as keys (AS-ViT) or merges tokens in per-image loops with log-size
attention bias (ToMe), its features projected into the kept placeholder slots of the
prompt, and the decoder run on those rows at their original position ids.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from reference import capture_lm_inputs, float_mask, positions_of, run_layers
from vlm_prune.adapters.clip_tower import CLIPLayerOps
from vlm_prune.methods import ASViT, ToMe


def tiny_llava_deep(layers: int = 6, seed: int = 0):
    """tiny_llava with a deeper CLIP tower: feature layer -2 -> 5 layers to prune in."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=T._llama(),
        image_token_id=T.IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def tiny_llava_next_deep(layers: int = 6, seed: int = 0):
    """tiny_llava_next with a deeper CLIP tower: 32 px tiles of 4 x 4 patches, 5 layers to prune in."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=T._llama(),
        image_token_id=T.IMAGE_TOKEN,
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
        vision_feature_layer=-2,
    )
    model = LlavaNextForConditionalGeneration(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


#: (height, width) of the two LLaVA-NeXT test images -> grid rows kept by unpadding; both are
#: a base tile plus a 1 x 2 tile grid (a 4 x 8 token canvas); 16 x 64 crops it to rows 1 and 2
NEXT_IMAGES = {(32, 64): range(4), (16, 64): range(1, 3)}


def next_inputs():
    """Batch 2, left padded: one image each (52 and 34 placeholders: 16 base + rows x (8 + newline))."""
    g = torch.Generator().manual_seed(3)
    counts = [16 + len(rows) * 9 for rows in NEXT_IMAGES.values()]
    ids, mask = T.prompts([[(T.IMAGE_TOKEN, n)] for n in counts])
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(2, 3, 3, 32, 32, generator=g),
            "image_sizes": torch.tensor(list(NEXT_IMAGES))}


def next_layout(crop):
    """(tile, slot) of each placeholder of one packed LLaVA-NeXT image, None for a newline:
    the base tile's 16 patches, then each kept canvas row y: 8 patches of tiles 1, 2 and a newline."""
    out = [(0, s) for s in range(16)]
    for y in crop:
        out += [(1 + x // 4, y * 4 + x % 4) for x in range(8)] + [None]
    return out


@pytest.fixture(scope="module")
def next_deep():
    return tiny_llava_next_deep()


@pytest.fixture(scope="module")
def shallow():
    return T.tiny_llava()


@pytest.fixture(scope="module")
def deep():
    return tiny_llava_deep()


def run(model, inp, steps=20):
    with torch.no_grad():
        logits = model(**inp).logits
        gen = model.generate(**inp, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return logits, gen


# ---- eager references ----------------------------------------------------------------------
def attention(layer, x, bias=None, alive=None):
    """Eager attention of a CLIP layer: (residual update, probs [B,H,N,N], heads [B,H,N,d], keys)."""
    attn = layer.self_attn
    b, n, _ = x.shape
    h = layer.layer_norm1(x)
    split = lambda t: t.view(b, n, attn.num_heads, attn.head_dim).transpose(1, 2)
    q, k, v = split(attn.q_proj(h)), split(attn.k_proj(h)), split(attn.v_proj(h))
    logits = (q @ k.transpose(-1, -2)) * attn.scale
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    if alive is not None:
        logits = logits.masked_fill(~alive[:, None, None, :], float("-inf"))
    probs = logits.softmax(-1)
    heads = probs @ v
    return attn.out_proj(heads.transpose(1, 2).reshape(b, n, -1)), probs, heads, k


def embed(model, pixels):
    tower = model.model.vision_tower
    return tower.pre_layrnorm(tower.embeddings(pixels)), tower.encoder.layers


def asvit_tower(model, pixels, depth, keep_after):
    """Pruned tokens stay but are masked as keys; after layer i (a key of keep_after) each
    image keeps its keep_after[i] alive patches with the highest head-weighted CLS attention."""
    x, layers = embed(model, pixels)
    alive = torch.ones(x.shape[:2], dtype=torch.bool)
    for i in range(depth):
        upd, probs, heads, _ = attention(layers[i], x, alive=alive)
        x = x + upd
        x = x + layers[i].mlp(layers[i].layer_norm2(x))
        if i in keep_after:
            norms = heads.norm(dim=-1)
            score = (probs[:, :, 0] * norms / norms.sum(1, keepdim=True)).sum(1)
            score = score.masked_fill(~alive, float("-inf"))
            score[:, 0] = float("-inf")
            alive = torch.zeros_like(alive)
            alive[:, 0] = True
            alive.scatter_(1, score.topk(keep_after[i], dim=1).indices, True)
    out = []
    for b in range(x.shape[0]):
        slots = torch.nonzero(alive[b]).squeeze(1)
        out.append((x[b, slots[1:]], slots[1:] - 1, torch.ones(slots.numel() - 1)))
    return out


def tome_tower(model, pixels, depth, r):
    """Per image and block, the official ToMe in explicit loops: attention with log(size) bias;
    the whole sequence split alternately into A (even positions, CLS at 0 protected) and B (odd);
    the r A tokens with the most similar B partner (mean-over-heads key cosine) merged into it by
    size-weighted sums; output CLS, unmerged A in order, then B."""
    x, layers = embed(model, pixels)
    out = []
    for b in range(x.shape[0]):
        xb, sizes, slots = x[b], torch.ones(x.shape[1]), torch.arange(x.shape[1])
        for i in range(depth):
            upd, _, _, k = attention(layers[i], xb[None], bias=sizes.log()[None])
            xb = xb + upd[0]
            metric = k[0].mean(0)
            metric = metric / metric.norm(dim=-1, keepdim=True)
            a_rows, b_rows = list(range(2, xb.shape[0], 2)), list(range(1, xb.shape[0], 2))
            best = sorted(((max(float(metric[a] @ metric[j]) for j in b_rows), -a) for a in a_rows), reverse=True)
            merged = [-a for _, a in best[:r]]
            partner = {a: max(b_rows, key=lambda j: float(metric[a] @ metric[j])) for a in merged}
            groups = [[0]] + [[a] for a in a_rows if a not in merged] + [[j] + [a for a in merged if partner[a] == j] for j in b_rows]
            xb = torch.stack([sum(xb[t] * sizes[t] for t in g) / sum(sizes[t] for t in g) for g in groups])
            slots = torch.stack([slots[g[0]] for g in groups])
            sizes = torch.stack([sum(sizes[t] for t in g) for g in groups])
            xb = xb + layers[i].mlp(layers[i].layer_norm2(xb))
        out.append((xb[1:], slots[1:] - 1, sizes[1:]))
    return out


def hand_built_logits(model, inp, b, feats, slots, sizes, positions):
    """Logits of sample b's valid text rows plus the image placeholders at ``slots`` (holding
    the projected ``feats``), at their original positions, log(size) added for those keys."""
    return hand_built_from_embeds(model, inp, b, model.model.multi_modal_projector(feats), slots, sizes, positions)


def hand_built_from_embeds(model, inp, b, embeds, slots, sizes, positions):
    """As hand_built_logits, the placeholders at ``slots`` holding LLM input rows ``embeds``."""
    ids = inp["input_ids"][b]
    lm = model.model.language_model
    vis = torch.nonzero(ids == T.IMAGE_TOKEN).squeeze(1)
    emb = lm.embed_tokens(ids).clone()
    emb[vis[slots]] = embeds
    keep = inp["attention_mask"][b].bool() & (ids != T.IMAGE_TOKEN)
    keep[vis[slots]] = True
    bias = torch.zeros(ids.shape[0])
    bias[vis[slots]] = sizes.log()
    rows = torch.nonzero(keep).squeeze(1)
    n = rows.numel()
    mask = float_mask(torch.ones(1, n, n, dtype=torch.bool).tril(), emb.dtype, bias[rows][None])
    return rows, run_layers(model, emb[rows][None], positions[:, b : b + 1, rows], lambda _: mask)[0]


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("which, method", [("deep", lambda: ASViT(keep=1.0)), ("shallow", lambda: ToMe(r=0))])
def test_identity_when_nothing_is_pruned(which, method, request):
    """keep=1.0 / r=0 equals the unwrapped model: prefill logits at valid rows and a 20-step
    greedy generate (images encoded before the forward), batch 2 with left padding."""
    model = request.getfixturevalue(which)
    inp = T.llava_inputs()
    valid = inp["attention_mask"].bool()
    ref_logits, ref_gen = run(model, inp)
    vlm_prune.wrap(model, method())
    try:
        logits, gen = run(model, inp)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)
    assert [r["stage"] for r in stats["stages"]] == ["vit"]
    assert stats["visual_tokens_out"] == stats["visual_tokens_in"] == [16, 16]


@pytest.mark.parametrize("method, per_layer, out", [
    # AS-ViT prunes before layers 1, 2, 4 (floor(5 * (4, 7, 10) / 12)); keep / budget is the final count
    (lambda: ASViT(keep=0.7), [17, 15, 13, 13, 12], 11),  # floor(16 * (11 / 16) ** (s / 3)), then 11
    (lambda: ASViT(budget=4), [17, 11, 7, 7, 5], 4),  # floor(16 * (4 / 16) ** (s / 3)), then 4
    (lambda: ToMe(r=2), [17, 15, 13, 11, 9], 6),
    (lambda: ToMe(keep=0.5), [17, 15, 13, 11, 10], 8),  # 8 merges over 5 layers: 2, 2, 2, 1, 1
])
def test_tower_token_counts_follow_the_schedule(deep, method, per_layer, out):
    """Tokens entering each tower layer up to the feature layer (layer 4 of 6), per image."""
    inp = T.llava_inputs()
    seen = []
    handle = deep.model.multi_modal_projector.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    vlm_prune.wrap(deep, method())
    try:
        with torch.no_grad():
            deep(**inp)
        stats = deep.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(deep)
        handle.remove()
    (record,) = stats["stages"]
    assert record["tokens_per_layer"] == per_layer
    assert record["tokens_in"] == [16, 16] and record["tokens_out"] == [out, out]
    assert stats["visual_tokens_out"] == [out, out]
    assert seen == [torch.Size([2, out, 32])]  # CLS dropped, one dense batch
    assert 0 < record["flops_ratio"] < 1


@pytest.mark.parametrize("name", ["asvit", "tome"])
def test_pruned_llava_equals_hand_built_input(deep, name):
    """The wrapped model's logits equal the unwrapped decoder run on only the text rows and
    the kept image slots, holding the projected features of an eager reference tower."""
    inp = T.llava_inputs()
    method = ASViT(keep=0.7) if name == "asvit" else ToMe(r=2)
    vlm_prune.wrap(deep, method)
    try:
        with torch.no_grad():
            logits = deep(**inp).logits
        rows = deep.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(deep)
    with torch.no_grad(), capture_lm_inputs(deep) as seen:
        deep(**inp)
        b, s = inp["input_ids"].shape
        positions = positions_of(seen[0], b, s)
        if name == "asvit":
            # keep 0.7 of 16 = 11 after the last stage; pruned before layers 1, 2, 4: 14, 12, 11
            ref = asvit_tower(deep, inp["pixel_values"], 5, {0: 14, 1: 12, 3: 11})
        else:
            ref = tome_tower(deep, inp["pixel_values"], 5, 2)
        for i, (feats, slots, sizes) in enumerate(ref):
            if name == "tome":
                assert sizes.sum() == 16 and sizes.max() > 1
            order = slots.argsort()
            kept, expected = hand_built_logits(deep, inp, i, feats[order], slots[order], sizes[order], positions)
            assert torch.equal(rows[i][rows[i] >= 0], kept)
            torch.testing.assert_close(logits[i, rows[i] >= 0], expected, atol=1e-5, rtol=0)


def test_generate_reduces_the_pre_encoded_images(shallow):
    """generate() encodes images before its first forward; the prefill it runs is the pruned
    forward's: same first token and same stats."""
    inp = T.llava_inputs()
    vlm_prune.wrap(shallow, ToMe(r=3))
    try:
        with torch.no_grad():
            logits = shallow(**inp).logits
            stats = shallow.vlm_prune.last_stats
            gen = shallow.generate(**inp, max_new_tokens=2, do_sample=False)
        assert torch.equal(gen[:, inp["input_ids"].shape[1]], logits[:, -1].argmax(-1))
        assert shallow.vlm_prune.last_stats["stages"] == stats["stages"]
        assert stats["visual_tokens_out"] == [13, 13]
    finally:
        vlm_prune.unwrap(shallow)


def test_unwrap_restores_bit_identical(shallow):
    inp = T.llava_inputs()
    modules = list(shallow.modules())
    before = [set(vars(m)) for m in modules]
    ref, ref_gen = run(shallow, inp, steps=3)
    vlm_prune.wrap(shallow, ToMe(r=2))
    run(shallow, inp, steps=3)
    vlm_prune.unwrap(shallow)
    out, gen = run(shallow, inp, steps=3)
    assert torch.equal(out, ref) and torch.equal(gen, ref_gen)
    assert [set(vars(m)) for m in modules] == before


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_layer_ops_reproduce_the_clip_layer(deep, impl):
    """attention + mlp without bias is bit-identical to the layer; a log-size bias and key
    weights match the eager reference."""
    layer = deep.model.vision_tower.encoder.layers[1]
    deep.model.vision_tower.set_attn_implementation(impl)
    try:
        x = torch.randn(2, 17, 32)
        ops = CLIPLayerOps(layer, 1, 5, None, {})
        with torch.no_grad():
            a = ops.attention(x)
            y = x + a.out
            assert torch.equal(y + ops.mlp(y), layer(x, None))
            bias = torch.rand(2, 17) + 0.5
            ref = attention(layer, x, bias=bias.log())
            torch.testing.assert_close(ops.attention(x, bias=bias.log()[:, None, None]).out, ref[0], atol=1e-6, rtol=0)
            alive = torch.rand(2, 17) > 0.3
            alive[:, 0] = True
            ref = attention(layer, x, alive=alive)
            got = ops.attention(x, key_weights=alive.float())
            torch.testing.assert_close(got.probs[:, :, 0][alive[:, None].expand(-1, 2, -1)],
                                       ref[1][:, :, 0][alive[:, None].expand(-1, 2, -1)], atol=1e-5, rtol=0)
    finally:
        deep.model.vision_tower.set_attn_implementation("sdpa")


def _llava_with(**kw):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8)
    siglip = kw.pop("siglip", False)
    cfg = LlavaConfig(vision_config=(SiglipVisionConfig if siglip else CLIPVisionConfig)(**vision),
                      text_config=T._llama(num_hidden_layers=1), image_token_id=T.IMAGE_TOKEN, **kw)
    return LlavaForConditionalGeneration(cfg)


def test_full_strategy_keeps_the_cls_placeholder():
    """With vision_feature_select_strategy 'full' the CLS token is placeholder 0 and is never merged."""
    model = _llava_with(vision_feature_select_strategy="full", vision_feature_layer=-2).eval()
    inp = T.llava_inputs(n_img_tokens=17)
    vlm_prune.wrap(model, ToMe(r=2))
    try:
        with torch.no_grad():
            model(**inp)
        stats, rows = model.vlm_prune.last_stats, model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)
    assert stats["stages"][0]["tokens_in"] == [17, 17] and stats["visual_tokens_out"] == [13, 13]  # 16 -> 14 -> 12 patches
    for b in range(2):
        first = int(torch.nonzero(inp["input_ids"][b] == T.IMAGE_TOKEN)[0])
        assert first in rows[b].tolist()


@pytest.mark.parametrize("make, method, message", [
    (T.tiny_llava, "asvit", "at least 2 blocks (in a VLM: tower layers up to the feature layer)"),
    (T.tiny_llava_next, "asvit", "at least 2 blocks (in a VLM: tower layers up to the feature layer)"),
    (T.tiny_onevision, "tome", "does not offer"),
    (T.tiny_qwen2_vl, "tome", "does not offer"),
    (lambda: _llava_with(siglip=True, vision_feature_select_strategy="full", vision_feature_layer=-1), "tome", "needs its CLS token"),
    (lambda: _llava_with(vision_feature_layer=[-2, -1]), "tome", "follows one feature layer"),
    (lambda: _llava_with(vision_feature_layer=0), "tome", "reads the tower's embeddings"),
])
def test_unsupported_models_fail_at_wrap_time(make, method, message):
    model = make()
    with pytest.raises(ValueError) as err:
        vlm_prune.wrap(model, method, keep=0.5)
    assert message in str(err.value)
    assert not hasattr(model, "vlm_prune")


# ---- LLaVA-NeXT: one tower row per anyres tile -------------------------------------------------
@pytest.mark.parametrize("method", [lambda: ASViT(keep=1.0), lambda: ToMe(r=0)])
def test_next_identity_when_nothing_is_pruned(next_deep, method):
    """keep=1.0 / r=0 on LLaVA-NeXT equals the unwrapped model (two image sizes, one cropped by
    unpadding): prefill logits at valid rows and a 20-step greedy generate, batch 2."""
    inp = next_inputs()
    valid = inp["attention_mask"].bool()
    ref_logits, ref_gen = run(next_deep, inp)
    vlm_prune.wrap(next_deep, method())
    try:
        logits, gen = run(next_deep, inp)
        stats = next_deep.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(next_deep)
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)
    assert [r["stage"] for r in stats["stages"]] == ["vit"]
    assert stats["visual_tokens_out"] == stats["visual_tokens_in"] == [48, 32]  # newline tokens are not visual


@pytest.mark.parametrize("name", ["asvit", "tome"])
def test_pruned_next_equals_hand_built_input(next_deep, name):
    """Every tile is pruned in the tower like a LLaVA-1.5 image (eager reference towers); the
    wrapped model's logits equal the unwrapped decoder run on the text rows and, in the packed
    order laid out by hand (base tile, unpadded canvas rows, a newline ending each), only the
    placeholders of surviving patches (projected reference features) and every newline, at
    their original positions with log(size) bias; generate's prefill is the same forward."""
    inp = next_inputs()
    method = ASViT(keep=0.7) if name == "asvit" else ToMe(r=2)
    vlm_prune.wrap(next_deep, method)
    try:
        with torch.no_grad():
            logits = next_deep(**inp).logits
            rows, stats = next_deep.vlm_prune.last_rows, next_deep.vlm_prune.last_stats
            gen = next_deep.generate(**inp, max_new_tokens=1, do_sample=False)
        assert next_deep.vlm_prune.last_stats["stages"] == stats["stages"]
    finally:
        vlm_prune.unwrap(next_deep)
    assert torch.equal(gen[:, -1], logits[:, -1].argmax(-1))
    tiles = inp["pixel_values"].flatten(0, 1)  # 3 tiles per image: base, left, right
    with torch.no_grad(), capture_lm_inputs(next_deep) as seen:
        next_deep(**inp)
        b, s = inp["input_ids"].shape
        positions = positions_of(seen[0], b, s)
        if name == "asvit":
            ref = asvit_tower(next_deep, tiles, 5, {0: 14, 1: 12, 3: 11})  # as on LLaVA-1.5
        else:
            ref = tome_tower(next_deep, tiles, 5, 2)
        newline = next_deep.model.image_newline
        kept_counts = []
        for i, crop in enumerate(NEXT_IMAGES.values()):
            survivors = [{int(sl): (f, sz) for f, sl, sz in zip(*ref[3 * i + t])} for t in range(3)]
            slots, embeds, sizes = [], [], []
            for p, token in enumerate(next_layout(crop)):
                if token is None or token[1] in survivors[token[0]]:
                    f, sz = (None, 1.0) if token is None else survivors[token[0]][token[1]]
                    slots.append(p)
                    embeds.append(newline if f is None else next_deep.model.multi_modal_projector(f))
                    sizes.append(float(sz))
            sizes = torch.tensor(sizes)
            if name == "tome":
                assert sizes.max() > 1
            kept, expected = hand_built_from_embeds(next_deep, inp, i, torch.stack(embeds), torch.tensor(slots),
                                                    sizes, positions)
            assert torch.equal(rows[i][rows[i] >= 0], kept)
            torch.testing.assert_close(logits[i, rows[i] >= 0], expected, atol=1e-5, rtol=0)
            kept_counts.append(sum(1 for t in next_layout(crop) if t is not None and t[1] in survivors[t[0]]))
    assert stats["visual_tokens_in"] == [48, 32]  # the newline tokens are not visual tokens
    assert stats["visual_tokens_out"] == stats["stages"][0]["tokens_out"] == kept_counts
    assert all(o < n for o, n in zip(kept_counts, [48, 32]))


def test_next_unwrap_restores_bit_identical(next_deep):
    inp = next_inputs()
    modules = list(next_deep.modules())
    ref, ref_gen = run(next_deep, inp, steps=3)
    before = [set(vars(m)) for m in modules]
    vlm_prune.wrap(next_deep, ToMe(r=2))
    pruned, _ = run(next_deep, inp, steps=3)
    vlm_prune.unwrap(next_deep)
    out, gen = run(next_deep, inp, steps=3)
    assert not torch.equal(pruned, ref)
    assert torch.equal(out, ref) and torch.equal(gen, ref_gen)
    assert [set(vars(m)) for m in modules] == before
