"""Algorithm unit tests of PACT / DBDPC, AdaptInfer, VisionZip, DivPrune and CDPruner.

Small hand-checkable inputs, brute-force references, and explicit eager attention of a tiny
``LlamaDecoderLayer`` for the LLM-stage scores. No model is wrapped here (see the e2e tests).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from vlm_prune.engine import LMSpec, PrunedDecoder
from vlm_prune.methods import LayerContext, VisionContext
from vlm_prune.methods.adaptinfer import SCHEDULES, AdaptInfer, derive_counts, final_counts
from vlm_prune.methods.cdpruner import (
    CDPruner,
    conditional_kernel,
    dpp_greedy_map,
    relevance,
)
from vlm_prune.methods.dbdpc import dbdpc
from vlm_prune.methods.divprune import DivPrune, max_min_diverse
from vlm_prune.methods.pact import PACT
from vlm_prune.methods.visionzip import VisionZip, split_budget
from vlm_prune.registry import available_methods, method_class

# ---------------------------------------------------------------------------------------------
# helpers: a tiny decoder layer and a LayerContext built by hand
# ---------------------------------------------------------------------------------------------


def tiny_layer(seed: int = 0) -> tuple[LlamaDecoderLayer, LlamaRotaryEmbedding]:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=16,
    )
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    for p in layer.parameters():  # non-trivial norms
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return layer, LlamaRotaryEmbedding(cfg)


def make_project_qk(layer: LlamaDecoderLayer, rotary: LlamaRotaryEmbedding):
    """The engine's projector of this layer (input_layernorm, q / k projections, optional
    RoPE, GQA repeated), as the methods get it inside a wrapped model."""
    lm = torch.nn.Module()
    lm.rotary_emb = rotary
    spec = LMSpec(lm=lm, layers=torch.nn.ModuleList([layer]), family="llava", apply_rope=apply_rotary_pos_emb)
    return PrunedDecoder(spec, state=None, attn_impl=lambda: "eager").project_qk(0)


def padded_batch(lengths: list[int], n_sys: int, n_vis: int, seed: int = 0):
    """Rows [system | visual | text], left-padded to the longest sample. Returns
    (hidden, valid, visual, text, positions, pads)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    b = len(lengths)
    hidden = torch.randn(b, s, 32, generator=g) * 2
    valid = torch.zeros(b, s, dtype=torch.bool)
    visual = torch.zeros(b, s, dtype=torch.bool)
    text = torch.zeros(b, s, dtype=torch.bool)
    positions = torch.zeros(b, s, dtype=torch.long)
    pads = []
    for i, n in enumerate(lengths):
        pad = s - n
        pads.append(pad)
        valid[i, pad:] = True
        visual[i, pad + n_sys : pad + n_sys + n_vis] = True
        text[i, pad + n_sys + n_vis :] = True
        positions[i, pad:] = torch.arange(n)
    return hidden, valid, visual, text, positions, pads


def layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep, family=None) -> LayerContext:
    return LayerContext(
        layer=0, hidden=hidden, valid=valid, visual=visual, text=text, positions=positions,
        sizes=torch.ones(hidden.shape[:2]), n_keep=torch.as_tensor(n_keep, dtype=torch.long),
        layer_module=layer, project_qk=make_project_qk(layer, rotary), extras={"family": family},
    )


# ---------------------------------------------------------------------------------------------
# DBDPC
# ---------------------------------------------------------------------------------------------


def reference_dbdpc(x: torch.Tensor, d_c: float, min_new: int = 10) -> list[int]:
    """The spec's DBDPC centre loop, written out point by point (float64)."""
    n = x.shape[0]
    xn = F.normalize(x.double(), dim=1)
    d = (1 - xn @ xn.T).clamp(min=0)
    rho = torch.exp(-((d / 2) ** 2)).sum(1)
    # rank: higher density higher rank; equal densities -> lower index ranks higher
    order = sorted(range(n), key=lambda i: (float(rho[i]), -i))
    rank = {i: r for r, i in enumerate(order)}
    unassigned = set(range(n))
    centres: list[int] = []
    while unassigned:
        new = []
        for i in sorted(unassigned):
            denser = [float(d[i, j]) for j in unassigned if rank[j] > rank[i]]
            if (min(denser) if denser else math.inf) > d_c:
                new.append(i)
        centres += new
        unassigned -= {i for i in unassigned if any(float(d[i, c]) <= d_c for c in new)} | set(new)
        if len(new) < min_new:
            for i in sorted(unassigned, key=lambda i: -rank[i]):
                if all(float(d[i, c]) > d_c for c in centres):
                    centres.append(i)
            break
    return centres


def test_dbdpc_recovers_known_clusters_and_reattaches_within_1_5_dc():
    g = torch.Generator().manual_seed(0)
    base = torch.eye(8)[:3]  # three orthogonal directions: clusters 1 - cos apart = 1
    members = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    pts = base[members] + 1e-3 * torch.randn(len(members), 8, generator=g)
    # extra points: 1 - cos = 0.12 from direction 0 (within 1.5 * 0.1), and one far from all
    near = 0.88 * torch.eye(8)[0] + math.sqrt(1 - 0.88**2) * torch.eye(8)[5]
    far = torch.eye(8)[6]
    cl = dbdpc(pts, 0.1, extra=torch.stack([near, far]))
    assert cl.centres.numel() == 3
    got = cl.labels.tolist()
    # same partition as `members`
    assert all((got[i] == got[j]) == (members[i] == members[j]) for i in range(12) for j in range(12))
    assert [members[int(c)] for c in cl.centres].count(0) == 1
    assert cl.extra_labels.tolist() == [got[0], -1]
    # with a tighter cutoff the near extra point is beyond 1.5 d_c
    assert dbdpc(pts, 0.07, extra=near[None]).extra_labels.tolist() == [-1]


@pytest.mark.parametrize("d_c", [0.02, 0.15, 0.4, 0.9])
def test_dbdpc_matches_pointwise_reference(d_c):
    x = torch.randn(70, 5, generator=torch.Generator().manual_seed(3))
    cl = dbdpc(x, d_c)
    assert cl.centres.tolist() == reference_dbdpc(x, d_c)
    xn = F.normalize(x, dim=1)
    d = (1 - xn @ xn[cl.centres].T).clamp(min=0)
    assert torch.equal(cl.labels, d.argmin(1)) or torch.allclose(d.gather(1, cl.labels[:, None]), d.min(1, keepdim=True).values)
    assert bool((d.gather(1, cl.labels[:, None]) <= d_c + 1e-6).all())  # every point within d_c of its centre
    # centres are pairwise farther than d_c
    dc = d[cl.centres]
    off = dc[~torch.eye(len(cl.centres), dtype=torch.bool)]
    assert bool((off > d_c - 1e-6).all())


def test_dbdpc_iterative_rounds_match_reference_with_many_centres():
    """A small cutoff on many spread points makes the first rounds find >= 10 centres."""
    x = torch.randn(150, 3, generator=torch.Generator().manual_seed(5))
    assert dbdpc(x, 0.05).centres.tolist() == reference_dbdpc(x, 0.05)


# ---------------------------------------------------------------------------------------------
# PACT
# ---------------------------------------------------------------------------------------------


def test_pact_euti_equals_direct_formula():
    layer, rotary = tiny_layer()
    hidden, valid, visual, text, positions, pads = padded_batch([12, 10], n_sys=2, n_vis=6)
    ctx = layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep=[3, 3])
    scores = PACT().scores(ctx)
    attn = layer.self_attn
    with torch.no_grad():
        for b, pad in enumerate(pads):
            last = pad + 2 + 6 - 1  # last visual row
            rows = list(range(pad, last + 1))
            x = layer.input_layernorm(hidden[b, rows])
            q = attn.q_proj(x).view(len(rows), 4, 8)
            k = attn.k_proj(x).view(len(rows), 2, 8)
            for j, row in enumerate(rows):
                s = 0.0
                for h in range(4):
                    qbar = q[:, h].mean(0)
                    kh = k[:, h // 2]  # GQA: query head h reads key head h // 2
                    logits = [float(qbar @ kh[i]) / math.sqrt(8) for i in range(len(rows))]
                    s += math.exp(logits[j]) / sum(math.exp(v) for v in logits) / 4
                expected = s * float(hidden[b, row].norm())
                assert float(scores[b, row]) == pytest.approx(expected, rel=1e-4, abs=1e-7)
            assert float(scores[b, last + 1 :].abs().sum()) == 0.0


def test_pact_without_merging_is_euti_topk():
    """cutoff 0: every kept token is its own cluster, pruned tokens are dropped."""
    layer, rotary = tiny_layer()
    hidden, valid, visual, text, positions, _ = padded_batch([20, 17], n_sys=2, n_vis=12)
    for _ in range(1):
        method = PACT(cutoff=0.0)
        ctx = layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep=[0] * 2, family="qwen2_vl")
        reds = method.select(ctx)
        scores = method.scores(ctx)
        expect_k = math.floor(0.8 * 12)  # qwen2_vl rho = 0.8
        for b, red in enumerate(reds):
            vis = torch.nonzero(visual[b]).squeeze(1)
            top = vis[torch.topk(scores[b, vis], expect_k).indices]
            other = torch.nonzero(valid[b] & ~visual[b]).squeeze(1)
            assert red.indices.tolist() == sorted(other.tolist() + top.tolist())
            assert torch.allclose(red.features, hidden[b, red.indices])
            assert red.sizes.tolist() == [1.0] * len(red.indices)


def test_pact_merges_clusters_with_reattached_pruned_tokens():
    """Designed keys: visual rows 2..4 and 5..7 form two tight clusters; EUTI prunes row 4
    (lowest score), which rejoins its cluster: two merged rows of size 3 remain."""
    s, n_heads, d = 10, 2, 4
    hidden = torch.randn(1, s, 6, generator=torch.Generator().manual_seed(0))
    visual = torch.zeros(1, s, dtype=torch.bool)
    visual[0, 2:8] = True
    valid = torch.ones(1, s, dtype=torch.bool)
    text = ~visual & (torch.arange(s) >= 8)
    q_plain = torch.zeros(1, n_heads, s, d)
    k_plain = torch.zeros(1, n_heads, s, d)
    k_plain[0, :, 4, 0] = -5.0  # row 4 gets the lowest EUTI attention
    q_plain[0, :, :, 0] = 1.0
    dirs = torch.zeros(s, n_heads * d)
    dirs[2:5, 0] = 1.0
    dirs[5:8, 1] = 1.0
    dirs[2:8] += 1e-3 * torch.randn(6, n_heads * d, generator=torch.Generator().manual_seed(1))
    k_rope = dirs.view(s, n_heads, d).permute(1, 0, 2)[None]

    class Attn(torch.nn.Module):
        num_key_value_groups = 1

    class Layer(torch.nn.Module):
        self_attn = Attn()

    def project(h, pos, rope=True, q_rows=None):
        assert rope == "keys" and q_rows is None  # PACT projects once, keys with and without RoPE
        n = h.shape[1]
        return q_plain[:, :, :n], k_plain[:, :, :n], k_rope[:, :, :n]

    ctx = LayerContext(
        layer=4, hidden=hidden, valid=valid, visual=visual, text=text, positions=torch.arange(s)[None],
        sizes=torch.ones(1, s), n_keep=torch.tensor([5]), layer_module=Layer(), project_qk=project,
        extras={"family": "llava_onevision"},
    )
    (red,) = PACT(rho=5 / 6, cutoff=0.1).select(ctx)
    centres = [i for i in red.indices.tolist() if visual[0, i]]
    assert len(centres) == 2 and centres[0] in (2, 3) and centres[1] in (5, 6, 7)
    assert red.indices.tolist() == [0, 1, centres[0], centres[1], 8, 9]
    assert red.sizes.tolist() == [1, 1, 3, 3, 1, 1]
    assert torch.allclose(red.features[2], hidden[0, 2:5].mean(0), atol=1e-6)
    assert torch.allclose(red.features[3], hidden[0, 5:8].mean(0), atol=1e-6)
    assert torch.equal(red.features[[0, 1, 4, 5]], hidden[0, [0, 1, 8, 9]])


def test_pact_batch_rows_equal_single_sample_rows():
    layer, rotary = tiny_layer()
    hidden, valid, visual, text, positions, pads = padded_batch([30, 24], n_sys=2, n_vis=20)
    method = PACT(cutoff=0.3)
    reds = method.select(layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep=[0, 0]))
    for b, pad in enumerate(pads):
        sl = slice(pad, None)
        alone = method.select(layer_ctx(hidden[b : b + 1, sl], valid[b : b + 1, sl], visual[b : b + 1, sl],
                                        text[b : b + 1, sl], positions[b : b + 1, sl], layer, rotary, n_keep=[0]))[0]
        assert (reds[b].indices - pad).tolist() == alone.indices.tolist()
        assert torch.allclose(reds[b].features, alone.features, atol=1e-5)
        assert torch.equal(reds[b].sizes, alone.sizes)
        assert int(reds[b].sizes.sum()) <= int(valid[b].sum())
    assert PACT().prune_layers(28) == [4]
    with pytest.raises(ValueError, match="only 3 decoder layers"):
        PACT().prune_layers(3)


# ---------------------------------------------------------------------------------------------
# AdaptInfer
# ---------------------------------------------------------------------------------------------


def test_adaptinfer_scores_equal_explicit_eager_attention():
    layer, rotary = tiny_layer(seed=1)
    n_sys, n_vis = 2, 7
    hidden, valid, visual, text, positions, pads = padded_batch([14, 11], n_sys=n_sys, n_vis=n_vis, seed=2)
    ctx = layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep=[3, 3])
    scores = AdaptInfer(keep=0.5).scores(ctx)
    for b, pad in enumerate(pads):
        h = hidden[b : b + 1, pad:]
        n = h.shape[1]
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            _, weights = layer.self_attn(layer.input_layernorm(h), position_embeddings=rotary(h, pos), attention_mask=causal)
        a = weights[0]  # [H, n, n] eager softmax probabilities
        t = torch.arange(n_sys + n_vis, n)
        a_tt = a[:, t][:, :, t]
        sym = a_tt + a_tt.transpose(-1, -2) - torch.diag_embed(torch.diagonal(a_tt, dim1=-2, dim2=-1))
        text_imp = sym.sum(1)  # [H, T]
        expected = (text_imp[:, :, None] * a[:, t, :]).sum((0, 1))  # [n]
        v = torch.arange(n_sys, n_sys + n_vis)
        assert torch.allclose(scores[b, pad + v], expected[v], rtol=1e-4, atol=1e-6)


def test_adaptinfer_select_keeps_text_and_n_keep_best_visual():
    layer, rotary = tiny_layer(seed=1)
    hidden, valid, visual, text, positions, _ = padded_batch([14, 11], n_sys=2, n_vis=7, seed=2)
    ctx = layer_ctx(hidden, valid, visual, text, positions, layer, rotary, n_keep=[3, 5])
    method = AdaptInfer(keep=0.5)
    scores = method.scores(ctx)
    for b, red in enumerate(method.select(ctx)):
        vis = torch.nonzero(visual[b]).squeeze(1)
        kept_vis = [i for i in red.indices.tolist() if visual[b, i]]
        assert len(kept_vis) == [3, 5][b]
        assert sorted(kept_vis) == sorted(vis[torch.topk(scores[b, vis], [3, 5][b]).indices].tolist())
        assert set(torch.nonzero(valid[b] & ~visual[b]).squeeze(1).tolist()) <= set(red.indices.tolist())


class _Adapter:
    """What AdaptInfer.check_model reads of an adapter: family, LM shape, whether positions are M-RoPE."""

    def __init__(self, family, layers, hidden):
        from transformers import LlamaConfig

        self.family = family
        self.multi_axis_positions = family == "qwen2_vl"
        self.model = type("M", (), {"config": LlamaConfig(num_hidden_layers=layers, hidden_size=hidden)})()


def _configured(adapter, keep=None, budget=None, **kw):
    m = AdaptInfer(**kw)
    m.configure_budget(keep, budget)
    m.check_model(adapter)
    return m


def test_adaptinfer_published_schedules():
    """A model of a published shape gets the published layers, and with the paper's average= the
    published counts (LLaVA-1.5-7B, 64: 133, 27, 3; scaled for two images) or ratios (Qwen2-VL-2B)."""
    m = _configured(_Adapter("llava", 32, 4096), average=64)
    assert m.prune_layers(32) == [2, 11, 21]
    assert [m.n_keep_at(2, 576, 576), m.n_keep_at(11, 576, 133), m.n_keep_at(21, 576, 27)] == [133, 27, 3]
    assert m.n_keep_at(2, 1152, 1152, 2) == 266  # two images' worth of tokens: counts scale
    assert m.positions == "renumber"  # the official LLaVA code renumbers positions
    m13 = _configured(_Adapter("llava", 40, 5120), average=128)
    m13.prune_layers(40)
    assert [m13.n_keep_at(a, 576, 576) for a in (2, 11, 21)] == [300, 94, 30]
    q = _configured(_Adapter("qwen2_vl", 28, 1536))  # no target: the official default ratios
    assert q.prune_layers(28) == [1, 10, 20] and q.positions == "keep"
    assert [q.n_keep_at(1, 1000, 1000), q.n_keep_at(10, 1000, 170), q.n_keep_at(20, 1000, 102)] == [170, 102, 30]
    q30 = _configured(_Adapter("qwen2_vl", 28, 1536), average=0.3)
    q30.prune_layers(28)
    assert q30.n_keep_at(1, 1000, 1000) == 500
    # keep / budget on a published shape: published layers, counts ending at the target
    f = _configured(_Adapter("llava", 32, 4096), budget=64)
    assert f.prune_layers(32) == [2, 11, 21]
    assert [f.n_keep_at(a, 576, 576) for a in (2, 11, 21)] == [277, 133, 64]
    # a forced published schedule needs a published average
    with pytest.raises(ValueError, match="128, 64, 48, 32"):
        _configured(_Adapter("llava", 6, 64), schedule="llava-1.5-7b", average=100)
    with pytest.raises(ValueError, match="only 12 decoder layers"):
        m.prune_layers(12)
    with pytest.raises(ValueError, match="needs a target"):
        _configured(_Adapter("llava", 6, 64))
    with pytest.raises(ValueError, match="not both"):
        _configured(_Adapter("llava", 6, 64), keep=0.5, average=16)
    with pytest.raises(ValueError, match="M-RoPE"):
        _configured(_Adapter("qwen2_vl", 6, 64), keep=0.5, positions="renumber")


def test_adaptinfer_final_counts_end_at_the_target():
    assert final_counts(576, 64, 3) == [277, 133, 64]
    assert final_counts(64, 64, 3) == [64, 64, 64]  # keep=1.0 prunes nothing
    assert final_counts(16, 1, 3) == [6, 3, 1]
    for n, t in [(576, 3), (100, 7), (17, 16)]:
        counts = final_counts(n, t, 3)
        assert counts[-1] == t and counts == sorted(counts, reverse=True) and counts[0] <= n


def test_adaptinfer_derived_schedule_reproduces_paper_accounting():
    assert derive_counts(576, 128, [1, 10, 20], 32, (0.25, 0.25)) == [287, 72, 18]
    assert derive_counts(64, 64, [0, 2, 4], 6, (0.25, 0.25)) == [64, 64, 64]  # keep=1.0 prunes nothing
    assert derive_counts(64, 48, [0, 2, 4], 6, (0.25, 0.25)) == [64, 16, 4]  # k1 clamped: average below target
    # the paper's accounting of its own published schedules: depth average ~ target
    for target, counts in SCHEDULES["llava-1.5-7b"].counts.items():
        avg = (1 * 576 + 9 * counts[0] + 10 * counts[1] + 12 * counts[2]) / 32
        assert target <= avg < target + 2
    m = _configured(_Adapter("llava", 12, 64), average=0.25)
    after = [a - 1 for a in m.prune_layers(12)]
    assert after == [0, 4, 8]
    n = 400
    ks = [m.n_keep_at(a + 1, n, n) for a in after]
    avg = (after[0] * n + (after[1] - after[0]) * ks[0] + (after[2] - after[1]) * ks[1] + (12 - after[2]) * ks[2]) / 12
    assert avg == pytest.approx(0.25 * n, abs=1.0)
    assert ks[0] >= ks[1] >= ks[2]


# ---------------------------------------------------------------------------------------------
# VisionZip
# ---------------------------------------------------------------------------------------------


def test_visionzip_dominant_and_contextual_by_hand():
    n = 10
    feats = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    attention = torch.zeros(n)
    attention[7], attention[3] = 5.0, 4.0
    keys = torch.zeros(n, 2)
    keys[[0, 1, 2, 4], 0] = 1.0  # similar to target 0
    keys[[5, 6, 8, 9], 1] = 1.0  # similar to target 5
    keys[[3, 7]] = 1.0
    ctx = VisionContext(features=feats, n_keep=4, tower_attention=lambda: (attention, keys))
    red = VisionZip(dominant_ratio=0.5).reduce_image(ctx)
    # rest = [0, 1, 2, 4, 5, 6, 8, 9], step 8 // 2 = 4 -> targets rest[0] = 0 and rest[4] = 5
    assert red.indices.tolist() == [0, 3, 5, 7]
    assert torch.equal(red.features[1], feats[3]) and torch.equal(red.features[3], feats[7])
    assert torch.allclose(red.features[0], feats[0] + feats[[1, 2, 4]].mean(0))
    assert torch.allclose(red.features[2], feats[5] + feats[[6, 8, 9]].mean(0))


def test_visionzip_budget_split_and_errors():
    assert split_budget(64, 54 / 64) == (54, 10)
    assert split_budget(128, 54 / 64) == (108, 20)
    g = torch.Generator().manual_seed(0)
    feats, att, keys = torch.randn(100, 8, generator=g), torch.rand(100, generator=g), torch.randn(100, 4, generator=g)
    for k in (1, 7, 64, 99, 100):
        red = VisionZip().reduce_image(VisionContext(feats, k, tower_attention=lambda: (att, keys)))
        assert red.indices.numel() == k and bool((red.indices[1:] > red.indices[:-1]).all())
    with pytest.raises(ValueError, match="tower_attention"):
        VisionZip().reduce_image(VisionContext(feats, 10))


# ---------------------------------------------------------------------------------------------
# DivPrune
# ---------------------------------------------------------------------------------------------


def test_divprune_picks_spread_out_points():
    deg = [0, 1, 2, 90, 91, 200]
    pts = torch.tensor([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in deg])
    # first: 200 deg (farthest nearest neighbour); then the point farthest from it (2 deg);
    # then the one whose nearer chosen point is farthest (91 deg: 1 - cos 89 > 1 - cos 88)
    assert max_min_diverse(pts, 3).tolist() == [5, 2, 4]
    red = DivPrune().reduce_image(VisionContext(pts, 3))
    assert red.indices.tolist() == [2, 4, 5]
    assert max_min_diverse(pts, 6).sort().values.tolist() == list(range(6))


def test_divprune_honours_n_keep_with_duplicates():
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)).repeat(4, 1)  # 20 rows, 5 distinct
    for k in (1, 5, 12, 19):
        idx = DivPrune().reduce_image(VisionContext(x, k)).indices
        assert idx.numel() == k == len(set(idx.tolist()))
    # the first 5 picks cover the 5 distinct vectors
    assert {i % 5 for i in max_min_diverse(x, 5).tolist()} == set(range(5))


# ---------------------------------------------------------------------------------------------
# CDPruner
# ---------------------------------------------------------------------------------------------


def brute_force_greedy_logdet(kernel: torch.Tensor, k: int) -> list[int]:
    chosen: list[int] = []
    for _ in range(k):
        best, arg = -math.inf, -1
        for i in range(kernel.shape[0]):
            if i in chosen:
                continue
            s = chosen + [i]
            val = float(torch.logdet(kernel[s][:, s].double()))
            if val > best:
                best, arg = val, i
        chosen.append(arg)
    return chosen


def test_cdpruner_without_text_is_plain_dpp_greedy_map():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 16, generator=g)
    xn = F.normalize(feats, dim=1)
    expected = brute_force_greedy_logdet(xn @ xn.T, 5)
    assert dpp_greedy_map(conditional_kernel(feats, torch.ones(12)), 5).tolist() == expected
    red = CDPruner().reduce_image(VisionContext(feats, 5))  # no text_embeds: r = 1
    assert red.indices.tolist() == sorted(expected)


def test_cdpruner_conditional_kernel_and_relevance():
    g = torch.Generator().manual_seed(1)
    feats, text = torch.randn(10, 16, generator=g), torch.randn(3, 16, generator=g)
    r = relevance(feats, text)
    cos = F.normalize(feats, dim=1) @ F.normalize(text, dim=1).T
    neg = -cos.mean(1)
    assert torch.allclose(r, (neg - neg.min() + 1e-6) / (neg.max() - neg.min()))
    kernel = conditional_kernel(feats, r)
    assert torch.allclose(kernel, torch.diag(r) @ (F.normalize(feats, dim=1) @ F.normalize(feats, dim=1).T) @ torch.diag(r), atol=1e-6)
    assert dpp_greedy_map(kernel, 4).tolist() == brute_force_greedy_logdet(kernel, 4)
    red = CDPruner().reduce_image(VisionContext(feats, 4, text_embeds=text))
    assert red.indices.tolist() == sorted(brute_force_greedy_logdet(kernel, 4))
    # hand check: features e1, e2 and text e1 -> -cos = [-1, 0] -> r = [1e-6, 1 + 1e-6]
    e = torch.eye(2)
    assert torch.allclose(relevance(e, e[:1]), torch.tensor([1e-6, 1 + 1e-6]))


def test_cdpruner_rank_deficient_kernel_still_honours_n_keep():
    feats = torch.randn(8, 2, generator=torch.Generator().manual_seed(2))  # rank 2
    for k in (1, 2, 3, 7):
        idx = CDPruner().reduce_image(VisionContext(feats, k)).indices
        assert idx.numel() == k == len(set(idx.tolist()))


# ---------------------------------------------------------------------------------------------
# registry and documentation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pact", "adaptinfer", "visionzip", "divprune", "cdpruner",
                                  "fastervlm", "vispruner", "dart", "pdrop", "hired", "prumerge", "sparsevlm"])
def test_registered_with_paper_and_defaults_in_docstring(name):
    assert name in available_methods()
    cls = method_class(name)
    assert cls.paper and cls.__doc__ and "efault" in cls.__doc__


def test_vision_methods_honour_n_keep():
    g = torch.Generator().manual_seed(4)
    feats, text = torch.randn(50, 12, generator=g), torch.randn(4, 12, generator=g)
    att, keys = torch.rand(50, generator=g), torch.randn(50, 6, generator=g)
    for method, k in itertools.product([VisionZip(), DivPrune(), CDPruner()], (1, 10, 49, 50)):
        ctx = VisionContext(feats, k, text_embeds=text, tower_attention=lambda: (att, keys))
        red = method.reduce_image(ctx)
        assert red.indices.numel() == k, (method.name, k)
        assert red.features is None or red.features.shape == (k, 12)


# ---------------------------------------------------------------------------------------------
# Pool: exactly n_keep cells, each the mean of its rectangle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(8, 8), (4, 6), (2, 16), (7, 5)])
def test_pool_keeps_exactly_the_budget_each_token_the_mean_of_a_cell(rows, cols):
    """Every budget 1..rows*cols: exactly n_keep tokens, whose cells (a brute-force reference:
    row bands split evenly, adaptive pooling's windows) tile the grid, each pooled token the
    mean of its cell at the slot of the cell's centre."""
    from vlm_prune.methods.simple import Pool, pool_cells

    feats = torch.randn(rows * cols, 3, generator=torch.Generator().manual_seed(rows * cols))
    grid = feats.reshape(rows, cols, 3)
    for k in range(1, rows * cols):
        red = Pool().reduce_image(VisionContext(feats, k, grid=(rows, cols)))
        assert red.indices.numel() == k == red.features.shape[0]
        bands = pool_cells(rows, cols, k)
        assert max(bands) - min(bands) <= 1 and len(bands) <= rows
        covered, j = torch.zeros(rows, cols, dtype=torch.long), 0
        for i, cells in enumerate(bands):
            r0, r1 = math.floor(i * rows / len(bands)), math.ceil((i + 1) * rows / len(bands))
            for c in range(cells):
                c0, c1 = math.floor(c * cols / cells), math.ceil((c + 1) * cols / cells)
                covered[r0:r1, c0:c1] += 1
                torch.testing.assert_close(red.features[j], grid[r0:r1, c0:c1].mean((0, 1)), atol=1e-6, rtol=0)
                assert int(red.indices[j]) == ((r0 + r1 - 1) // 2) * cols + (c0 + c1 - 1) // 2
                j += 1
        assert bool((covered >= 1).all())  # adaptive windows may overlap by a row / column, never leave a gap


def test_pool_on_a_product_budget_is_torchs_adaptive_pooling():
    from vlm_prune.methods.simple import Pool

    feats = torch.randn(48, 5)
    red = Pool().reduce_image(VisionContext(feats, 12, grid=(6, 8)))  # 3 x 4 keeps the 6 x 8 aspect
    expected = F.adaptive_avg_pool2d(feats.t().reshape(1, 5, 6, 8), (3, 4))[0].reshape(5, -1).t()
    assert torch.equal(red.features, expected)
