"""In-LLM methods against independent re-statements of their official algorithms.

Each test runs the wrapped tiny LLaVA (batch 1, eager, no padding: the official scripts' setting)
and compares with a plain re-statement written from the papers and the official code's
behaviour, on the unwrapped model's own hidden states:
- FastV (pkunlp-icler/FastV, fastv_kvcache.py at 49dfad77): head-averaged attention of the last
  query in layer K-1, top floor(R n) image tokens, kept tokens keep their position ids.
- PACT (orailix/PACT): EUTI importance, top floor(rho n), DBDPC on layer-L keys, pruned tokens
  re-attached within 1.5 d_c, clusters averaged at their centre.
- AdaptInfer (weiczh02/AdaptInfer-base at 91b1784a / 8f5ae0c0): text-text symmetric importance
  weighting text-to-image attention, several stages, position ids renumbered 0..n-1 after each
  stage on LLaVA (the official LLaVA code) or kept.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tiny_models as T
import vlm_prune
from vlm_prune.methods import PACT, AdaptInfer, FastV


@pytest.fixture(scope="module")
def model():
    return T.tiny_llava(attn="eager")


@pytest.fixture(scope="module")
def inp():
    return T.llava_inputs(batch=1)


def lm_of(model):
    return model.model.language_model


def hidden_entering(model, inp, layer: int) -> torch.Tensor:
    """[S, D] hidden states entering decoder ``layer`` of the unwrapped model (batch 1)."""
    with torch.no_grad():
        return model(**inp, output_hidden_states=True).hidden_states[layer][0]


def attention_probs(layer_module, rotary, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[H, S, S] causal softmax attention of one Llama layer over rows h [S, D] at positions pos [S]."""
    attn = layer_module.self_attn
    x = layer_module.input_layernorm(h[None])
    s, hd = h.shape[0], attn.head_dim
    q = attn.q_proj(x).view(1, s, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(1, s, -1, hd).transpose(1, 2)
    cos, sin = rotary(x, pos[None])
    rot = lambda t: torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1)
    q, k = q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2))[0] * hd**-0.5
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def run_layers(model, h: torch.Tensor, pos: torch.Tensor, start: int, stop: int | None = None,
               bias: torch.Tensor | None = None, seen: list | None = None) -> torch.Tensor:
    """Decoder layers start..stop-1 on rows h [S, D] at positions pos [S] (causal, optional
    per-key log-size bias [S]), the plain HF layers called one by one."""
    lm = lm_of(model)
    s = h.shape[0]
    mask = torch.zeros(s, s).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    if bias is not None:
        mask = mask + bias[None, :]
    pe = lm.rotary_emb(h[None], pos[None])
    x = h[None]
    for layer in lm.layers[start:stop]:
        if seen is not None:
            seen.append((x[0], pos))
        out = layer(x, attention_mask=mask[None, None], position_ids=pos[None], position_embeddings=pe)
        x = out[0] if isinstance(out, tuple) else out
    return x[0]


def last_logits(model, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head(lm_of(model).norm(h[-1:]))[0]


def wrapped(model, inp, method, **kw):
    """(last-row logits, kept input rows) of the wrapped model."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            logits = model(**inp).logits[0, -1]
        rows = model.vlm_prune.last_rows[0]
    finally:
        vlm_prune.unwrap(model)
    return logits, rows[rows >= 0]


def image_rows(inp) -> torch.Tensor:
    return torch.nonzero(inp["input_ids"][0] == T.IMAGE_TOKEN).squeeze(1)


# ---- FastV ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_fastv_equals_the_official_kv_cache_algorithm(model, inp, ratio):
    k_layer = 2
    img = image_rows(inp)
    s = inp["input_ids"].shape[1]
    with torch.no_grad():
        att = model(**inp, output_attentions=True).attentions[k_layer - 1][0]  # [H, S, S]
        score = att.mean(0)[-1, img]
        top = img[score.topk(int(img.numel() * ratio)).indices]
        keep = torch.cat([torch.arange(int(img[0])), top, torch.arange(int(img[-1]) + 1, s)]).sort().values
        h = run_layers(model, hidden_entering(model, inp, k_layer)[keep], keep, k_layer)
        expected = last_logits(model, h)
    logits, rows = wrapped(model, inp, FastV(layer=k_layer), keep=ratio)
    assert rows.tolist() == keep.tolist()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


# ---- PACT -------------------------------------------------------------------------------------
def official_dbdpc(x: torch.Tensor, d_c: float) -> tuple[list[int], torch.Tensor]:
    """DBDPC as the paper states it: (centres in the order found, nearest-centre label per point)."""
    n = x.shape[0]
    xn = F.normalize(x.double(), dim=1)
    d = (1 - xn @ xn.T).clamp(min=0)
    dens = torch.exp(-((d / 2) ** 2)).sum(1)
    rank = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: (float(dens[i]), -i)))}
    left, centres = set(range(n)), []
    while left:
        new = []
        for i in sorted(left):
            denser = [float(d[i, j]) for j in left if rank[j] > rank[i]]
            if min(denser, default=math.inf) > d_c:
                new.append(i)
        centres += new
        left -= {i for i in left if any(float(d[i, c]) <= d_c for c in new)} | set(new)
        if len(new) < 10:  # greedy finish, densest first
            for i in sorted(left, key=lambda i: -rank[i]):
                if all(float(d[i, c]) > d_c for c in centres):
                    centres.append(i)
            left = set()
    labels = d[:, centres].argmin(1)
    return centres, labels


def official_pact(model, inp, layer: int, rho: float, d_c: float):
    """(kept input rows, merged hidden [K, D] at the kept visual rows, sizes) of PACT's official
    algorithm before decoder ``layer`` (batch 1)."""
    lm = lm_of(model)
    dec = lm.layers[layer]
    h = hidden_entering(model, inp, layer)
    img = image_rows(inp)
    s, hd = h.shape[0], dec.self_attn.head_dim
    pos = torch.arange(s)
    with torch.no_grad():
        x = dec.input_layernorm(h[None])
        q = dec.self_attn.q_proj(x).view(s, -1, hd)
        k = dec.self_attn.k_proj(x).view(s, -1, hd)
        # EUTI on rows 0..last image row, no RoPE, GQA keys repeated
        n_rows = int(img[-1]) + 1
        k_rep = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        qbar = q[:n_rows].mean(0)  # [H, d]
        a = torch.softmax(torch.einsum("hd,nhd->hn", qbar.float(), k_rep[:n_rows].float()) / math.sqrt(hd), dim=-1)
        euti = a.mean(0) * h[:n_rows].float().norm(dim=-1)
        n_keep = math.floor(rho * img.numel() + 1e-9)
        order = euti[img].topk(n_keep).indices
        kept, pruned = img[order.sort().values], img[torch.ones(img.numel(), dtype=torch.bool).index_fill(0, order, False)]
        # DBDPC on the layer's keys after RoPE, distinct KV heads flattened
        cos, sin = lm.rotary_emb(x, pos[None])
        kr = k.transpose(0, 1)[None]
        rot = torch.cat([-kr[..., hd // 2:], kr[..., : hd // 2]], -1)
        keys = (kr * cos[:, None] + rot * sin[:, None])[0].transpose(0, 1).reshape(s, -1)
    centres, labels = official_dbdpc(keys[kept], d_c)
    cn = F.normalize(keys[kept][centres].double(), dim=1)
    dist = (1 - F.normalize(keys[pruned].double(), dim=1) @ cn.T).clamp(min=0)
    best, near = dist.min(1)
    members = {c: [int(kept[i]) for i in range(kept.numel()) if int(labels[i]) == j] for j, c in enumerate(centres)}
    for p, b, j in zip(pruned.tolist(), best.tolist(), near.tolist()):
        if b <= 1.5 * d_c:
            members[centres[j]].append(p)
    text = [i for i in range(s) if i not in set(img.tolist())]
    centre_rows = sorted(int(kept[c]) for c in centres)
    by_row = {int(kept[c]): members[c] for c in centres}
    feats = torch.stack([h[by_row[r]].mean(0) for r in centre_rows])
    sizes = torch.tensor([float(len(by_row[r])) for r in centre_rows])
    return sorted(text + centre_rows), centre_rows, feats, sizes


@pytest.mark.parametrize("d_c", [0.21, 0.6])
def test_pact_euti_and_dbdpc_equal_the_official_algorithm(model, inp, d_c):
    """Kept rows, merged hidden states and cluster sizes of PACT(rho, cutoff) equal the
    re-statement on the same layer-L inputs; the logits then equal the plain layers with the
    log-size bias on the merged keys (proportional attention)."""
    layer, rho = 2, 0.55
    rows_exp, centre_rows, feats, sizes = official_pact(model, inp, layer, rho, d_c)
    if d_c == 0.6:
        assert (sizes > 1).any(), "this cutoff must merge some tokens"
    seen = {}

    class Recording(PACT):
        def select(self, ctx):
            seen["reds"] = super().select(ctx)
            return seen["reds"]

    logits, rows = wrapped(model, inp, Recording(layer=layer, rho=rho, cutoff=d_c))
    assert rows.tolist() == rows_exp
    (red,) = seen["reds"]
    vis = [i for i, r in enumerate(red.indices.tolist()) if r in centre_rows]
    torch.testing.assert_close(red.features[vis].float(), feats.float(), atol=1e-5, rtol=0)
    assert red.sizes[vis].tolist() == sizes.tolist()
    h = hidden_entering(model, inp, layer).clone()
    h[centre_rows] = feats.to(h.dtype)
    keep = torch.tensor(rows_exp)
    bias = torch.zeros(h.shape[0])
    bias[centre_rows] = sizes.log()
    with torch.no_grad():
        expected = last_logits(model, run_layers(model, h[keep], keep, layer, bias=bias[keep]))
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


# ---- AdaptInfer -------------------------------------------------------------------------------
def official_adaptinfer(model, inp, after: list[int], counts: list[int], renumber: bool,
                        seen: list | None = None) -> tuple[torch.Tensor, list[int]]:
    """Last-row logits and kept input rows of AdaptInfer's official loop: after each layer l of
    ``after``, score the image tokens with that layer's attention (text rows = every row after
    the image block), keep the top counts[i] and drop the rest from the layer's output.
    ``seen`` collects (rows [S_l, D], positions [S_l]) entering every layer."""
    lm = lm_of(model)
    n_layers = len(lm.layers)
    h = hidden_entering(model, inp, 0)
    rows = torch.arange(h.shape[0])
    pos = rows.clone()
    img = set(image_rows(inp).tolist())
    start = 0
    with torch.no_grad():
        for stage, layer in enumerate(after):
            h = run_layers(model, h, pos, start, layer, seen=seen)
            probs = attention_probs(lm.layers[layer], lm.rotary_emb, h, pos)  # [H, S, S]
            h = run_layers(model, h, pos, layer, layer + 1, seen=seen)
            is_img = torch.tensor([int(r) in img for r in rows])
            v = torch.nonzero(is_img).squeeze(1)
            t0 = int(v[-1]) + 1
            a_tt = probs[:, t0:, t0:]
            sym = a_tt + a_tt.transpose(-1, -2) - torch.diag_embed(torch.diagonal(a_tt, dim1=-2, dim2=-1))
            imp = sym.sum(-2)  # [H, T]
            score = torch.einsum("ht,hts->s", imp, probs[:, t0:, :])[v]
            top = v[score.topk(counts[stage]).indices]
            keep = torch.cat([torch.nonzero(~is_img).squeeze(1), top]).sort().values
            h, rows = h[keep], rows[keep]
            pos = pos[: keep.numel()] if renumber else pos[keep]  # official LLaVA: position_ids[:, :kept]
            start = layer + 1
        h = run_layers(model, h, pos, start, n_layers, seen=seen)
    return last_logits(model, h), rows.tolist()


@pytest.mark.parametrize("positions", ["renumber", "keep"])
def test_adaptinfer_equals_the_official_multi_stage_loop(model, inp, positions):
    after, keep = [0, 2, 3], 0.25
    n = image_rows(inp).numel()
    target = math.floor(keep * n)
    counts = [round(n * (target / n) ** (i / 3)) for i in (1, 2)] + [target]  # even share per stage
    expected, rows_exp = official_adaptinfer(model, inp, after, counts, positions == "renumber")
    logits, rows = wrapped(model, inp, AdaptInfer(layers=after, positions=positions), keep=keep)
    assert rows.tolist() == rows_exp
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_adaptinfer_defaults_to_the_official_position_handling_on_llava(model, inp):
    after = [0, 2, 3]
    default, _ = wrapped(model, inp, AdaptInfer(layers=after), keep=0.25)
    renumbered, _ = wrapped(model, inp, AdaptInfer(layers=after, positions="renumber"), keep=0.25)
    kept, _ = wrapped(model, inp, AdaptInfer(layers=after, positions="keep"), keep=0.25)
    assert torch.equal(default, renumbered) and not torch.equal(default, kept)


def test_adaptinfer_renumbered_decode_continues_each_layer_from_its_own_rows(model, inp):
    """A decode step after renumbering prunes: at each layer the new token sits at the position
    after that layer's own rows (the official code's per-layer cache length) and attends to the
    rows that layer kept. The cached second step equals this re-statement."""
    after = [0, 2, 3]
    vlm_prune.wrap(model, AdaptInfer(layers=after), keep=0.25)
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=2, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
    finally:
        vlm_prune.unwrap(model)
    n = image_rows(inp).numel()
    counts = [round(n * (4 / n) ** (i / 3)) for i in (1, 2)] + [4]
    per_layer: list = []
    first, _ = official_adaptinfer(model, inp, after, counts, True, seen=per_layer)
    token = int(first.argmax())
    assert int(gen.sequences[0, inp["input_ids"].shape[1]]) == token
    lm = lm_of(model)
    x = lm.embed_tokens(torch.tensor([token]))
    with torch.no_grad():
        for idx, (rows, pos) in enumerate(per_layer):
            h = torch.cat([rows, x])
            p = torch.cat([pos, pos[-1:] + 1])  # renumbered rows are 0..S_l-1: the next is S_l
            x = run_layers(model, h, p, idx, idx + 1)[-1:]
        expected = model.lm_head(lm.norm(x))[0]
    torch.testing.assert_close(gen.scores[1][0], expected, atol=1e-5, rtol=0)
    assert len({int(pos[-1]) for _, pos in per_layer}) > 1  # the layers really continue from different positions


def _llava_576(layers: int = 32):
    """A tiny LLaVA whose image gives 576 visual tokens (24 x 24 patches, as LLaVA-1.5's 336px CLIP)
    and whose language model has LLaVA-1.5-7B's depth (32 layers, narrow)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=48, patch_size=2),
        text_config=T._llama(num_hidden_layers=layers, max_position_embeddings=1024),
        image_token_id=T.IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(cfg).eval()
    inp = T.llava_inputs(batch=1, n_img_tokens=576)
    inp["pixel_values"] = torch.randn(1, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    return model, inp


def test_adaptinfer_average_64_is_the_published_schedule_and_budget_64_the_final_count():
    """The paper's "64 tokens" on LLaVA-1.5-7B is AdaptInfer(average=64): 133, 27, 3 of 576 tokens
    after layers 1, 10, 20; budget=64 (the library's target) ends at 64: 277, 133, 64."""
    model, inp = _llava_576()

    def stages(method, **kw):
        vlm_prune.wrap(model, method, **kw)
        stats = T.forward_stats(model, inp)
        assert stats["visual_tokens_in"] == [576]
        return [(s["layer"], s["tokens_out"][0]) for s in stats["stages"]], stats["visual_tokens_out"][0]

    paper, final = stages(AdaptInfer(schedule="llava-1.5-7b", average=64))
    assert paper == [(2, 133), (11, 27), (21, 3)] and final == 3
    ours, final = stages(AdaptInfer(schedule="llava-1.5-7b"), budget=64)
    assert ours == [(2, 277), (11, 133), (21, 64)] and final == 64
