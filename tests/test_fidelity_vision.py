"""Fidelity: each vision-side method against a small, independently written re-statement of its
official algorithm (named with the commit read), on fixed tensors or tiny models.

AS-ViT (Cydia2018/AS-ViT@e57f445 vit.py / infer.py), ToMe (facebookresearch/ToMe@049a705
tome/patch/timm.py + tome/merge.py), CDPruner (Theia-4869/CDPruner@ed9c12d llava_arch.py),
DivPrune (vbdi/divprune, the DivPrune() selection loop) and VisionZip (dvlab-research/VisionZip,
visionzip/ main.py + utils.py + clip_encoder.py). The re-statements follow the official control
flow in plain loops; none of their code is copied.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import vlm_prune
from vlm_prune.methods.base import VisionContext
from vlm_prune.methods.cdpruner import CDPruner, crop_budgets
from vlm_prune.methods.divprune import max_min_diverse
from vlm_prune.methods.tome import ToMe, merge_schedule, merge_tokens, reachable_tokens

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402
from test_vit import images, one_thread, tiny_vit  # noqa: E402,F401  (one_thread: autouse fixture)

from vlm_prune.methods.asvit import ASViT  # noqa: E402


def eager_block(blk, h: torch.Tensor, log_size: torch.Tensor | None = None):
    """One timm block with explicit attention: (attention output, probs [B,H,N,N], per-head
    outputs [B,H,N,d], keys [B,H,N,d]); the MLP is applied by the caller."""
    attn = blk.attn
    b, n, _ = h.shape
    q, k, v = attn.qkv(blk.norm1(h)).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    logits = (q @ k.transpose(-2, -1)) * attn.scale
    if log_size is not None:
        logits = logits + log_size[:, None, None, :]
    probs = logits.softmax(-1)
    heads = probs @ v
    return attn.proj(heads.transpose(1, 2).reshape(b, n, -1)), probs, heads, k


# ---- AS-ViT -----------------------------------------------------------------------------------
@torch.no_grad()
def official_asvit(m: VisionTransformer, x: torch.Tensor, thresholds, locations=(4, 7, 10)):
    """The official eval-mode forward (non-accumulating): the score of block i - 1 decides, before
    block i in ``locations``, which patches stay: B = 1 keeps score > theta; B > 1 keeps each image's
    (number above theta) // B best by argsort. Returns (logits, kept patch ids per image, the
    scores each location decided on)."""
    h = m.norm_pre(m._pos_embed(m.patch_embed(x)))
    ids = torch.arange(h.shape[1] - 1).expand(h.shape[0], -1)
    score, seen = None, []
    for i, blk in enumerate(m.blocks):
        if i in locations:
            seen.append(score)
            theta = thresholds[locations.index(i)]
            above = score > theta
            if h.shape[0] == 1:
                keep = torch.nonzero(above[0]).squeeze(1)[None]
            else:
                keep = torch.argsort(score, dim=1, descending=True)[:, : int(above.sum()) // h.shape[0]]
            h = torch.cat([h[:, :1], torch.stack([h[b, 1:][keep[b]] for b in range(h.shape[0])])], 1)
            ids = torch.stack([ids[b][keep[b]] for b in range(h.shape[0])])
        out, probs, heads, _ = eager_block(blk, h)
        h = h + out
        h = h + blk.mlp(blk.norm2(h))
        norms = heads[:, :, 1:].norm(dim=-1)
        score = (probs[:, :, 0, 1:] * norms / (norms.sum(1, keepdim=True) + 1e-8)).sum(1)
    return m.forward_head(m.norm(h)), [sorted(r.tolist()) for r in ids], seen


@pytest.mark.parametrize("batch", [1, 3])
def test_asvit_thresholds_equal_the_official_forward(batch):
    m = tiny_vit()
    x = images(batch)
    thresholds = [1.0, 1.0, 1.0]
    for s in range(3):  # each stage's threshold at the 35% quantile of the scores it sees
        thresholds[s] = -1.0
        thresholds[s] = float(official_asvit(m, x, thresholds)[2][s].quantile(0.35))
    ref_logits, ref_kept, _ = official_asvit(m, x, thresholds)
    assert 0 < min(len(k) for k in ref_kept) < 6  # every stage pruned
    vlm_prune.wrap(m, ASViT(mode="threshold", thresholds=thresholds))
    with torch.no_grad():
        logits = m(x)
    slots = m.vlm_prune.adapter.run.slots
    assert [sorted((s[1:] - 1).tolist()) for s in slots] == ref_kept
    torch.testing.assert_close(logits, ref_logits.detach(), atol=2e-6, rtol=0)


def test_asvit_budget_is_the_final_patch_count():
    m = tiny_vit()
    for budget in (1, 5, 11, 16):
        vlm_prune.wrap(m, ASViT(budget=budget))
        with torch.no_grad():
            m(images(2))
        per_block = m.vlm_prune.last_stats["vit"]["tokens_per_block"]
        assert m.vlm_prune.last_stats["vit"]["patches_out"] == budget
        vlm_prune.unwrap(m)
        assert per_block[10:] == [1 + budget] * 2  # after the last stage (before block 10)
        assert per_block[:4] == [17] * 4 and per_block[4] >= per_block[7] >= per_block[10]


# ---- ToMe -------------------------------------------------------------------------------------
def official_merge(x: torch.Tensor, size: torch.Tensor, metric: torch.Tensor, r: int, protected: int):
    """One image: A = even, B = odd positions of the whole sequence; protected rows (CLS, then
    the distillation token) neither merge nor receive; the r A rows with the best B match merge
    into it (size-weighted); output protected rows, unmerged A in order, then B."""
    r = min(r, (x.shape[0] - protected) // 2)
    mn = metric / metric.norm(dim=-1, keepdim=True)
    a_rows = [i for i in range(0, len(x), 2) if i >= protected]
    b_rows = [j for j in range(1, len(x), 2) if j >= protected]
    match = {i: max(b_rows, key=lambda j: float(mn[i] @ mn[j])) for i in a_rows}
    ranked = sorted(a_rows, key=lambda i: -float(mn[i] @ mn[match[i]]))
    merged = set(ranked[:r])
    groups = [[i] for i in range(protected)] + [[i] for i in a_rows if i not in merged]
    groups += [[j] + [i for i in sorted(merged) if match[i] == j] for j in b_rows]
    new_x = torch.stack([sum(x[i] * size[i] for i in g) / sum(size[i] for i in g) for g in groups])
    return new_x, torch.stack([sum(size[i] for i in g) for g in groups])


@pytest.mark.parametrize("protected", [1, 2])
def test_tome_merge_equals_the_official_split(protected):
    g = torch.Generator().manual_seed(0)
    x, metric = torch.randn(2, 15, 6, generator=g), torch.randn(2, 15, 5, generator=g)
    sizes = torch.randint(1, 4, (2, 15), generator=g).float()
    got_x, got_s = merge_tokens(x, sizes, metric, 5, n_prefix=protected)
    for b in range(2):
        ref_x, ref_s = official_merge(x[b], sizes[b], metric[b], 5, protected)
        torch.testing.assert_close(got_x[b], ref_x)
        torch.testing.assert_close(got_s[b], ref_s)


@torch.no_grad()
def official_tome(m: VisionTransformer, x: torch.Tensor, r: int) -> torch.Tensor:
    h = m.norm_pre(m._pos_embed(m.patch_embed(x)))
    size = torch.ones(h.shape[:2])
    for blk in m.blocks:
        out, _, _, k = eager_block(blk, h, size.log())
        h = h + out
        rows = [official_merge(h[b], size[b], k[b].mean(0), r, 1) for b in range(h.shape[0])]
        h, size = torch.stack([t[0] for t in rows]), torch.stack([t[1] for t in rows])
        h = h + blk.mlp(blk.norm2(h))
    return m.forward_head(m.norm(h))


def test_tome_r_equals_the_official_forward():
    m = tiny_vit(depth=4)
    x = images(2)
    with torch.no_grad():
        ref = official_tome(m, x, 3)
    vlm_prune.wrap(m, ToMe(r=3))
    with torch.no_grad():
        got = m(x)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)


def test_tome_budget_reaches_its_target_or_warns_the_reachable_count():
    assert merge_schedule(16, 1, 6, 4) == (2, 2, 2, 2, 2, 2)
    # 2 blocks can at most halve twice: 16 -> 8 -> 4; a target of 5 front-loads the merges
    assert reachable_tokens(16, 1, 2) == 4 and merge_schedule(16, 1, 2, 5) == (6, 5)
    m = tiny_vit(depth=2)
    for budget, floor in ((5, None), (4, None), (3, 4), (1, 4)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vlm_prune.wrap(m, ToMe(budget=budget))
        assert len(caught) == (floor is not None)
        with torch.no_grad():
            m(images(2))
        method, adapter = m.vlm_prune.methods["vit"], m.vlm_prune.adapter
        assert m.vlm_prune.last_stats["vit"]["patches_out"] == (budget if floor is None else floor)
        note = method.budget_warning(adapter)
        assert (note is None) == (floor is None) and (floor is None or f"cannot go below {floor}" in note)
        vlm_prune.unwrap(m)


def test_tome_unreachable_budget_warns_once_at_wrap_and_last_stats_says_it():
    from vlm_prune.methods.base import BudgetWarning

    m = tiny_vit(depth=2)
    with pytest.warns(BudgetWarning, match="cannot go below 4 per image; asked for 2"):
        vlm_prune.wrap(m, ToMe(budget=2))
    with torch.no_grad():
        m(images(2))
    stats = m.vlm_prune.last_stats
    assert stats["vit"]["patches_out"] == 4 and "cannot go below 4" in stats["budget_notes"][0]


# ---- CDPruner ---------------------------------------------------------------------------------
def greedy_logdet(kernel: torch.Tensor, k: int) -> list[int]:
    """Greedy MAP of a DPP by brute force: each step adds the item that maximises log det."""
    chosen: list[int] = []
    for _ in range(k):
        gains = [(float(torch.logdet(kernel[chosen + [i]][:, chosen + [i]].double())), -i)
                 for i in range(kernel.shape[0]) if i not in chosen]
        chosen.append(-max(gains)[1])
    return chosen


def official_cdpruner_kernel(feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The official kernel: relevance = min-max(mean over text of -cos) + 1e-6, L = r S r."""
    f = feats / feats.norm(dim=-1, keepdim=True)
    rel = -(f @ (text / text.norm(dim=-1, keepdim=True)).t()).mean(-1)
    rel = (rel - rel.min() + 1e-6) / (rel.max() - rel.min())
    return rel[:, None] * (f @ f.t()) * rel[None, :]


def test_cdpruner_equals_the_official_selection():
    g = torch.Generator().manual_seed(3)
    feats, text = torch.randn(24, 16, generator=g), torch.randn(5, 16, generator=g)
    red = CDPruner().reduce_image(VisionContext(feats, 7, text_embeds=text))
    assert red.indices.tolist() == sorted(greedy_logdet(official_cdpruner_kernel(feats, text), 7))


def test_cdpruner_per_crop_on_llava_next_equals_the_official_selection():
    """One DPP per crop (base image, then each tile), each with its share of the budget, the
    relevance normalised over the whole image, newline tokens always kept (official)."""
    import tiny_models as T

    class Spy(CDPruner):
        seen: list = []

        def reduce_crops(self, ctx, crops):
            red = super().reduce_crops(ctx, crops)
            Spy.seen.append((ctx, crops, red))
            return red

    model = T.tiny_llava_next()
    inp = T.llava_next_inputs(model)  # 32 x 64 images: base 4 x 4, then 4 rows of 2 tiles x 4 + newline
    vlm_prune.wrap(model, Spy(), budget=6)
    with torch.no_grad():
        model(**inp)
    assert len(Spy.seen) == 2
    layout = [0] * 16 + ([1] * 4 + [2] * 4 + [-1]) * 4
    for ctx, crops, red in Spy.seen:
        assert crops.tolist() == layout
        assert ctx.n_keep == 6 and crop_budgets(6, [16, 16, 16]) == [2, 2, 2]
        visual = torch.tensor(layout) >= 0
        f = ctx.features / ctx.features.norm(dim=-1, keepdim=True)
        t = ctx.text_embeds / ctx.text_embeds.norm(dim=-1, keepdim=True)
        rel = -(f @ t.t()).mean(-1)
        lo, hi = rel[visual].min(), rel[visual].max()
        rel = (rel - lo + 1e-6) / (hi - lo)
        expected = [i for i, c in enumerate(layout) if c < 0]
        for c in (0, 1, 2):
            idx = [i for i, cc in enumerate(layout) if cc == c]
            kernel = rel[idx, None] * (f[idx] @ f[idx].t()) * rel[None, idx]
            expected += [idx[j] for j in greedy_logdet(kernel, 2)]
        assert red.indices.tolist() == sorted(expected)
    assert model.vlm_prune.last_stats["visual_tokens_in"] == [48, 48]  # the 4 newlines are not visual tokens
    assert model.vlm_prune.last_stats["visual_tokens_out"] == [6, 6]


def test_crop_budgets_split_exactly():
    assert crop_budgets(7, [16, 16, 16]) == [3, 2, 2]
    assert crop_budgets(10, [16, 8, 8]) == [5, 3, 2]
    assert crop_budgets(100, [3, 2]) == [3, 2]


# ---- DivPrune ---------------------------------------------------------------------------------
def official_divprune(feats: torch.Tensor, k: int) -> list[int]:
    """First the token whose nearest other token (second smallest cosine distance in its column)
    is farthest; then repeatedly the column whose smallest distance to the chosen rows is largest."""
    f = feats / feats.norm(dim=1, keepdim=True)
    dist = 1.0 - f @ f.t()
    chosen = [int(torch.argmax(torch.sort(dist, dim=0).values[1]))]
    while len(chosen) < k:
        chosen.append(int(torch.argmax(dist[chosen].min(dim=0).values)))
    return chosen


@pytest.mark.parametrize("k", [1, 5, 17, 40])
def test_divprune_equals_the_official_selection(k):
    feats = torch.randn(40, 12, generator=torch.Generator().manual_seed(k))
    assert max_min_diverse(feats, k).tolist()[: k] == official_divprune(feats, k)


def test_divprune_never_repicks_a_duplicate():
    feats = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).repeat(2, 1)
    picked = max_min_diverse(feats, 12).tolist()
    assert sorted(picked) == list(range(12))
    assert picked[:6] == official_divprune(feats, 6)


# ---- VisionZip --------------------------------------------------------------------------------
@torch.no_grad()
def official_visionzip(model, pixels: torch.Tensor, dominant: int, contextual: int) -> list[torch.Tensor]:
    """The official LLaVA path per image: CLS + (dominant - 1) patches by CLS attention (summed over
    heads) in the feature layer; the rest, in order, merged into ``contextual`` tokens (every
    step-th a target, the others to the target of highest mean-over-heads key cosine, target +
    mean of its group) on the feature layer's OUTPUTS; [dominant, contextual] then projected."""
    tower = model.model.vision_tower
    hs = tower(pixels, output_hidden_states=True).hidden_states
    layer = getattr(tower, "vision_model", tower).encoder.layers[len(hs) - 3]  # hidden_states[-2] is its output
    attn = layer.self_attn
    x = layer.layer_norm1(hs[-3])
    b, n, _ = x.shape
    q = attn.q_proj(x).view(b, n, attn.num_heads, -1).transpose(1, 2)
    k = attn.k_proj(x).view(b, n, attn.num_heads, -1).transpose(1, 2)
    cls_attn = ((q @ k.transpose(-1, -2)) * attn.scale).softmax(-1).sum(1)[:, 0, 1:]
    metric, feats = k.mean(1), hs[-2]
    out = []
    for i in range(b):
        keep = [0] + sorted((cls_attn[i].topk(dominant - 1).indices + 1).tolist())
        rest = [t for t in range(n) if t not in keep]
        step = max(1, len(rest) // contextual)
        targets = rest[::step][:contextual]
        others = [t for t in rest if t not in targets]
        mn = metric[i] / metric[i].norm(dim=-1, keepdim=True)
        groups = {t: [] for t in targets}
        for o in others:
            groups[max(targets, key=lambda t: float(mn[o] @ mn[t]))].append(o)
        ctx = [feats[i, t] + (feats[i, g].mean(0) if g else 0) for t, g in groups.items()]
        out.append(model.model.multi_modal_projector(torch.cat([feats[i, keep], torch.stack(ctx)])))
    return out


def test_visionzip_equals_the_official_llava_path():
    import tiny_models as T
    from vlm_prune.methods.visionzip import VisionZip

    class Spy(VisionZip):
        seen: list = []

        def reduce_image(self, ctx):
            red = super().reduce_image(ctx)
            Spy.seen.append(red)
            return red

    model, inp = T.tiny_llava(), T.llava_inputs()
    vlm_prune.wrap(model, Spy(), budget=8)  # 8 = round(8 * 54/64) = 7 dominant (CLS + 6) + 1 contextual
    with torch.no_grad():
        model(**inp)
    ref = official_visionzip(model, inp["pixel_values"], 7, 1)
    assert len(Spy.seen) == 2
    for red, expected in zip(Spy.seen, ref):
        assert red.indices.tolist() == list(range(8))  # packed contiguously from the image's first slot
        torch.testing.assert_close(red.features, expected, atol=1e-5, rtol=0)
    ref = official_visionzip(model, inp["pixel_values"], 5, 3)
    Spy.seen.clear()
    vlm_prune.unwrap(model)
    vlm_prune.wrap(model, Spy(dominant_ratio=5 / 8), budget=8)
    with torch.no_grad():
        model(**inp)
    for red, expected in zip(Spy.seen, ref):
        torch.testing.assert_close(red.features, expected, atol=1e-5, rtol=0)


def test_visionzip_slots_variant_keeps_tokens_at_their_own_slots():
    import tiny_models as T
    from vlm_prune.methods.visionzip import VisionZip, visionzip_reduce

    class Spy(VisionZip):
        seen: list = []

        def reduce_image(self, ctx):
            Spy.seen.append((ctx, super().reduce_image(ctx)))
            return Spy.seen[-1][1]

    model, inp = T.tiny_llava(), T.llava_inputs()
    vlm_prune.wrap(model, Spy(variant="slots"), budget=8)
    with torch.no_grad():
        model(**inp)
    for ctx, red in Spy.seen:
        attention, keys, _ = ctx.tower_attention()
        ref = visionzip_reduce(ctx.features, attention, keys, 7, 1)
        assert torch.equal(red.indices, ref.indices) and torch.equal(red.features, ref.features)
        assert red.indices.tolist() != list(range(8))


@torch.no_grad()
def official_visionzip_sequence(model, ids: torch.Tensor, pixels: torch.Tensor, dominant: int, contextual: int):
    """One sample as the official LLaVA code feeds the language model: the image's placeholders
    replaced by its dominant + contextual tokens, a shorter sequence at positions 0..n-1."""
    import tiny_models as T

    tokens = official_visionzip(model, pixels[None], dominant, contextual)[0]
    embed = model.get_input_embeddings()
    is_image = ids == T.IMAGE_TOKEN
    first = int(torch.nonzero(is_image)[0])
    last = int(torch.nonzero(is_image)[-1])
    return torch.cat([embed(ids[:first]), tokens, embed(ids[last + 1:])])[None]


@pytest.mark.parametrize("next_token", [None, 7])
def test_visionzip_positions_and_logits_equal_the_official_llava_sequence(next_token):
    """The LLM sees what the official code gives it: the text after the image follows the k image
    tokens in position (renumbered), and so do decode steps; logits of the text rows are the
    official model's on the shorter sequence."""
    import tiny_models as T
    from vlm_prune.methods.visionzip import VisionZip

    model, inp = T.tiny_llava(), T.llava_inputs(batch=1)
    ids = inp["input_ids"][0]
    short = official_visionzip_sequence(model, ids, inp["pixel_values"][0], 7, 1)
    with torch.no_grad():
        ref = model(inputs_embeds=short).logits[0]  # unwrapped: positions 0..n-1
        full = torch.cat([short, model.get_input_embeddings()(torch.tensor([[next_token or 0]]))], 1)
        ref_step = model(inputs_embeds=full).logits[0, -1]
        vlm_prune.wrap(model, VisionZip(), budget=8)
        try:
            out = model(**inp, use_cache=True)
            rows = model.vlm_prune.last_rows[0]
            assert out.logits.shape[1] == short.shape[1] == rows.numel()  # 8 image rows stay
            torch.testing.assert_close(out.logits[0], ref, atol=1e-5, rtol=0)
            if next_token is not None:  # one decode step continues at position n
                step = model(input_ids=torch.tensor([[next_token]]), cache=out.past_key_values, use_cache=True,
                             attention_mask=torch.ones(1, ids.numel() + 1, dtype=torch.long)).logits[0, -1]
                torch.testing.assert_close(step, ref_step, atol=1e-5, rtol=0)
        finally:
            vlm_prune.unwrap(model)

def test_visionzip_positions_keep_leaves_the_gaps():
    """positions="keep" (and the slots variant's default): the rows keep their original ids, so the
    logits differ from the official sequence; batched and alone agree under both."""
    import tiny_models as T
    from vlm_prune.methods.visionzip import VisionZip

    model, inp = T.tiny_llava(), T.llava_inputs()
    assert VisionZip().renumber_positions and not VisionZip(variant="slots").renumber_positions
    assert not VisionZip(positions="keep").renumber_positions
    assert VisionZip(variant="slots", positions="renumber").renumber_positions
    outs = {}
    for positions in ("renumber", "keep"):
        vlm_prune.wrap(model, VisionZip(positions=positions), budget=8)
        with torch.no_grad():
            batched = model(**inp).logits
            for b in range(2):
                valid = inp["attention_mask"][b].bool()
                alone = model(input_ids=inp["input_ids"][b:b + 1, valid], pixel_values=inp["pixel_values"][b:b + 1]).logits
                torch.testing.assert_close(batched[b, -alone.shape[1]:], alone[0], atol=1e-5, rtol=0)
        outs[positions] = batched
        vlm_prune.unwrap(model)
    assert not torch.allclose(outs["renumber"][:, -1], outs["keep"][:, -1], atol=1e-4)
