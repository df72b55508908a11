"""ViT-stage methods (AS-ViT, ToMe) on tiny timm VisionTransformers built from config."""
from __future__ import annotations

import math

import pytest
import torch

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

import vlm_prune  # noqa: E402
from vlm_prune.adapters.timm_vit import TimmBlockOps  # noqa: E402
from vlm_prune.methods.asvit import ASViT, asvit_scores, calibrate, cls_attention, default_locations  # noqa: E402
from vlm_prune.methods.tome import ToMe, merge_tokens  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes run fastest single-threaded, and the test machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_vit(depth: int = 12, seed: int = 0, patch: int = 8, **kw) -> VisionTransformer:
    torch.manual_seed(seed)
    m = VisionTransformer(img_size=32, patch_size=patch, embed_dim=64, depth=depth, num_heads=4, num_classes=10, **kw)
    # a sharper CLS attention than the init gives, so scores differ across tokens
    with torch.no_grad():
        m.pos_embed.normal_(0, 1.0)
        if m.cls_token is not None:
            m.cls_token.normal_(0, 1.0)
    return m.eval()


def images(b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def block_inputs(model: VisionTransformer) -> list[int]:
    """Record the token count entering each block during the next forward."""
    seen: list[int] = []
    for blk in model.blocks:
        blk.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    return seen


def embed(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    return model.norm_pre(model._pos_embed(model.patch_embed(x)))


def head(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.norm(x))


def reference_attention(blk, x: torch.Tensor, log_sizes: torch.Tensor | None = None):
    """Eager attention of a timm block: (residual update, probs [B,H,N,N], heads [B,H,N,d], k)."""
    attn = blk.attn
    h = blk.norm1(x)
    b, n, _ = h.shape
    q, k, v = attn.qkv(h).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-1, -2) * attn.scale
    if log_sizes is not None:
        logits = logits + log_sizes[:, None, None, :]
    probs = logits.softmax(-1)
    heads = probs @ v
    out = attn.proj(heads.transpose(1, 2).reshape(b, n, -1))
    return out, probs, heads, k


# ---- the block mirror ------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_block_ops_reproduce_the_block_bit_identically(fused: bool):
    m = tiny_vit(depth=2, init_values=0.1, qk_norm=True)
    blk = m.blocks[1]
    blk.attn.fused_attn = fused
    x = torch.randn(2, 65, 64)
    ops = TimmBlockOps(blk, 1, 2, blk.forward)
    a = ops.attention(x)
    y = x + a.out
    assert torch.equal(y + ops.mlp(y), blk(x))


# ---- identity and unwrap -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "method",
    [lambda: ASViT(keep=1.0), lambda: ASViT(budget=16), lambda: ToMe(r=0), lambda: ToMe(keep=1.0)],
)
def test_keep_everything_is_bit_identical(method):
    m = tiny_vit()
    x = images(3)
    ref = m(x)
    vlm_prune.wrap(m, method())
    assert torch.equal(m(x), ref)
    assert m.vlm_prune.last_stats["vit"] == {"tokens_per_block": [17] * 12, "flops_ratio": 1.0, "patches_out": 16}


@pytest.mark.parametrize("method", [lambda: ASViT(keep=0.6), lambda: ToMe(r=5), lambda: ASViT(mode="threshold", thresholds=(0.06,) * 3)])
def test_unwrap_restores_bit_identical_outputs(method):
    m = tiny_vit()
    other = tiny_vit()
    x = images(2)
    ref = m(x)
    vlm_prune.wrap(m, method())
    assert not torch.allclose(m(x), ref)
    assert torch.equal(other(x), ref)  # another instance is untouched
    vlm_prune.unwrap(m)
    assert torch.equal(m(x), ref)
    assert all("forward" not in vars(blk) for blk in m.blocks)


def test_clear_errors():
    with pytest.raises(ValueError, match="no CLS token"):
        vlm_prune.wrap(tiny_vit(class_token=False, global_pool="avg"), "asvit", keep=0.5)
    with pytest.raises(ValueError, match="'llm' stage"):
        vlm_prune.wrap(tiny_vit(), "fastv", keep=0.5)
    with pytest.raises(ValueError, match="missing budget"):
        vlm_prune.wrap(tiny_vit(), "asvit")
    with pytest.raises(ValueError, match="calibrate"):
        vlm_prune.wrap(tiny_vit(), ASViT(mode="threshold"), keep=0.5)
    with pytest.raises(ValueError, match="not both"):
        vlm_prune.wrap(tiny_vit(), ToMe(r=2), keep=0.5)
    with pytest.raises(ValueError, match="locations"):
        vlm_prune.wrap(tiny_vit(depth=6), ASViT(keep=0.5, locations=(2, 6)))


# ---- AS-ViT ---------------------------------------------------------------------------------
def test_default_locations():
    # the official pruning_loc of DeiT (12 blocks), LV-ViT-S (16) and LV-ViT-M (20)
    assert default_locations(12) == [4, 7, 10]
    assert default_locations(16) == [5, 9, 13]
    assert default_locations(20) == [6, 11, 16]
    assert default_locations(6) == [2, 3, 5]
    assert default_locations(2) == [1]


def test_scores_match_direct_computation():
    m = tiny_vit(depth=3)
    x = embed(m, images(2))
    blk = m.blocks[0]
    _, probs, heads, _ = reference_attention(blk, x)
    norms = heads.norm(dim=-1)  # [B, H, N]
    expected = torch.zeros(2, x.shape[1])
    for j in range(x.shape[1]):
        for h in range(4):
            expected[:, j] += probs[:, h, 0, j] * norms[:, h, j] / norms[:, :, j].sum(1)
    a = TimmBlockOps(blk, 0, 3, blk.forward).attention(x)
    got = asvit_scores(cls_attention(a.q[:, :, 0], a.k, blk.attn.scale), a.heads)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def asvit_reference(m: VisionTransformer, x: torch.Tensor, keep_counts, locations) -> torch.Tensor:
    """Blocks run one by one; before each location the top-k tokens by the previous block's
    eager-attention score are kept (CLS first, original order)."""
    h = embed(m, x)
    for i, blk in enumerate(m.blocks):
        if i + 1 in locations:
            out, probs, heads, _ = reference_attention(blk, h)
            h = h + out
            h = h + blk.mlp(blk.norm2(h))
            norms = heads.norm(dim=-1)
            s = (probs[:, :, 0] * norms / norms.sum(1, keepdim=True)).sum(1)[:, 1:]
            k = keep_counts[locations.index(i + 1)]
            idx = s.topk(k, dim=1).indices.sort(1).values + 1
            idx = torch.cat([torch.zeros(x.shape[0], 1, dtype=torch.long), idx], 1)
            h = torch.stack([h[b, idx[b]] for b in range(x.shape[0])])
        else:
            h = blk(h)
    return head(m, h)


@pytest.mark.parametrize("depth", [12, 6])
def test_keep_mode_follows_schedule_and_reference(depth: int):
    m = tiny_vit(depth=depth)
    x = images(3)
    vlm_prune.wrap(m, "asvit", keep=0.7)
    seen = block_inputs(m)
    out = m(x)
    locs = default_locations(depth)
    # keep is the final count (floor(0.7 * 16) = 11); stages follow 16 * (11/16)**(s/S)
    n = len(locs)
    counts = [math.floor(16 * (11 / 16) ** (s / n) + 1e-6) for s in range(1, n)] + [11]
    expected = [1 + 16] * (locs[0])
    for s, loc in enumerate(locs):
        nxt = locs[s + 1] if s + 1 < len(locs) else depth
        expected += [1 + counts[s]] * (nxt - loc)
    assert seen == expected
    assert m.vlm_prune.last_stats["vit"]["tokens_per_block"] == expected
    torch.testing.assert_close(out, asvit_reference(m, x, counts, locs), atol=1e-5, rtol=1e-5)


def test_budget_is_tokens_left_after_last_stage():
    m = tiny_vit()
    vlm_prune.wrap(m, "asvit", budget=8)
    m(images(1))
    assert m.vlm_prune.last_stats["vit"]["tokens_per_block"][-1] == 1 + 8


def test_batch_consistency_keep_mode():
    m = tiny_vit()
    x = images(3)
    vlm_prune.wrap(m, "asvit", keep=0.6)
    batch = m(x)
    alone = torch.cat([m(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)


def stage1_scores(m: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """AS-ViT scores of the patch tokens from block 3 (the first pruning point is block 4)."""
    h = embed(m, x)
    for blk in m.blocks[:3]:
        h = blk(h)
    _, probs, heads, _ = reference_attention(m.blocks[3], h)
    norms = heads.norm(dim=-1)
    return (probs[:, :, 0] * norms / norms.sum(1, keepdim=True)).sum(1)[:, 1:]


def test_threshold_mode_keeps_tokens_above_threshold_per_image():
    m = tiny_vit()
    x = images(2)
    s = stage1_scores(m, x)
    theta = float(s.detach()[0].quantile(0.3))  # image 0 keeps 11, image 1 keeps 9
    counts = (s > theta).sum(1)
    assert counts[0] != counts[1]  # the two images keep different numbers alone
    vlm_prune.wrap(m, ASViT(mode="threshold", thresholds=(theta, 1.0, 1.0)))
    for i in range(2):
        seen = block_inputs(m) if i == 0 else seen
        seen.clear()
        m(x[i : i + 1])
        assert seen[4] == 1 + int(counts[i])
        assert seen[7] == 1  # threshold 1.0 keeps only the CLS token
    seen.clear()
    m(x)  # batch of 2: each image keeps floor(total / B) tokens
    assert seen[4] == 1 + int(counts.sum()) // 2


def test_threshold_mode_single_image_equals_reference():
    m = tiny_vit()
    x = images(1)
    s = stage1_scores(m, x)
    theta = float(s.detach().quantile(0.3))
    k = int((s > theta).sum())
    vlm_prune.wrap(m, ASViT(mode="threshold", thresholds=(theta, 0.0, 0.0)))  # stages 2, 3 keep all
    torch.testing.assert_close(m(x), asvit_reference(m, x, [k, k, k], [4, 7, 10]), atol=1e-5, rtol=1e-5)


def test_calibrate_moves_flops_ratio_toward_target():
    m = tiny_vit(seed=3)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(3)]
    s = stage1_scores(m, loader[0][0])
    theta = float(s.detach().quantile(0.1))
    method = ASViT(mode="threshold", thresholds=(theta, theta, theta))
    vlm_prune.wrap(m, method)
    x_eval = torch.cat([b[0] for b in loader])
    m(x_eval)
    before = m.vlm_prune.last_stats["vit"]["flops_ratio"]
    weights = [p.clone() for p in m.parameters()]
    thresholds = calibrate(m, loader, target=0.5, steps=25, progress=False)
    assert m.vlm_prune.methods["vit"].thresholds == tuple(thresholds) and thresholds[0] > theta
    assert method.thresholds == (theta, theta, theta)  # the configured object is never changed
    assert all(torch.equal(p, w) for p, w in zip(m.parameters(), weights))  # only thresholds train
    m(x_eval)
    after = m.vlm_prune.last_stats["vit"]["flops_ratio"]
    assert abs(after - 0.5) < abs(before - 0.5) - 0.05, (before, after)


def test_calibrate_needs_threshold_mode():
    m = tiny_vit(depth=3)
    vlm_prune.wrap(m, "asvit", keep=0.5)
    with pytest.raises(ValueError, match="threshold mode"):
        calibrate(m, [(images(2), torch.zeros(2, dtype=torch.long))], steps=1)


# ---- ToMe ----------------------------------------------------------------------------------
def reference_merge(x: torch.Tensor, sizes: torch.Tensor, metric: torch.Tensor, r: int, protected: int = 0):
    """One image, loops: bipartite soft matching (A = even, B = odd rows of the whole sequence;
    the first ``protected`` rows neither merge nor receive), r best A merged; output: protected
    rows, unmerged A rows, B rows (the official order)."""
    if r == 0:
        return x, sizes
    m = (metric / metric.norm(dim=-1, keepdim=True)).detach()
    a_rows, b_rows = list(range(0, len(x), 2)), list(range(1, len(x), 2))
    free_b = [j for j in b_rows if j >= protected]
    best = []
    for i in a_rows:
        if i < protected:
            continue
        sims = [float(m[i] @ m[j]) for j in free_b]
        best.append((max(sims), -i, free_b[sims.index(max(sims))]))
    merged = sorted(best, reverse=True)[:r]
    into = {j: [j] for j in b_rows}
    for _, i, j in merged:
        into[j].append(-i)
    merged_a = {-i for _, i, _ in merged}
    groups = [[i] for i in range(protected)]
    groups += [[i] for i in a_rows if i >= protected and i not in merged_a] + [into[j] for j in b_rows if j >= protected]
    new_x = torch.stack([sum(x[i] * sizes[i] for i in g) / sum(sizes[i] for i in g) for g in groups])
    new_s = torch.stack([sum(sizes[i] for i in g) for g in groups])
    return new_x, new_s


def test_merge_tokens_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    x, metric = torch.randn(2, 11, 5, generator=gen), torch.randn(2, 11, 7, generator=gen)
    sizes = torch.randint(1, 4, (2, 11), generator=gen).float()
    got_x, got_s = merge_tokens(x, sizes, metric, r=4)
    for b in range(2):
        ref_x, ref_s = reference_merge(x[b], sizes[b], metric[b], 4)
        torch.testing.assert_close(got_x[b], ref_x)
        torch.testing.assert_close(got_s[b], ref_s)
    torch.testing.assert_close((got_x * got_s[..., None]).sum(1), (x * sizes[..., None]).sum(1))


def test_proportional_attention_matches_direct_computation():
    m = tiny_vit(depth=2)
    blk = m.blocks[0]
    x = torch.randn(2, 17, 64)
    sizes = torch.randint(1, 5, (2, 17)).float()
    ops = TimmBlockOps(blk, 0, 2, blk.forward)
    assert blk.attn.fused_attn  # the bias rides on scaled_dot_product_attention
    got = ops.attention(x, bias=sizes.log()[:, None, None, :]).out
    ref, _, _, _ = reference_attention(blk, x, sizes.log())
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def tome_reference(m: VisionTransformer, x: torch.Tensor, r: int) -> torch.Tensor:
    """The official ToMe forward, block by block: the alternating split runs over the whole
    sequence with the CLS token protected, r capped at (tokens - 1) // 2."""
    h = embed(m, x)
    sizes = torch.ones(h.shape[:2])
    for blk in m.blocks:
        out, _, _, k = reference_attention(blk, h, sizes.log())
        h = h + out
        metric = k.mean(1)
        rr = min(r, (h.shape[1] - 1) // 2)
        rows = [reference_merge(h[b], sizes[b], metric[b], rr, protected=1) for b in range(h.shape[0])]
        h = torch.stack([t[0] for t in rows])
        sizes = torch.stack([t[1] for t in rows])
        h = h + blk.mlp(blk.norm2(h))
    return head(m, h)


def test_tome_matches_reference_and_counts():
    m = tiny_vit(depth=6)
    x = images(2)
    vlm_prune.wrap(m, "tome", budget=4)  # 12 merges over 6 blocks: 2 each
    seen = block_inputs(m)
    out = m(x)
    assert seen == [17, 15, 13, 11, 9, 7]
    vlm_prune.unwrap(m)
    vlm_prune.wrap(m, ToMe(r=6))
    torch.testing.assert_close(m(x), tome_reference(m, x, 6), atol=1e-5, rtol=1e-5)
    assert out.shape == (2, 10)


def test_tome_merges_at_most_half_and_protects_cls():
    m = tiny_vit(depth=12)  # 16 patches
    vlm_prune.wrap(m, ToMe(r=6))
    seen = block_inputs(m)
    x = images(2)
    m(x)
    assert seen == [17, 11, 6, 4, 3, 2, 2, 2, 2, 2, 2, 2]
    assert torch.equal(m.vlm_prune.adapter.run.sizes[:, 0], torch.ones(2))
    assert torch.equal(m.vlm_prune.adapter.run.sizes.sum(1), torch.full((2,), 17.0))
