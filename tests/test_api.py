"""wrap() / unwrap() behaviour: errors, pass-through, budgets, stats, FastV side scores."""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.methods import FastV


@pytest.fixture(scope="module")
def llava():
    return T.tiny_llava()


@pytest.fixture(scope="module")
def llava_eager():
    return T.tiny_llava(attn="eager")


def test_available_methods_lists_every_stage():
    names = vlm_prune.available_methods()
    for n in ("random", "pool", "fastv", "pact", "adaptinfer", "visionzip", "divprune", "cdpruner",
              "quota", "keyscore", "uniform", "asvit", "tome"):
        assert n in names


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "fastvv", "keep": 0.5}, "Did you mean 'fastv'"),
    ({"method": "random", "keep": 0.0}, "keep must be a fraction in (0, 1]"),
    ({"method": "random", "keep": 1.5}, "keep must be a fraction in (0, 1]"),
    ({"method": "random", "budget": 0}, "budget must be a whole number of tokens >= 1"),
    ({"method": "random", "keep": 0.5, "budget": 8}, "not both"),
    ({"method": "random"}, "pass keep="),
    ({"method": ["random", "pool"], "keep": 0.5}, "at most one method per stage"),
    ({"method": "quota", "keep": 0.5}, "does not offer"),
    ({"method": None}, "no method given"),
])
def test_bad_arguments_name_the_fix(llava, kwargs, message):
    method = kwargs.pop("method")
    with pytest.raises(ValueError, match=None) as err:
        vlm_prune.wrap(llava, method, **kwargs)
    assert message in str(err.value)
    assert not hasattr(llava, "vlm_prune")


@pytest.mark.parametrize("method, knobs, message", [
    ("fastv", {"layr": 2}, "'layr' (did you mean 'layer'?). A method's knobs go to the method object: "
                           "vlm_prune.wrap(model, vlm_prune.methods.FastV(layer=2), ...) (knobs of fastv: layer, query)"),
    ("fastv", {"layer": 2}, "vlm_prune.wrap(model, vlm_prune.methods.FastV(layer=2), ...)"),
    (["random", "pact"], {"cutof": 0.2}, "(did you mean 'cutoff'?). A method's knobs go to the method object: "
                                         "vlm_prune.wrap(model, vlm_prune.methods.PACT(cutoff=0.2), ...)"),
    ("fastv", {"kep": 0.3}, "(did you mean 'keep'?)"),
])
def test_a_method_knob_given_to_wrap_names_the_method_object(llava, method, knobs, message):
    """wrap() takes no method knobs: the TypeError says where they go, with the closest knob name."""
    with pytest.raises(TypeError) as err:
        vlm_prune.wrap(llava, method, keep=0.3, **knobs)
    assert message in str(err.value) and "wrap() itself takes keep, budget" in str(err.value)
    assert not hasattr(llava, "vlm_prune")
    if "layer" in message:  # the suggested spelling wraps
        vlm_prune.unwrap(vlm_prune.wrap(llava, FastV(layer=2), keep=0.3))


@pytest.mark.parametrize("method, message", [
    (vlm_prune.methods.FastV(layer=6), "FastV layer K=6 but the model has only 6 decoder layers; pass layer= below 6"),
    ("pact", None),
    (vlm_prune.methods.PACT(layer=7), "PACT layer L=7 but the model has only 6 decoder layers; pass layer= below 6"),
    (vlm_prune.methods.PyramidDrop(layers=(2, 6)), "PyramidDrop drops before layers [2, 6], but the model has only 6 "
                                                   "decoder layers; pass layers= below 6"),
])
def test_a_layer_beyond_the_model_is_refused_at_wrap_time(llava, method, message):
    """An llm-stage layer the language model does not have fails wrap() (not the first call), with
    the method's message, and leaves the model as it was; a layer inside it wraps."""
    forward = llava.model.language_model.forward
    if message is None:  # PACT's default L=4 lies inside the 6 layers
        vlm_prune.unwrap(vlm_prune.wrap(llava, method, keep=0.5))
        return
    with pytest.raises(ValueError) as err:
        vlm_prune.wrap(llava, method, keep=0.5)
    assert message in str(err.value)
    assert not hasattr(llava, "vlm_prune") and llava.model.language_model.forward == forward


def test_wrap_twice_and_unwrap_unwrapped(llava):
    vlm_prune.wrap(llava, "random", keep=0.5)
    try:
        with pytest.raises(RuntimeError, match="unwrap"):
            vlm_prune.wrap(llava, "pool", keep=0.5)
    finally:
        vlm_prune.unwrap(llava)
    with pytest.raises(ValueError, match="not wrapped"):
        vlm_prune.unwrap(llava)


def test_unsupported_model_names_supported_classes():
    with pytest.raises(TypeError, match="LlavaForConditionalGeneration"):
        vlm_prune.wrap(torch.nn.Linear(2, 2), "random", keep=0.5)


def test_text_only_request_passes_through(llava):
    ids = torch.randint(3, 80, (2, 9))
    with torch.no_grad():
        ref = llava(input_ids=ids).logits
        ref_gen = llava.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    vlm_prune.wrap(llava, ["random", "fastv"], keep=0.25)
    try:
        with torch.no_grad():
            out = llava(input_ids=ids).logits
            gen = llava.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        assert llava.vlm_prune.last_stats["visual_tokens_in"] == [0, 0]
    finally:
        vlm_prune.unwrap(llava)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)


@pytest.mark.parametrize("method", ["random", "pool", "fastv", "divprune"])
def test_budget_above_the_visual_count_keeps_all(llava, method):
    inp = T.llava_inputs()
    with torch.no_grad():
        ref = llava(**inp).logits
    vlm_prune.wrap(llava, method, budget=1000)
    try:
        with torch.no_grad():
            out = llava(**inp).logits
        stats = llava.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(llava)
    valid = inp["attention_mask"].bool()
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=0)
    assert stats["visual_tokens_out"] == [16, 16]


def test_last_rows_mark_padding_even_when_nothing_is_pruned(llava):
    inp = T.llava_inputs(pad="left")
    vlm_prune.wrap(llava, "fastv", keep=1.0)
    try:
        with torch.no_grad():
            llava(**inp)
        rows = llava.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(llava)
    valid = inp["attention_mask"].bool()
    expected = torch.where(valid, torch.arange(valid.shape[1]), -1)
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("method, kw, expected", [
    ("random", {"keep": 0.25}, 4),
    ("pool", {"keep": 0.25}, 4),
    ("pool", {"budget": 9}, 9),
    ("fastv", {"keep": 0.5}, 8),
    ("fastv", {"budget": 3}, 3),
])
def test_last_stats_report_real_counts(llava, method, kw, expected):
    inp = T.llava_inputs()
    vlm_prune.wrap(llava, method, **kw)
    try:
        with torch.no_grad():
            out = llava(**inp).logits
        stats = llava.vlm_prune.last_stats
        rows = llava.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(llava)
    assert stats["visual_tokens_in"] == [16, 16]
    assert stats["visual_tokens_out"] == [expected, expected]
    (stage,) = stats["stages"]
    assert stage["method"] == method and stage["tokens_out"] == [expected, expected]
    assert stage["seconds"] >= 0 and stage["cpu_seconds"] >= 0
    # the rows the model really ran: every text token plus exactly the kept image tokens
    ids = inp["input_ids"]
    for b in range(2):
        kept = rows[b][rows[b] >= 0]
        assert int((ids[b, kept] == T.IMAGE_TOKEN).sum()) == expected
        assert int(inp["attention_mask"][b].sum()) - 16 + expected == kept.numel()
    assert out.shape[1] == rows.shape[1]


def test_summary_reads_last_stats_on_one_screen(llava):
    """summary(): the pipeline, tokens in -> out per sample with the kept fraction and layer average,
    one line per stage with its own counts and scoring time, the total, and the budget notes."""
    import re

    model = vlm_prune.wrap(llava, ["random", "fastv"], keep=0.25)
    try:
        assert model.vlm_prune.summary() == ("vlm_prune on llava: random (vision) -> fastv (llm)\n"
                                             "no request yet in this thread (last_stats is empty)")
        with torch.no_grad():
            model.generate(**T.llava_inputs(), max_new_tokens=2)
        stats = model.vlm_prune.last_stats
        lines = model.vlm_prune.summary().splitlines()
    finally:
        vlm_prune.unwrap(model)
    assert stats["visual_tokens_in"] == [16, 16] and stats["visual_tokens_out"] == [4, 4]
    assert lines[:2] == ["vlm_prune on llava: random (vision) -> fastv (llm)",
                         "visual tokens per sample: 16, 16 -> 4, 4 (25.0% kept); layer average 5.3, 5.3"]
    assert re.fullmatch(r"  vision  random    images           16, 16 -> 8, 8    50\.0% +[0-9.]+ ms", lines[2])
    assert re.fullmatch(r"  llm     fastv     layer 2          8, 8 -> 4, 4      50\.0% +[0-9.]+ ms", lines[3])
    seconds = [float(line.split()[-2]) for line in lines[2:4]]
    assert seconds == [round(1000 * r["seconds"], 1) for r in stats["stages"]]
    assert lines[4] == f"scoring: {1000 * stats['seconds']:.1f} ms ({1000 * stats['cpu_seconds']:.1f} ms CPU)"
    assert len(lines) == 5
    ov = vlm_prune.wrap(T.tiny_onevision(), "uniform", keep=0.5)  # a frames method on images: a budget note
    try:
        with pytest.warns(vlm_prune.methods.base.BudgetWarning) as caught, torch.no_grad():
            ov(**T.onevision_image_inputs(ov))
        lines = ov.vlm_prune.summary().splitlines()
    finally:
        vlm_prune.unwrap(ov)
    assert lines[1] == "visual tokens per sample: 32, 32 -> 32, 32 (100.0% kept); layer average 32, 32"
    assert lines[2].startswith("  frames  uniform   skipped (images) 32, 32 -> 32, 32 100.0%")
    assert lines[-1] == f"note: {caught[0].message}"


def test_pipeline_budget_is_the_final_count(llava):
    """keep=0.5 over two stages: the first keeps round(16 * 0.5 ** (1/2)) = 11, the last ends at 8."""
    inp = T.llava_inputs()
    vlm_prune.wrap(llava, ["random", "fastv"], keep=0.5)
    try:
        with torch.no_grad():
            llava(**inp)
        stats = llava.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(llava)
    stages = stats["stages"]
    assert [s["stage"] for s in stages] == ["vision", "llm"]
    assert stages[0]["tokens_out"] == [11, 11] and stages[1]["tokens_out"] == [8, 8]
    assert stats["visual_tokens_out"] == [8, 8]
    # 6 decoder layers: layers 0-1 see the 11 random survivors, layers 2-5 FastV's 8
    assert stats["visual_tokens_layer_avg"] == [pytest.approx((2 * 11 + 4 * 8) / 6)] * 2


@pytest.mark.parametrize("query", ["last", "text"])
def test_fastv_side_scores_equal_eager_attention(llava_eager, query):
    """FastV's attention rows computed from q/k equal the eager attention weights of layer K-1."""
    inp = T.llava_inputs()
    with torch.no_grad():
        att = llava_eager(**inp, output_attentions=True).attentions[1]  # layer K-1 = 1, [B, H, S, S]
    captured = {}

    class Recording(FastV):
        def scores(self, ctx):
            captured["scores"] = super().scores(ctx)
            captured["text"] = ctx.text
            return captured["scores"]

    vlm_prune.wrap(llava_eager, Recording(layer=2, query=query), keep=0.5)
    try:
        with torch.no_grad():
            llava_eager(**inp)
    finally:
        vlm_prune.unwrap(llava_eager)
    valid = inp["attention_mask"].bool()
    head_mean = att.mean(1)
    if query == "last":
        expected = head_mean[:, -1]
    else:
        t = captured["text"].float()
        expected = (head_mean * t[:, :, None]).sum(1) / t.sum(1, keepdim=True)
    torch.testing.assert_close(captured["scores"][valid], expected[valid], atol=1e-5, rtol=0)


def test_accelerate_hooks_stay_in_front_and_unwrap_keeps_them():
    """Modules hooked by accelerate (device_map="auto" models) are patched behind their hook:
    pruning runs, identity holds, and unwrap leaves the hooks in place."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    model = T.tiny_llava()
    hooked = [model.model.language_model, model.model, model.model.language_model.layers[0]]
    for module in hooked:
        accelerate_hooks.add_hook_to_module(module, accelerate_hooks.AlignDevicesHook(execution_device="cpu",
                                                                                     io_same_device=True))
    inp = T.llava_inputs()
    valid = inp["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**inp).logits
    vlm_prune.wrap(model, ["random", vlm_prune.methods.FastV(keep=1.0)], keep=1.0)
    try:
        with torch.no_grad():
            out = model(**inp).logits
        assert [s["stage"] for s in model.vlm_prune.last_stats["stages"]] == ["vision", "llm"]
        vlm_prune.unwrap(model)
        vlm_prune.wrap(model, "fastv", keep=0.25)
        with torch.no_grad():
            model(**inp)
        assert model.vlm_prune.last_stats["visual_tokens_out"] == [4, 4]
    finally:
        vlm_prune.unwrap(model)
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=0)
    with torch.no_grad():
        assert torch.equal(model(**inp).logits, ref)
    assert all(hasattr(m, "_hf_hook") and "_old_forward" in vars(m) for m in hooked)
