"""DESIGN.md invariants 1-5 for every adapter, on tiny random models from the real configs."""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import tiny_models_llavalike as L
import tiny_models_qwen3 as Q
import vlm_prune
from vlm_prune.frames.holitom import HoliTom
from vlm_prune.frames.prunevid import PruneVid
from reference import (capture_lm_inputs, injection_kwargs, injections_of, language_model_of, masked_llm_reference,
                       multi_axis, positions_of, recording)

CASES = {
    "llava": (T.tiny_llava, lambda m, **k: T.llava_inputs(**k), {}),
    "llava_next": (T.tiny_llava_next, T.llava_next_inputs, {}),
    "onevision_image": (T.tiny_onevision, T.onevision_image_inputs, {}),
    "onevision_video": (T.tiny_onevision, T.onevision_video_inputs, {}),
    "qwen2_vl_image": (T.tiny_qwen2_vl, T.qwen2_vl_inputs, {}),
    "qwen2_vl_video": (T.tiny_qwen2_vl, T.qwen2_vl_inputs, {"video": True}),
    "qwen2_5_vl": (lambda attn="sdpa": T.tiny_qwen2_vl(attn, v25=True), T.qwen2_vl_inputs, {}),
    "qwen2_5_vl_video": (lambda attn="sdpa": T.tiny_qwen2_vl(attn, v25=True), T.qwen2_vl_inputs, {"video": True}),
    "mistral3": (L.tiny_mistral3, L.mistral3_inputs, {}),
    "internvl": (L.tiny_internvl, L.internvl_inputs, {}),
    "nextvideo_image": (L.tiny_llava_next_video, L.llava_next_video_image_inputs, {}),
    "nextvideo_video": (L.tiny_llava_next_video, L.llava_next_video_inputs, {}),
    "gemma3": (L.tiny_gemma3, L.gemma3_inputs, {}),
    "ov15_image": (L.tiny_onevision15, L.onevision15_inputs, {}),
    "ov15_video": (L.tiny_onevision15, L.onevision15_inputs, {"video": True}),
    "qwen3_vl_image": (Q.tiny_qwen3_vl, Q.qwen3_vl_inputs, {}),
    "qwen3_vl_video": (Q.tiny_qwen3_vl, Q.qwen3_vl_inputs, {"video": True}),
    "qwen3_vl_moe": (lambda attn="sdpa": Q.tiny_qwen3_vl(attn, moe=True), Q.qwen3_vl_inputs, {}),
    "glm4v_image": (Q.tiny_glm4v, Q.glm4v_inputs, {}),
    "glm4v_video": (Q.tiny_glm4v, Q.glm4v_inputs, {"video": True}),
    "qwen3_5_image": (Q.tiny_qwen3_5, Q.qwen3_vl_inputs, {}),
    "qwen3_5_video": (Q.tiny_qwen3_5, Q.qwen3_vl_inputs, {"video": True}),
    "qwen3_5_moe": (lambda attn="sdpa": Q.tiny_qwen3_5(attn, moe=True), Q.qwen3_vl_inputs, {}),
    "glm4v_moe": (lambda attn="sdpa": Q.tiny_glm4v(attn, variant="4.5"), Q.glm4v_inputs, {}),
    "glm46v": (lambda attn="sdpa": Q.tiny_glm4v(attn, variant="4.6"), Q.glm4v_inputs, {}),
    "smolvlm": (L.tiny_smolvlm, L.smolvlm_inputs, {}),
    "idefics3": (L.tiny_idefics3, L.smolvlm_inputs, {}),
    "videollama3": (L.tiny_videollama3, L.videollama3_inputs, {}),
}
_MODELS: dict = {}


def build(case: str, attn: str = "sdpa"):
    key = (case.split("_image")[0].split("_video")[0], attn)
    make, inputs, kw = CASES[case]
    if key not in _MODELS:
        _MODELS[key] = make(attn=attn)
    model = _MODELS[key]
    return model, (lambda pad="left", batch=2: inputs(model, pad=pad, batch=batch, **kw))


def run(model, inp, steps=20):
    with torch.no_grad():
        logits = model(**inp).logits
        gen = model.generate(**inp, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return logits, gen


def pruned_prefill(model, method, inp, **kw):
    """(logits, last_rows) of one prefill of ``model`` wrapped with ``method``; unwrapped after."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            logits = model(**inp).logits
        return logits, model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)


def assert_kept_rows_equal(logits, rows, ref):
    """The pruned logits equal the full-sequence reference at the rows each sample kept."""
    for i in range(logits.shape[0]):
        kept = rows[i] >= 0
        torch.testing.assert_close(logits[i, kept], ref[i, rows[i][kept]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_identity_when_everything_is_kept(case, attn):
    """Invariant 1: keep=1.0 equals the unwrapped model: prefill (left and right padding) and a
    20-step greedy generate, called twice on the same wrapped model; vision and llm stages."""
    model, make = build(case, attn)
    for pad, methods, steps in (("left", ["random", "fastv"], 20), ("right", ["pool", "fastv"], 1)):
        inp = make(pad=pad)
        valid = inp["attention_mask"].bool()
        ref_logits, ref_gen = run(model, inp, steps=steps)
        vlm_prune.wrap(model, methods, keep=1.0)
        try:
            if "llm" in model.vlm_prune.methods:
                model.vlm_prune.methods["llm"].keep = 1.0
            logits, gen = run(model, inp, steps=steps)
            _, gen2 = run(model, inp, steps=steps)
            stats = model.vlm_prune.last_stats
        finally:
            vlm_prune.unwrap(model)
        torch.testing.assert_close(logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
        assert torch.equal(gen, ref_gen) and torch.equal(gen2, ref_gen), (methods, pad)
        assert stats["visual_tokens_out"] == stats["visual_tokens_in"]
        assert [r["stage"] for r in stats["stages"]] == ["vision", "llm"][: len(methods)]


@pytest.mark.parametrize("case", list(CASES))
def test_unwrap_restores_bit_identical(case):
    """Invariant 5: after unwrap, outputs and instance attributes are exactly as before."""
    model, make = build(case)
    inp = make()
    modules = list(model.modules())
    ref, ref_gen = run(model, inp, steps=5)  # transformers installs its own hooks on first use
    before = [set(vars(m)) for m in modules]
    vlm_prune.wrap(model, ["random", "fastv"], keep=0.5)
    run(model, inp, steps=5)
    vlm_prune.unwrap(model)
    out, gen = run(model, inp, steps=5)
    assert torch.equal(out, ref) and torch.equal(gen, ref_gen)
    assert [set(vars(m)) for m in modules] == before
    assert not hasattr(model, "vlm_prune")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method, attn", [("random", "sdpa"), ("pool", "sdpa"), ("random", "eager")])
def test_vision_stage_equals_hand_built_input(case, method, attn):
    """Invariant 2: a vision-stage reduction equals the unwrapped model run on only the kept
    tokens (reduced features in place) at their original position ids, per sample alone."""
    model, make = build(case, attn)
    inp = make()
    vlm_prune.wrap(model, method, keep=0.5)
    try:
        with torch.no_grad(), capture_lm_inputs(model) as seen:
            logits = model(**inp).logits
        rows = model.vlm_prune.last_rows
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    assert all(o < i for i, o in zip(stats["visual_tokens_in"], stats["visual_tokens_out"]))
    embeds = seen[0]["inputs_embeds"]  # reduced features already in their slots
    b, s, _ = embeds.shape
    pos = positions_of(seen[0], b, s)
    inject = injections_of(seen[0])  # Qwen3-VL's DeepStack additions, for the kept rows only
    lm = language_model_of(model)
    for i in range(b):
        keep = rows[i][rows[i] >= 0]
        p = pos[:, i : i + 1, keep]
        p = p if multi_axis(model) else p[0]
        short = dict(inputs_embeds=embeds[i : i + 1, keep], position_ids=p,
                     attention_mask=torch.ones(1, keep.numel(), dtype=torch.long),
                     **injection_kwargs(inject and (inject[0][i : i + 1], inject[1][:, i : i + 1]), keep[None]))
        with torch.no_grad():
            if "token_type_ids" in inp:  # Gemma 3: the model's own bidirectional image mask over the kept rows
                h = model.model(token_type_ids=inp["token_type_ids"][i : i + 1, keep], **short).last_hidden_state
            else:
                h = lm(**short).last_hidden_state
            ref = model.lm_head(h)[0]
        torch.testing.assert_close(logits[i, rows[i] >= 0], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["llava", "llava_next", "onevision_video", "qwen2_vl_image", "qwen2_5_vl",
                                  "mistral3", "internvl", "nextvideo_video", "gemma3", "ov15_video",
                                  "qwen3_vl_image", "qwen3_vl_video", "qwen3_vl_moe", "glm4v_image", "glm4v_video",
                                  "smolvlm", "idefics3", "videollama3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llm_stage_equals_masked_reference(case, attn):
    """Invariant 3: FastV's in-LLM removal equals the full sequence with the removed tokens
    masked as keys from layer K on."""
    model, make = build(case, attn)
    inp = make()
    logits, rows = pruned_prefill(model, vlm_prune.methods.FastV(layer=2), inp, keep=0.25)
    b, s = inp["input_ids"].shape
    kept = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        kept[i, rows[i][rows[i] >= 0]] = True
    assert_kept_rows_equal(logits, rows, masked_llm_reference(model, inp, 2, kept))


@pytest.mark.parametrize("case, method", [
    *[(case, method) for method in ("random", "fastv", "dart", "pdrop", "sparsevlm", "mustdrop") for case in CASES],
    *[(case, method) for case in ("llava", "onevision_video") for method in ("fastervlm", "vispruner", "divprune")],
    *[(case, "hired") for case in ("llava", "llava_next", "nextvideo_image")], ("llava", "prumerge"),
    *[(case, "framefusion") for case in ("onevision_video", "qwen2_vl_video", "nextvideo_video", "ov15_video",
                                         "qwen3_vl_video", "qwen3_5_video")],
    *[pytest.param(case, PruneVid(layer=2, tau=0.5), id=f"{case}-prunevid")  # frames merge + llm selection
      for case in ("onevision_video", "qwen2_vl_video", "nextvideo_video", "ov15_video", "qwen3_vl_video", "glm4v_video",
                   "qwen3_5_video")],
    *[(case, "fastvid") for case in ("onevision_video", "qwen2_vl_video", "qwen2_5_vl_video")],  # the tower's salience
    *[pytest.param(case, HoliTom(layer=2), id=f"{case}-holitom")  # outer stage + inner merge
      for case in ("onevision_video", "qwen2_vl_video", "qwen2_5_vl_video")],
])
def test_batch_equals_samples_alone(case, method):
    """Invariant 4: each sample of a padded batch equals that sample run alone (prefill and
    10-step generate)."""
    model, make = build(case)
    inp = make()
    if method == "framefusion":  # a threshold these random models reach: merges over several layers, the
        # samples of a batch merging and pruning at different layers
        from vlm_prune.methods.framefusion import FrameFusion

        method = FrameFusion(similarity=0.2)
    vlm_prune.wrap(model, method, keep=0.3)
    try:
        logits, gen = run(model, inp, steps=10)
        rows = model.vlm_prune.last_rows
        for i in range(inp["input_ids"].shape[0]):
            valid = inp["attention_mask"][i].bool()
            alone = {}
            for k, v in inp.items():
                if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"):
                    alone[k] = v[i : i + 1, valid]
                elif k in ("pixel_values", "pixel_values_videos") and "image_grid_thw" not in inp and "video_grid_thw" not in inp:
                    alone[k] = v[i : i + 1]
                elif k.endswith("grid_thw"):
                    alone[k] = v[i : i + 1]
                elif k in ("pixel_values", "pixel_values_videos"):
                    sizes = inp[("video" if "video" in k else "image") + "_grid_thw"].prod(-1)  # patches per image
                    start = int(sizes[:i].sum())
                    alone[k] = v[start : start + int(sizes[i])]
                else:
                    alone[k] = v[i : i + 1]
            l1, g1 = run(model, alone, steps=10)
            torch.testing.assert_close(logits[i, -1], l1[0, -1], atol=1e-5, rtol=0)
            pad = int((~valid).sum())
            assert torch.equal(gen[i, pad:], g1[0]), case
            assert rows[i][rows[i] >= 0].numel() == l1.shape[1]
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("case", ["llava", "onevision_video", "qwen2_vl_image", "mistral3", "gemma3",
                                  "qwen3_vl_image", "glm4v_image", "smolvlm"])
def test_pact_merging_equals_masked_reference_with_log_size_bias(case):
    """Invariant 3 with merges: PACT's clusters (mean hidden state at the centre, log cluster
    size added to that key's logits in every later layer) equal the full-sequence reference;
    batch 2 with a different number of clusters per sample."""
    from vlm_prune.methods.pact import PACT

    model, make = build(case, "sdpa")
    inp = make()
    method = recording(PACT, layer=2, rho=0.75, cutoff=0.6)
    logits, rows = pruned_prefill(model, method, inp)
    seen = method.seen
    b, s = inp["input_ids"].shape
    d = model.config.text_config.hidden_size
    kept = torch.zeros(b, s, dtype=torch.bool)
    centre = torch.zeros(b, s, dtype=torch.bool)
    feats = torch.zeros(b, s, d)
    sizes = torch.ones(b, s)
    for i, red in enumerate(seen["reds"]):
        origin = seen["origin"][i][red.indices]
        kept[i, origin] = True
        if red.features is not None:
            centre[i, origin] = True
            feats[i, origin] = red.features.float()
        if red.sizes is not None:
            sizes[i, origin] = red.sizes.float()
    assert (sizes > 1).any(), "the test needs at least one real merge"
    n_clusters = [(sizes[i] > 1).sum().item() for i in range(b)]
    assert_kept_rows_equal(logits, rows, masked_llm_reference(model, inp, 2, kept, merged=(centre, feats, sizes)))
    if case == "qwen2_vl_image":  # these inputs give the two samples different cluster counts
        assert n_clusters[0] != n_clusters[1]
