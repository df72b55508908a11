"""MustDrop (liuting20/MustDrop at 909afa53) against an independent re-statement of its official
prefill and decoding stages, on the tiny LLaVA (batch 1, eager, no padding: the official setting).

The official loop (modelling_sparse_llama.py ``LlamaDynamicvitModel.forward``): after each scoring
layer l the head-averaged attention of the text rows after the image over the image rows drops a token
when its sum over the text rows is below global_thr times the total AND its largest entry is below
individual_thr; the kept rows are renumbered 0..n-1 (``position_ids.narrow``). After the prompt, the
KV caches of layers from the first scoring layer on are cut to the rows that reached the last layer,
and each layer's decode position is its own cache length (``get_usable_length``).
"""
from __future__ import annotations

import math

import pytest
import torch

import tiny_models as T
import vlm_prune
from test_fidelity_llm import inp, model  # noqa: F401 - the eager tiny LLaVA and its batch-1 input (fixtures)
from test_fidelity_llm import attention_probs, hidden_entering, image_rows, last_logits, lm_of, run_layers
from vlm_prune.kv_cache import segments_of
from vlm_prune.methods import MustDrop
from vlm_prune.methods.mustdrop import (dual_attention_keep, dual_attention_scores, key_ranks, window_members,
                                        window_merge, window_similarity)

LAYERS = [0, 2, 3]  # scoring layers of the 6-layer tiny Llama (rows drop after each)
#: the tiny model's text rows spread their attention almost evenly (each image token gets 1/16 of the
#: total, peaks 0.049 - 0.051): a high global threshold leaves the peak criterion to decide, which drops
#: about half of the tokens in the first stage
THRESHOLDS = dict(global_thr=0.5, individual_thr=0.0502)


def official_mustdrop(model, inp, layers, global_thr, individual_thr, renumber=True, counts=None, seen=None,
                      start=None):
    """(last-row logits, kept input rows after each stage) of the official prefill loop, re-stated.
    ``counts``: keep that many image tokens per stage by the filter's score instead (the budget
    generalisation). ``seen`` collects (rows entering each layer [S_l, D], their positions, input rows).
    ``start``: (rows entering layer 0 [S, D], their image rows, the key set's rows) after the official
    vision-encoding stage; default the unpruned model's input, no key set."""
    lm = lm_of(model)
    h, img, keys = start if start is not None else (hidden_entering(model, inp, 0), image_rows(inp), [])
    rows = torch.arange(h.shape[0])
    pos = rows.clone()
    img, keys = set(img.tolist() if torch.is_tensor(img) else img), set(keys)
    start, kept_after = 0, []
    with torch.no_grad():
        for stage, layer in enumerate(layers):
            for idx in range(start, layer + 1):
                if seen is not None:
                    seen.append((h, pos, rows))
                if idx == layer:
                    probs = attention_probs(lm.layers[layer], lm.rotary_emb, h, pos)  # [H, S, S]
                h = run_layers(model, h, pos, idx, idx + 1)
            is_img = torch.tensor([int(r) in img for r in rows])
            v = torch.nonzero(is_img).squeeze(1)
            attn = probs.mean(0)[int(v[-1]) + 1:][:, v]  # text rows after the image x image rows
            total = attn.sum(0)
            if counts is None:
                drop = (total < total.sum() * global_thr) & (attn.max(0).values < individual_thr)
                top = torch.unique(torch.cat([v[~drop], torch.tensor([i for i, r in enumerate(rows.tolist())
                                                                       if r in keys], dtype=torch.long)]))
            else:
                ratio = torch.maximum(total / (total.sum() * global_thr), attn.max(0).values / individual_thr)
                top = v[ratio.topk(counts[stage]).indices]
            keep = torch.cat([torch.nonzero(~is_img).squeeze(1), top]).sort().values
            h, rows = h[keep], rows[keep]
            pos = pos[: keep.numel()] if renumber else pos[keep]
            kept_after.append(rows.tolist())
            start = layer + 1
        for idx in range(start, len(lm.layers)):
            if seen is not None:
                seen.append((h, pos, rows))
            h = run_layers(model, h, pos, idx, idx + 1)
    return last_logits(model, h), kept_after


def official_decode_step(model, token: int, seen, first: int, final_rows: list[int], renumber=True) -> torch.Tensor:
    """Logits of the first decode step: in each layer the new token attends to that layer's cache
    (layers >= ``first`` cut to ``final_rows``) at the position after it (renumbered: the cache length)."""
    lm = lm_of(model)
    x = lm.embed_tokens(torch.tensor([token]))
    final = set(final_rows)
    with torch.no_grad():
        for idx, (h, pos, rows) in enumerate(seen):
            if idx >= first:
                cut = torch.tensor([int(r) in final for r in rows])
                h, pos, rows = h[cut], pos[cut], rows[cut]
            nxt = h.shape[0] if renumber else int(seen[0][1][-1]) + 1
            x = run_layers(model, torch.cat([h, x]), torch.cat([pos, torch.tensor([nxt])]), idx, idx + 1)[-1:]
        return last_logits(model, x)


def run_wrapped(model, inp, method, steps=2, **kw):
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=steps, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    return gen, stats


def test_dual_attention_filter_is_the_official_rule_and_its_score():
    attn = torch.tensor([[0.30, 0.01, 0.002, 0.0], [0.20, 0.02, 0.001, 0.2]])
    keep = dual_attention_keep(attn, global_thr=0.05, individual_thr=0.1)
    assert keep.tolist() == [True, False, False, True]  # column 1: 0.03 < 0.05 * 0.733 and 0.02 < 0.1
    assert ((dual_attention_scores(attn, 0.05, 0.1) >= 1) == keep).all()
    assert dual_attention_keep(attn, 1.0, 0.0).all()  # the evaluation script's argparse defaults drop nothing


@pytest.mark.parametrize("mode, positions", [("thresholds", "renumber"), ("budget", "renumber"), ("budget", "keep")])
def test_prefill_and_decode_equal_the_official_loop(model, inp, mode, positions):
    """Kept rows per stage, the prompt's last logits and the first decode step's logits (the
    output-aware cache: layers from the first scoring layer on see only the final rows). Budget:
    keep=0.25 in even shares over the stages, by the filter's score."""
    seen: list = []
    renumber = positions == "renumber"
    n_img = image_rows(inp).numel()
    budget = [round(n_img * (4 / n_img) ** (i / 3)) for i in (1, 2)] + [4] if mode == "budget" else None
    expected, kept = official_mustdrop(model, inp, LAYERS, **THRESHOLDS, renumber=renumber, counts=budget, seen=seen)
    counts = [sum(1 for r in k if r in set(image_rows(inp).tolist())) for k in kept]
    assert n_img > counts[0] and counts[-1] > 0, counts
    if budget is not None:
        assert counts == budget
    gen, stats = run_wrapped(model, inp, MustDrop(layers=LAYERS, positions=positions, vision=False, **THRESHOLDS),
                             **({"keep": 0.25} if budget else {}))
    assert [s["tokens_out"][0] for s in stats["stages"]] == counts and stats["visual_tokens_out"] == counts[-1:]
    torch.testing.assert_close(gen.scores[0][0], expected, atol=1e-5, rtol=0)
    token = int(gen.sequences[0, inp["input_ids"].shape[1]])
    step = official_decode_step(model, token, seen, LAYERS[0], kept[-1], renumber)
    torch.testing.assert_close(gen.scores[1][0], step, atol=1e-5, rtol=0)
    # the decode stage matters: without it the first decode step attends to every row each layer kept
    off, _ = run_wrapped(model, inp, MustDrop(layers=LAYERS, positions=positions, decode=False, vision=False,
                                              **THRESHOLDS),
                         **({"keep": 0.25} if budget else {}))
    assert torch.equal(off.scores[0], gen.scores[0]) and not torch.allclose(off.scores[1], gen.scores[1], atol=1e-4)


def test_default_schedule_scales_the_official_layers_with_depth():
    assert MustDrop().scoring_layers(32) == [2, 6, 10, 14]
    assert MustDrop().prune_layers(32) == [3, 7, 11, 15]
    assert MustDrop().scoring_layers(6) == [0, 1, 2, 3]
    assert MustDrop().decode_final_rows_from(32) == 2


def test_decode_stage_restricts_the_cache_segments_per_sample():
    """Batch 2 with padding: from the first scoring layer on, each sample's cached keys are its own
    final rows (the cache tensors stay; their keys are masked), and the layers before keep every row."""
    model = T.tiny_llava()
    inp = T.llava_inputs()
    vlm_prune.wrap(model, MustDrop(layers=[1, 2, 3], vision=False), keep=0.25)
    try:
        with torch.no_grad():
            out = model(**inp, use_cache=True)
        rows, stats = model.vlm_prune.last_rows, model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    segs = segments_of(out.past_key_values)
    first = segs.key_valid[segs.layer_segment[0]]
    assert first.sum(1).tolist() == inp["attention_mask"].sum(1).tolist()
    final = rows.ge(0).sum(1).tolist()
    assert segs.layer_segment[0] == 0 and segs.layer_segment[1] != 0  # layer 1's restricted copy of segment 0
    for idx in range(1, 6):
        assert segs.key_valid[segs.layer_segment[idx]].sum(1).tolist() == final, idx
    n_img = int((inp["input_ids"][0] == T.IMAGE_TOKEN).sum())
    assert stats["decode"] == {"method": "mustdrop", "from_layer": 1, "compacted": True,
                               "visual_keys_per_layer": [[n_img] * 2] + [[4, 4]] * 5}
    # the entries are freed: layers from F on hold the longest sample's final rows, left-padded
    layers = out.past_key_values.layers
    assert layers[0].keys.shape[2] == inp["input_ids"].shape[1] and {l.keys.shape[2] for l in layers[1:]} == {max(final)}


@pytest.mark.parametrize("knob, value, message", [
    ("global_thr", -1.0, "global_thr must be a number >= 0"),
    ("layers", [2, 1], "distinct increasing"),
    ("decode", "yes", "decode must be True or False"),
    ("vision", 1, "vision must be True or False"),
    ("window", 1, "window is the side of the merged tiles"),
    ("key_ratio", 1.5, "key_ratio must be a fraction"),
])
def test_refusals(knob, value, message):
    with pytest.raises(ValueError, match=message):
        MustDrop(**{knob: value})


def test_layers_past_the_model_are_refused(model):
    with pytest.raises(ValueError, match="only 6 decoder layers"):  # at wrap time, not at the first call
        vlm_prune.wrap(model, MustDrop(layers=[1, 5]))
    assert not hasattr(model, "vlm_prune")


# ---- the vision-encoding stage (official clip_encoder.py / local_merge.py) ------------------------

def official_conditional_pooling(h: torch.Tensor, threshold: float, ws: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged tokens [1, 1 + K, D], the patches of each output token [K] as lists) of the official
    ``conditional_pooling`` + ``merge_wavg`` on one image's layer-0 output h [1, 1 + N, D], re-stated:
    windows of ws x ws by ``unfold``, mean pairwise ``F.cosine_similarity`` without self pairs, r = the
    windows at or above the threshold, the top r windows' first ws*ws-1 patches summed into the last one
    (``scatter_reduce`` "sum"), divided by the sizes; output: CLS, the r merged, the rest in order."""
    x_cls, feat = h[:, :1], h[:, 1:]
    n, d = feat.shape[1], feat.shape[2]
    g = int(n ** 0.5)
    tiles = feat.reshape(1, g // ws, ws, g // ws, ws, d).permute(0, 1, 3, 5, 2, 4).reshape(1, (g // ws) ** 2, d, ws * ws)
    sims = torch.nn.functional.cosine_similarity(tiles.unsqueeze(-1), tiles.unsqueeze(-2), dim=2)
    sims = sims * (1 - torch.eye(ws * ws))
    sim = sims.sum(-1).sum(-1) / (ws * ws * (ws * ws - 1))
    r = int(torch.ge(sim, threshold).sum(dim=1).min())
    _, top = sim.topk(r, dim=-1)
    windows = torch.arange(n).reshape(g, g).unfold(0, ws, ws).unfold(1, ws, ws).reshape(-1, ws * ws)
    gathered = windows[top[0]]
    chosen = set(gathered.flatten().tolist())
    unm = torch.tensor(sorted(set(range(n)) - chosen), dtype=torch.long)
    src, dst = gathered[:, :-1].reshape(-1), gathered[:, -1]
    merge_idx = torch.arange(r).repeat_interleave(ws * ws - 1)
    size = torch.ones(n, 1)
    summed = feat[0][dst].scatter_reduce(0, merge_idx[:, None].expand(-1, d), feat[0][src], reduce="sum")
    sizes = size[dst].scatter_reduce(0, merge_idx[:, None], size[src], reduce="sum")
    out = torch.cat([x_cls[0], summed / sizes, feat[0][unm]])[None]
    groups = [sorted(w) for w in gathered.tolist()] + [[u] for u in unm.tolist()]
    return out, groups


def official_tower(model, pixels: torch.Tensor, threshold: float, ratio: float = 0.08):
    """(projected image features [K, D] in the official order, each one's patches, the key set's feature
    indices in rank order) of the official ``CLIPVisionModelAcc.custom_forward`` on one image: the
    encoder layers one by one, the merge after layer 0, LLaVA's feature layer -2 (the input of the last
    layer, CLS dropped), the last layer's [CLS] attention (eager softmax, mean over heads) top
    ceil(ratio * K)."""
    tower = model.model.vision_tower
    with torch.no_grad():
        h = tower.pre_layrnorm(tower.embeddings(pixels[None]))
        groups = None
        for idx, layer in enumerate(tower.encoder.layers):
            if idx == len(tower.encoder.layers) - 1:
                feature = h
                attn = layer.self_attn
                x = layer.layer_norm1(h)
                q = attn.q_proj(x).view(1, -1, attn.num_heads, attn.head_dim).transpose(1, 2)
                k = attn.k_proj(x).view(1, -1, attn.num_heads, attn.head_dim).transpose(1, 2)
                probs = torch.softmax((q @ k.transpose(-1, -2)) * attn.scale, dim=-1)
                cls_attn = probs[:, :, 0, 1:].mean(dim=1)
                left = math.ceil(ratio * (h.shape[1] - 1))
                keys = torch.topk(cls_attn, left, dim=1).indices[0]
            out = layer(h, None)
            h = out[0] if isinstance(out, tuple) else out
            if idx == 0:
                h, groups = official_conditional_pooling(h, threshold)
        feats = model.model.multi_modal_projector(feature[:, 1:])[0]
    return feats, groups, keys.tolist()


#: on the 20 tokens of the merged 6 x 6 grid the peak criterion keeps 9 of them; a 30% key set (6 tokens)
#: protects one more
TOWER_THRESHOLDS = dict(global_thr=0.5, individual_thr=0.042)
KEY_RATIO = 0.3


def tower_model():
    """The tiny eager LLaVA with a 6 x 6 patch grid (four 3 x 3 windows) and 3 tower layers."""
    return T.tiny_llava(attn="eager", tower_layers=3, image_size=48)


def window_sims(model, pixels: torch.Tensor) -> torch.Tensor:
    """The four windows' mean pairwise cosine after tower layer 0 (to place thresholds between them)."""
    tower = model.model.vision_tower
    with torch.no_grad():
        h = tower.encoder.layers[0](tower.pre_layrnorm(tower.embeddings(pixels[None])), None)
        h = h[0] if isinstance(h, tuple) else h
    members = window_members((6, 6), 3)
    return window_similarity(h[0, 1:], members)


def test_window_merge_and_key_set_equal_the_official_tower():
    """Per image of a batch of 2 (padded prompts, different merge counts): the tokens reaching the LLM,
    the patches each stands for (the official order: merged windows by similarity, then the rest) and
    the key set equal the official tower's; the vision stage alone (dual filter off) leaves them."""
    model = tower_model()
    inp = T.llava_inputs(batch=2, n_img_tokens=36, image_size=48)
    sims = [window_sims(model, inp["pixel_values"][b]).sort(descending=True).values for b in range(2)]
    threshold = float((sims[0][0] + sims[0][1]) / 2)  # image 0 merges one window, image 1 its own count
    refs = [official_tower(model, inp["pixel_values"][b], threshold, ratio=0.2) for b in range(2)]
    counts = [len(r[1]) for r in refs]
    assert counts == [28, 12]  # one window merged in image 0, three in image 1: the tower rows are padded
    method = MustDrop(merge_thr=threshold, key_ratio=0.2, global_thr=1.0, individual_thr=0.0)
    vlm_prune.wrap(model, method)
    try:
        with torch.no_grad():
            model(**inp)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    vit = stats["stages"][0]
    assert vit["stage"] == "vit" and vit["tokens_out"] == counts
    for b, (feats, groups, keys) in enumerate(refs):
        into = vit["merged_into"][b]  # each patch -> the slot of its token (packed in the official order)
        assert [sorted(p for p in range(36) if into[p] == slot) for slot in range(counts[b])] == groups
        assert vit["key_set"][b] == keys
    assert stats["visual_tokens_out"] == counts


@pytest.mark.parametrize("mode", ["thresholds", "budget"])
def test_three_stages_equal_the_official_pipeline(mode):
    """Batch 1, eager: the official tower (merge, key set), its features spliced into the prompt as the
    shorter sequence, then the official prefill loop where the key set is never dropped, and the first
    decode step on the output-aware cache; the wrapped model's stage counts and logits equal them."""
    model = tower_model()
    inp = T.llava_inputs(batch=1, n_img_tokens=36, image_size=48)
    sims = window_sims(model, inp["pixel_values"][0]).sort(descending=True).values
    threshold = float((sims[1] + sims[2]) / 2)  # two windows merge: 36 -> 20 tokens
    feats, groups, keys = official_tower(model, inp["pixel_values"][0], threshold, ratio=KEY_RATIO)
    assert len(groups) == 20 and len(keys) == 6  # ceil(0.3 * 20)
    img = image_rows(inp)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(inp["input_ids"][0])
    first = int(img[0])
    h = torch.cat([embeds[:first], feats, embeds[int(img[-1]) + 1:]])
    start = (h, list(range(first, first + len(groups))), [first + k for k in keys])
    seen: list = []
    if mode == "thresholds":
        expected, kept = official_mustdrop(model, inp, LAYERS, **TOWER_THRESHOLDS, seen=seen, start=start)
        _, unprotected = official_mustdrop(model, inp, LAYERS, **TOWER_THRESHOLDS, start=start[:2] + ([],))
        assert len(unprotected[-1]) < len(kept[-1])  # the key set keeps a token the filter drops
        kw = {}
    else:  # keep=0.25 of 36 = 9: the merge stays (20 >= 9), the LLM stages share 36 -> 9, keys first
        counts = [min(20, c) for c in (round(36 * (9 / 36) ** (1 / 3)), round(36 * (9 / 36) ** (2 / 3)))] + [9]
        expected, kept = official_budget_with_keys(model, LAYERS, counts, start, seen)
        _, unprotected = official_budget_with_keys(model, LAYERS, counts, start[:2] + ([],), [])
        assert unprotected[-1] != kept[-1]  # the key set comes first
        kw = {"keep": 0.25}
    n_vis = [sum(1 for r in k if start[1][0] <= r <= start[1][-1]) for k in kept]
    assert n_vis[-1] < 20
    gen, stats = run_wrapped(model, inp, MustDrop(layers=LAYERS, merge_thr=threshold, key_ratio=KEY_RATIO,
                                                  **TOWER_THRESHOLDS), **kw)
    assert [s["tokens_out"][0] for s in stats["stages"]] == [20] + n_vis
    assert stats["stages"][0]["key_set"][0] == keys
    torch.testing.assert_close(gen.scores[0][0], expected, atol=1e-5, rtol=0)
    token = int(gen.sequences[0, inp["input_ids"].shape[1]])
    step = official_decode_step(model, token, seen, LAYERS[0], kept[-1])
    torch.testing.assert_close(gen.scores[1][0], step, atol=1e-5, rtol=0)


def official_budget_with_keys(model, layers, counts, start, seen):
    """The budget generalisation of the official loop with a key set: each stage keeps ``counts[i]``
    image tokens, the key set first (by rank), then the best by the dual filter's score."""
    lm = lm_of(model)
    h, img, keys = start
    rank = {r: i for i, r in enumerate(keys)}
    rows = torch.arange(h.shape[0])
    pos = rows.clone()
    kept_after, begin = [], 0
    with torch.no_grad():
        for stage, layer in enumerate(layers):
            for idx in range(begin, layer + 1):
                seen.append((h, pos, rows))
                if idx == layer:
                    probs = attention_probs(lm.layers[layer], lm.rotary_emb, h, pos)
                h = run_layers(model, h, pos, idx, idx + 1)
            is_img = torch.tensor([int(r) in set(img) for r in rows])
            v = torch.nonzero(is_img).squeeze(1)
            attn = probs.mean(0)[int(v[-1]) + 1:][:, v]
            total = attn.sum(0)
            ratio = torch.maximum(total / (total.sum() * TOWER_THRESHOLDS["global_thr"]),
                                  attn.max(0).values / TOWER_THRESHOLDS["individual_thr"])
            key_pos = sorted((rank[int(rows[p])], i) for i, p in enumerate(v.tolist()) if int(rows[p]) in rank)
            chosen = [i for _, i in key_pos][: counts[stage]]
            rest = [i for i in ratio.argsort(descending=True).tolist() if i not in chosen]
            chosen += rest[: counts[stage] - len(chosen)]
            keep = torch.cat([torch.nonzero(~is_img).squeeze(1), v[torch.tensor(chosen)]]).sort().values
            h, rows, pos = h[keep], rows[keep], pos[: keep.numel()]
            kept_after.append(rows.tolist())
            begin = layer + 1
        for idx in range(begin, len(lm.layers)):
            seen.append((h, pos, rows))
            h = run_layers(model, h, pos, idx, idx + 1)
    return last_logits(model, h), kept_after


def test_window_helpers_cover_the_grid_and_rank_the_key_set():
    assert window_members((6, 6), 3).tolist()[1] == [3, 4, 5, 9, 10, 11, 15, 16, 17]
    assert window_members((4, 5), 3).tolist() == [[0, 1, 2, 5, 6, 7, 10, 11, 12]]  # the border stays out
    x = torch.randn(36, 8)
    x[[0, 1, 2, 6, 7, 8, 12, 13, 14]] = torch.randn(8)  # window 0: one repeated vector (cosine 1)
    into, k = window_merge(x, (6, 6), 3, threshold=0.99)
    assert k == 28 and into[[0, 1, 2, 6, 7, 8, 12, 13, 14]].tolist() == [0] * 9 and into[3].item() == 1
    into, k = window_merge(x, (6, 6), 3, threshold=0.99, max_windows=0)
    assert k == 36 and into.tolist() == list(range(36))
    assert key_ranks(torch.tensor([0.1, 0.5, 0.2, 0.3]), 0.5).tolist() == [-1, 0, -1, 1]
    assert key_ranks(torch.tensor([0.1, 0.5, 0.2]), 0.34).tolist() == [-1, 0, 1]  # ceil(0.34 * 3) = 2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_tower_rows_equal_each_image_alone(attn):
    """Two images merging different window counts (their tower rows padded and masked): each sample's
    generated tokens, scores and stage counts equal that sample run alone."""
    model = T.tiny_llava(attn=attn, tower_layers=3, image_size=48)
    inp = T.llava_inputs(batch=2, n_img_tokens=36, image_size=48)
    sims = [window_sims(model, inp["pixel_values"][b]).sort(descending=True).values for b in range(2)]
    method = MustDrop(merge_thr=float((sims[0][0] + sims[0][1]) / 2), key_ratio=KEY_RATIO, **TOWER_THRESHOLDS)
    both, stats = run_wrapped(model, inp, method, steps=3)
    assert stats["stages"][0]["tokens_out"] == [28, 12]
    for b in range(2):
        alone = {k: v[b:b + 1] for k, v in inp.items()}
        cut = int(alone["attention_mask"][0].argmax())  # the left padding of the batch
        alone = {k: (v[:, cut:] if k in ("input_ids", "attention_mask") else v) for k, v in alone.items()}
        one, one_stats = run_wrapped(model, alone, method, steps=3)
        assert [s["tokens_out"][0] for s in one_stats["stages"]] == [s["tokens_out"][b] for s in stats["stages"]]
        assert torch.equal(one.sequences[0, alone["input_ids"].shape[1]:], both.sequences[b, inp["input_ids"].shape[1]:])
        for step in range(3):
            torch.testing.assert_close(one.scores[step][0], both.scores[step][b], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_keep_one_is_the_unwrapped_model_and_unwrap_restores_it(attn):
    """keep=1.0 with every window similar enough to merge: nothing merges (the budget allows no merge),
    prefill logits and a 10-step greedy generate equal the unwrapped model's, bit for bit; after a
    merging run, unwrap restores the model exactly."""
    model = T.tiny_llava(attn=attn, tower_layers=3, image_size=48)
    inp = T.llava_inputs(batch=2, n_img_tokens=36, image_size=48)

    def run():
        with torch.no_grad():
            return model(**inp).logits, model.generate(**inp, max_new_tokens=10, min_new_tokens=10, do_sample=False)

    ref_logits, ref_gen = run()
    vlm_prune.wrap(model, MustDrop(merge_thr=-1.0), keep=1.0)
    try:
        logits, gen = run()
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    valid = inp["attention_mask"].bool()
    assert torch.equal(logits[valid], ref_logits[valid]) and torch.equal(gen, ref_gen)
    assert [s["stage"] for s in stats["stages"]][:2] == ["vit", "llm"] and stats["visual_tokens_out"] == [36, 36]
    vlm_prune.wrap(model, MustDrop(merge_thr=-1.0))  # merges all four windows: 36 -> 4
    try:
        merged, _ = run()
        assert model.vlm_prune.last_stats["stages"][0]["tokens_out"] == [4, 4]
    finally:
        vlm_prune.unwrap(model)
    after_logits, after_gen = run()
    assert torch.equal(after_logits, ref_logits) and torch.equal(after_gen, ref_gen)
    assert not torch.allclose(merged[:, -1], ref_logits[:, -1])


def test_the_vision_stage_runs_on_llava_only_and_can_be_turned_off():
    """On a family without the tower stage (LLaVA-NeXT: anyres tiles) MustDrop runs its llm stages only,
    as ``vlm-prune methods`` notes; vision=False and another image method leave the tower alone."""
    from vlm_prune.cli_methods import works_with_table

    next_model = T.tiny_llava_next()
    vlm_prune.wrap(next_model, "mustdrop")
    try:
        assert set(next_model.vlm_prune.methods) == {"llm"}
    finally:
        vlm_prune.unwrap(next_model)
    model = T.tiny_llava()
    for method, stages in ((MustDrop(), {"vit", "llm"}), (MustDrop(vision=False), {"llm"}),
                           (["pool", MustDrop()], {"vision", "llm"})):
        vlm_prune.wrap(model, method, keep=0.5)
        try:
            assert set(model.vlm_prune.methods) == stages
        finally:
            vlm_prune.unwrap(model)
    table = works_with_table()
    assert "- `mustdrop` on `llava_next`: prefill and decoding stages only" in table
    assert "`mustdrop` on `llava`:" not in table


def test_positions_keep_places_each_tower_token_at_its_own_patch():
    """positions="keep": an unmerged patch stays at its slot, a merged window sits at its last patch (the
    official merge target), in spatial order with the original position ids; the kept sets are the same."""
    model = tower_model()
    inp = T.llava_inputs(batch=1, n_img_tokens=36, image_size=48)
    sims = window_sims(model, inp["pixel_values"][0]).sort(descending=True).values
    threshold = float((sims[1] + sims[2]) / 2)
    _, groups, keys = official_tower(model, inp["pixel_values"][0], threshold)
    records = {}
    for positions in ("renumber", "keep"):
        _, stats = run_wrapped(model, inp, MustDrop(merge_thr=threshold, positions=positions, global_thr=1.0,
                                                    individual_thr=0.0), steps=1)
        records[positions] = stats["stages"][0]
    into = records["keep"]["merged_into"][0]
    assert sorted({max(g) for g in groups}) == sorted(set(into)) and all(into[p] == max(g) for g in groups for p in g)
    assert records["keep"]["key_set"][0] == [max(groups[k]) for k in keys]
    assert records["renumber"]["key_set"][0] == keys
