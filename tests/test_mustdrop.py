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

import pytest
import torch

import tiny_models as T
import vlm_prune
from test_fidelity_llm import inp, model  # noqa: F401 - the eager tiny LLaVA and its batch-1 input (fixtures)
from test_fidelity_llm import attention_probs, hidden_entering, image_rows, last_logits, lm_of, run_layers
from vlm_prune.kv_cache import segments_of
from vlm_prune.methods import MustDrop
from vlm_prune.methods.mustdrop import dual_attention_keep, dual_attention_scores

LAYERS = [0, 2, 3]  # scoring layers of the 6-layer tiny Llama (rows drop after each)
#: the tiny model's text rows spread their attention almost evenly (each image token gets 1/16 of the
#: total, peaks 0.049 - 0.051): a high global threshold leaves the peak criterion to decide, which drops
#: about half of the tokens in the first stage
THRESHOLDS = dict(global_thr=0.5, individual_thr=0.0502)


def official_mustdrop(model, inp, layers, global_thr, individual_thr, renumber=True, counts=None, seen=None):
    """(last-row logits, kept input rows after each stage) of the official prefill loop, re-stated.
    ``counts``: keep that many image tokens per stage by the filter's score instead (the budget
    generalisation). ``seen`` collects (rows entering each layer [S_l, D], their positions, input rows)."""
    lm = lm_of(model)
    h = hidden_entering(model, inp, 0)
    rows = torch.arange(h.shape[0])
    pos = rows.clone()
    img = set(image_rows(inp).tolist())
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
                top = v[~drop]
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
    gen, stats = run_wrapped(model, inp, MustDrop(layers=LAYERS, positions=positions, **THRESHOLDS),
                             **({"keep": 0.25} if budget else {}))
    assert [s["tokens_out"][0] for s in stats["stages"]] == counts and stats["visual_tokens_out"] == counts[-1:]
    torch.testing.assert_close(gen.scores[0][0], expected, atol=1e-5, rtol=0)
    token = int(gen.sequences[0, inp["input_ids"].shape[1]])
    step = official_decode_step(model, token, seen, LAYERS[0], kept[-1], renumber)
    torch.testing.assert_close(gen.scores[1][0], step, atol=1e-5, rtol=0)
    # the decode stage matters: without it the first decode step attends to every row each layer kept
    off, _ = run_wrapped(model, inp, MustDrop(layers=LAYERS, positions=positions, decode=False, **THRESHOLDS),
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
    vlm_prune.wrap(model, MustDrop(layers=[1, 2, 3]), keep=0.25)
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
])
def test_refusals(knob, value, message):
    with pytest.raises(ValueError, match=message):
        MustDrop(**{knob: value})


def test_layers_past_the_model_are_refused(model):
    with pytest.raises(ValueError, match="only 6 decoder layers"):  # at wrap time, not at the first call
        vlm_prune.wrap(model, MustDrop(layers=[1, 5]))
    assert not hasattr(model, "vlm_prune")
