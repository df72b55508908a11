"""SparseVLM against an independent re-statement of its official loop (Gumpest/SparseVLMs, v1.5 at
b9619e61: modelling_sparse_llama.py ``LlamaDynamicvitModel.forward``, score.py, utils.py
``cluster_and_merge``; the rank rule of b72c5d65's score.py ``attn_postprocess_rank``).

The re-statement runs the unwrapped tiny LLaVA layer by layer (batch 1, eager, no padding: the
official setting): raters from the input embeddings, after each pruning layer the raters' head-
averaged attention in that layer scores the image tokens, the top k stay, the top 30% (+1) of the
deleted ones by score are clustered (DPC-kNN) into int(m / 10) + 1 averaged tokens appended after
the kept image tokens, and the sequence is rebuilt with position ids renumbered 0..n-1. A recycled
token is named, in the kept rows, by the slot vlm-prune gives it: the last deleted image rows, in
cluster order.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from test_fidelity_llm import attention_probs, hidden_entering, image_rows, last_logits, lm_of, run_layers, wrapped
from vlm_prune.methods import SparseVLM
from vlm_prune.methods.sparsevlm import density_peak_merge, kept_for_total, recycled_counts


@pytest.fixture(scope="module")
def model():
    return T.tiny_llava(attn="eager")


def official_cluster_and_merge(x: torch.Tensor, cluster_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """utils.py ``cluster_and_merge`` for one sample, minus its 1e-6 random density noise:
    (cluster of each row, merged rows)."""
    n, c = x.shape
    dist = (x[:, None, :] - x[None, :, :]).norm(dim=-1, p=2) / c**0.5
    nearest = torch.topk(dist, k=cluster_num, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    mask = (density[None, :] > density[:, None]).float()
    parent_dist = (dist * mask + dist.max() * (1 - mask)).min(dim=-1).values
    centres = torch.topk(parent_dist * density, k=cluster_num).indices
    cluster = dist[centres].argmin(dim=0)
    cluster[centres] = torch.arange(cluster_num)
    weight = torch.zeros(cluster_num).index_add_(0, cluster, torch.ones(n)) + 1e-6
    merged = torch.zeros(cluster_num, c).index_add_(0, cluster, x / weight[cluster][:, None])
    return cluster, merged


def official_sparsevlm(model, inp, after: list[int], keep_count, seen: list | None = None):
    """(last-row logits, input index of every row reaching the last layer, a recycled token named by
    its slot). ``keep_count(stage, rel, v_num)`` gives the top-k of a stage (None: no deletion),
    ``rel`` the [raters, image] attention; ``seen`` collects (rows, positions) entering every layer."""
    lm = lm_of(model)
    n_layers = len(lm.layers)
    img = image_rows(inp)
    v_start, v_num = int(img[0]), img.numel()
    h = hidden_entering(model, inp, 0)
    rows = torch.arange(h.shape[0])
    t_start = v_start + v_num
    relevance = torch.softmax(h[v_start:t_start] @ h[t_start:].T, dim=1).mean(0)
    raters = torch.nonzero(relevance > relevance.mean()).squeeze(1)
    pos = torch.arange(h.shape[0])
    start = 0
    with torch.no_grad():
        for stage, layer in enumerate(after):
            h = run_layers(model, h, pos, start, layer, seen=seen)
            probs = attention_probs(lm.layers[layer], lm.rotary_emb, h, pos).mean(0)  # [S, S], heads averaged
            h = run_layers(model, h, pos, layer, layer + 1, seen=seen)
            start = layer + 1
            rel = probs[t_start + raters][:, v_start:t_start]
            score = rel.mean(0)
            k = keep_count(stage, rel, v_num)
            if k is None:
                continue
            keep = torch.zeros(v_num, dtype=torch.bool)
            keep[torch.topk(score, k).indices] = True
            deleted = torch.nonzero(~keep).squeeze(1)
            m = int(deleted.numel() * 0.3) + 1
            members = deleted[score[deleted].topk(m).indices]
            c = int(m / 10) + 1
            merged = official_cluster_and_merge(h[v_start + members], c)[1]
            kept = v_start + torch.nonzero(keep).squeeze(1)
            h = torch.cat([h[:v_start], h[kept], merged, h[t_start:]])
            rows = torch.cat([rows[:v_start], rows[kept], rows[v_start + deleted[-c:]], rows[t_start:]])
            pos = pos[: h.shape[0]]  # official: position_ids[:, :kept]
            v_num = k + c
            t_start = v_start + v_num
        h = run_layers(model, h, pos, start, n_layers, seen=seen)
    return last_logits(model, h), rows.tolist()


def schedule_counts(counts: list[int]):
    return lambda stage, rel, v_num: min(counts[stage], v_num - 1)


def test_density_peak_merge_equals_the_official_cluster_and_merge():
    gen = torch.Generator().manual_seed(0)
    for m, c in [(30, 4), (83, 9), (7, 1), (12, 12)]:
        x = torch.randn(m, 16, generator=gen)
        cluster, merged = density_peak_merge(x, c)
        cluster_ref, merged_ref = official_cluster_and_merge(x, c)
        assert cluster.tolist() == cluster_ref.tolist()
        torch.testing.assert_close(merged, merged_ref, atol=1e-5, rtol=1e-5)


def test_recycled_counts_and_exact_totals():
    # the official 192 schedule on 576 tokens: 300 kept -> 276 deleted, 83 recycled into 9 tokens
    assert recycled_counts(276) == (83, 9) and recycled_counts(1) == (1, 1) and recycled_counts(0) == (0, 0)
    for n in (16, 100, 576):
        for total in range(1, n):
            k, c = kept_for_total(n, total)
            assert k + c == total and 0 <= k < n
            if k > 0:
                assert c == recycled_counts(n - k)[1]  # the official cluster count whenever anything is kept
            assert kept_for_total(n, total, ratio=0.0) == (total, 0)  # recycling off: a plain top-k


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sparsevlm_defaults_equal_the_official_v15_loop(model, seed):
    """No keep / budget: v1.5's retained=192 schedule, after layers round((2, 6, 15) * 6 / 32) =
    0, 1, 3 of the tiny model's 6, keeping round((300, 200, 110) * 16 / 576) = 8, 6, 3."""
    inp = T.llava_inputs(batch=1, seed=seed)
    expected, rows_exp = official_sparsevlm(model, inp, [0, 1, 3], schedule_counts([8, 6, 3]))
    logits, rows = wrapped(model, inp, SparseVLM())
    assert rows.tolist() == rows_exp
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_sparsevlm_rank_rule_equals_the_official_v1_loop(model):
    """rank=True, retained=64: k = int(rank(P) * 0.8 + 0) of the [raters, image] attention P, after
    layers round((2, 6, 15, 19) * 6 / 32) = 0, 1, 3, 4; nothing deleted at full column rank."""
    inp = T.llava_inputs(batch=1)
    seen = []

    def rank_count(stage, rel, v_num):
        r = int(torch.linalg.matrix_rank(rel.float()))
        seen.append(r)
        return None if r == v_num else min(int(r * 0.8 + 0.0), v_num - 1)

    expected, rows_exp = official_sparsevlm(model, inp, [0, 1, 3, 4], rank_count)
    logits, rows = wrapped(model, inp, SparseVLM(rank=True, retained=64))
    assert rows.tolist() == rows_exp and len(seen) == 4
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_sparsevlm_budget_is_the_final_count_recycled_tokens_included(model):
    inp = T.llava_inputs(batch=1)
    n = image_rows(inp).numel()
    for kw, target in ((dict(keep=0.25), 4), (dict(budget=5), 5), (dict(budget=1), 1)):
        final = []
        totals = [round(n * (target / n) ** (i / 3)) for i in (1, 2)] + [target]  # even share per stage

        def count(stage, rel, v_num, totals=totals):
            if totals[stage] >= v_num:
                return None
            return kept_for_total(v_num, totals[stage])[0]

        expected, rows_exp = official_sparsevlm(model, inp, [0, 1, 3], count)
        logits, rows = wrapped(model, inp, SparseVLM(), **kw)
        assert rows.tolist() == rows_exp
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        img = set(image_rows(inp).tolist())
        final.append(sum(int(r) in img for r in rows))
        assert final == [target]


def test_sparsevlm_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"retained must be one of the official settings \[64, 128, 192\]"):
        SparseVLM(retained=100)
    with pytest.raises(ValueError, match="scale / bias set the rank rule's counts; pass rank=True"):
        SparseVLM(scale=2.0)
    with pytest.raises(ValueError, match="positions must be 'renumber' or 'keep'"):
        SparseVLM(positions="shift")
    with pytest.raises(ValueError, match=r"recycle .* must lie in \[0, 1\]"):
        SparseVLM(recycle=1.5)
    model = T.tiny_llava()
    with pytest.raises(ValueError, match=r"prunes after layers \[1, 5\].*only 6 decoder layers"):
        vlm_prune.wrap(model, SparseVLM(layers=[1, 5]), keep=0.5)
    with pytest.raises(ValueError, match=r"v1.5 schedule has 3 stages, but it prunes after layers \[0, 2\]"):
        vlm_prune.wrap(model, SparseVLM(layers=[0, 2]))
    vlm_prune.unwrap(vlm_prune.wrap(model, SparseVLM(layers=[0, 2]), keep=0.5))  # a target sets every stage
    qwen = T.tiny_qwen2_vl()
    with pytest.raises(ValueError, match="positions='renumber' is for 1-D positions"):
        vlm_prune.wrap(qwen, SparseVLM(positions="renumber"), keep=0.5)


def test_sparsevlm_reports_recycled_groups_and_keeps_m_rope_positions():
    """Qwen2-VL (M-RoPE): positions kept by default; a stage record maps each input token to the
    row it reaches (a recycled row is named by the deleted token whose slot it holds, -1: deleted):
    as many distinct rows as the stage leaves, at least one holding several tokens."""
    model = T.tiny_qwen2_vl()
    inp = T.qwen2_vl_inputs(model, batch=1)
    vlm_prune.wrap(model, SparseVLM(), keep=0.25)
    try:
        assert model.vlm_prune.methods["llm"].positions == "keep"
        with torch.no_grad():
            model(**inp)
        stages = [s for s in model.vlm_prune.last_stats["stages"] if s["stage"] == "llm"]
    finally:
        vlm_prune.unwrap(model)
    into = stages[0]["merged_into"][0]
    rows = [t for t in into if t >= 0]
    assert len(set(rows)) == stages[0]["tokens_out"][0] and len(rows) > len(set(rows))
    assert stages[-1]["tokens_out"] == [int(0.25 * stages[0]["tokens_in"][0])]


def test_sparsevlm_renumbered_decode_continues_each_layer_from_its_own_rows(model):
    """A decode step after the recycled rows moved: at each layer the new token sits after that
    layer's own rows (the official per-layer cache length) and attends to them; the cached second
    token equals this re-statement, and generate() without a cache gives the same tokens."""
    inp = T.llava_inputs(batch=1, seed=3)
    vlm_prune.wrap(model, SparseVLM())
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=4, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
            rows = model.vlm_prune.last_rows
            no_cache = model.generate(**inp, max_new_tokens=4, do_sample=False, use_cache=False)
            assert torch.equal(model.vlm_prune.last_rows[:, : rows.shape[1]], rows)  # then the 3 generated tokens
            model.generate(**inp, max_new_tokens=4, num_beams=3, do_sample=False)
            assert torch.equal(model.vlm_prune.last_rows, rows.repeat_interleave(3, 0))  # beams: the sample's rows
    finally:
        vlm_prune.unwrap(model)
    assert torch.equal(gen.sequences, no_cache)
    per_layer: list = []
    first, _ = official_sparsevlm(model, inp, [0, 1, 3], schedule_counts([8, 6, 3]), seen=per_layer)
    token = int(first.argmax())
    assert int(gen.sequences[0, inp["input_ids"].shape[1]]) == token
    x = lm_of(model).embed_tokens(torch.tensor([token]))
    with torch.no_grad():
        for idx, (rows, pos) in enumerate(per_layer):
            x = run_layers(model, torch.cat([rows, x]), torch.cat([pos, pos[-1:] + 1]), idx, idx + 1)[-1:]
    torch.testing.assert_close(gen.scores[1][0], last_logits(model, x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sparsevlm_batch_equals_samples_alone_with_recycling(attn):
    """Batch 2 with left padding: each sample's kept rows, logits and greedy tokens equal that
    sample alone (the shared invariant, here with the recycled rows moved)."""
    model = T.tiny_llava(attn=attn)
    inp = T.llava_inputs(batch=2)
    vlm_prune.wrap(model, SparseVLM())
    try:
        with torch.no_grad():
            batch = model(**inp).logits[:, -1]
            rows = model.vlm_prune.last_rows
            gen = model.generate(**inp, max_new_tokens=5, do_sample=False)
            for i in range(2):
                one = {k: v[i:i + 1] for k, v in inp.items()}
                valid = one["attention_mask"][0].bool()
                one = {k: (v[:, valid] if k in ("input_ids", "attention_mask") else v) for k, v in one.items()}
                alone = model(**one).logits[0, -1]
                alone_rows = model.vlm_prune.last_rows[0]
                shift = int((~valid).sum())
                assert (rows[i][rows[i] >= 0] - shift).tolist() == alone_rows[alone_rows >= 0].tolist()
                torch.testing.assert_close(batch[i], alone, atol=1e-5, rtol=0)
                alone_gen = model.generate(**one, max_new_tokens=5, do_sample=False)
                assert gen[i, -5:].tolist() == alone_gen[0, -5:].tolist()
    finally:
        vlm_prune.unwrap(model)


def test_sparsevlm_rank_rule_with_a_budget_adapts_the_stages_before_the_last(model):
    """rank=True, scale 3, budget=3: each stage before the last deletes down to int(rank * 3) (+ its
    recycled tokens) unless that falls below the target (then the target), the last stage ends on
    the target exactly; the same re-statement of the official loop gives the same rows."""
    inp = T.llava_inputs(batch=1)
    layers = [0, 1, 3, 4]

    def count(stage, rel, v_num):
        r = int(torch.linalg.matrix_rank(rel.float()))
        if 3 >= v_num or (r == v_num and stage < 3):
            return None
        k = min(int(r * 3.0), v_num - 1)
        if stage < 3 and k + recycled_counts(v_num - k)[1] > 3:
            return k
        return kept_for_total(v_num, 3)[0]

    expected, rows_exp = official_sparsevlm(model, inp, layers, count)
    vlm_prune.wrap(model, SparseVLM(rank=True, scale=3.0), budget=3)
    try:
        with torch.no_grad():
            logits = model(**inp).logits[0, -1]
        rows = model.vlm_prune.last_rows[0]
        out = [r["tokens_out"][0] for r in model.vlm_prune.last_stats["stages"] if r["stage"] == "llm"]
    finally:
        vlm_prune.unwrap(model)
    assert rows[rows >= 0].tolist() == rows_exp and out[-1] == 3 and min(out[:-1]) > 3  # adaptive, then the target
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
