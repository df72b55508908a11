"""The wrapper under real use: numpy / torch scalars, threads, failures, generate() paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.adapters import hf_vlm
from vlm_prune.methods import FastV
from vlm_prune.methods.base import validate_budget


@pytest.mark.parametrize("keep, budget, expected", [
    (np.float32(0.5), None, (0.5, None)),
    (np.float64(1.0), None, (1.0, None)),
    (torch.tensor(0.25), None, (0.25, None)),
    (None, np.int64(4), (None, 4)),
    (None, torch.tensor(4), (None, 4)),
])
def test_numpy_and_torch_scalars_are_accepted(keep, budget, expected):
    out = validate_budget(keep, budget, required=True)
    assert out == expected and all(v is None or type(v) in (int, float) for v in out)


@pytest.mark.parametrize("keep, budget, message", [
    (np.float32(1.5), None, "keep must be a fraction in (0, 1], got 1.5"),
    (None, np.float64(4.0), "budget must be a whole number"),
    (torch.tensor([0.5, 0.5]), None, "keep must be a fraction"),
])
def test_bad_scalars_still_name_the_rule(keep, budget, message):
    with pytest.raises(ValueError) as err:
        validate_budget(keep, budget, required=True)
    assert message in str(err.value)


def test_wrap_with_numpy_budget_equals_python_budget():
    model = T.tiny_llava()
    inputs = T.llava_inputs()
    outs = []
    for budget in (4, np.int64(4)):
        vlm_prune.wrap(model, "fastv", budget=budget)
        try:
            with torch.no_grad():
                outs.append(model(**inputs).logits)
            assert model.vlm_prune.last_stats["visual_tokens_out"] == [4, 4]
        finally:
            vlm_prune.unwrap(model)
    assert torch.equal(outs[0], outs[1])


# ---- request-scoped state: threads and failures ---------------------------------------------------
def _batches(make_inputs, sizes=(1, 2, 3)) -> list[dict]:
    return [make_inputs(batch=b, seed=10 + b) for b in sizes]


def _llava_case():
    model = T.tiny_llava()
    return model, ["random", "fastv"], dict(keep=0.5), _batches(lambda batch, seed: T.llava_inputs(batch=batch, seed=seed))


def _qwen_case():
    model = T.tiny_qwen2_vl()
    return model, ["divprune", "pact"], dict(keep=0.5), _batches(lambda batch, seed: T.qwen2_vl_inputs(model, batch=batch, seed=seed))


def _vit_case():
    from test_vit import images, tiny_vit

    return tiny_vit(depth=4), "tome", dict(keep=0.5), [images(b, seed=10 + b) for b in (1, 2, 3)]


def _call(model, inputs):
    with torch.no_grad():
        if isinstance(inputs, torch.Tensor):
            return model(inputs)
        return model.generate(**inputs, max_new_tokens=3, do_sample=False)


def _stats_and_rows(model):
    rows = model.vlm_prune.last_rows
    return model.vlm_prune.last_stats, None if rows is None else rows.clone()


def _same_stats(a, b) -> bool:
    timers = ("seconds", "cpu_seconds")
    strip = lambda s: {k: ([{kk: vv for kk, vv in r.items() if kk not in timers} for r in v] if k == "stages" else v)
                       for k, v in s.items() if k not in timers}
    return strip(a) == strip(b)


@pytest.mark.parametrize("case", [_llava_case, _qwen_case, _vit_case], ids=["llava", "qwen2_vl", "timm_vit"])
def test_threads_share_one_wrapped_model(case):
    """4 threads x many calls on one wrapped model give the serial outputs and each thread's own
    last_stats / last_rows."""
    import threading

    model, method, kw, inputs = case()
    vlm_prune.wrap(model, method, **kw)
    serial = []
    for inp in inputs:
        out = _call(model, inp)
        serial.append((out, *_stats_and_rows(model)))
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def worker(t: int) -> None:
        barrier.wait()
        for step in range(6):
            i = (t + step) % len(inputs)
            try:
                out = _call(model, inputs[i])
                stats, rows = _stats_and_rows(model)
            except Exception as e:  # reported below with the thread and call
                errors.append(f"thread {t} call {step}: {type(e).__name__}: {e}")
                continue
            ref_out, ref_stats, ref_rows = serial[i]
            if not torch.equal(out, ref_out):
                errors.append(f"thread {t} call {step}: output differs from the serial run")
            if not _same_stats(stats, ref_stats) or (ref_rows is not None and not torch.equal(rows, ref_rows)):
                errors.append(f"thread {t} call {step}: last_stats / last_rows are not this call's")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    vlm_prune.unwrap(model)
    assert not errors, errors[:5]


class Boom(RuntimeError):
    pass


def _fail_once(monkeypatch, obj, name):
    original = getattr(obj, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom(f"injected in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, failing)


@pytest.mark.parametrize("where", ["method", "request_setup", "tower"])
def test_a_failed_request_leaves_nothing_behind(monkeypatch, where):
    """An exception inside a method or inside request setup, then ordinary calls: every output
    equals a fresh wrap of the same model."""
    method = {"method": ["random", "fastv"], "request_setup": ["random", "fastv"], "tower": ["tome", "fastv"]}[where]
    inputs = T.llava_inputs(batch=2)
    text = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(3))

    def ordinary_calls(m):
        with torch.no_grad():
            embeds = m.get_input_embeddings()(text)
            return (_call(m, inputs), m(**inputs).logits, m(inputs_embeds=embeds).logits,
                    m(**T.llava_inputs(batch=1, seed=4)).logits)

    fresh = vlm_prune.wrap(T.tiny_llava(), method, keep=0.5)
    expected = ordinary_calls(fresh)
    model = vlm_prune.wrap(T.tiny_llava(), method, keep=0.5)
    state = model.vlm_prune
    if where == "method":
        _fail_once(monkeypatch, state.methods["llm"], "select")
    elif where == "request_setup":
        _fail_once(monkeypatch, state.adapter, "sample_of_items")
    else:
        _fail_once(monkeypatch, state.methods["vit"], "run_block")
    with pytest.raises(Boom):
        _call(model, inputs)
    got = ordinary_calls(model)
    assert torch.equal(got[0], expected[0])
    for g, e in zip(got[1:], expected[1:]):
        assert torch.allclose(g, e, atol=1e-6, rtol=0)
    assert state.adapter.request is None and not state.adapter.bypassed


# ---- copies, counting, embeddings, labels, refusals -----------------------------------------------
def test_deepcopy_is_an_independent_wrapped_model():
    import copy

    model = vlm_prune.wrap(T.tiny_llava(), ["random", "fastv"], keep=0.5)
    inputs = T.llava_inputs()
    with torch.no_grad():
        before = model(**inputs).logits
        clone = copy.deepcopy(model)
        assert clone.vlm_prune is not model.vlm_prune and clone.vlm_prune.adapter.model is clone
        assert torch.equal(clone(**inputs).logits, before)
        assert clone.vlm_prune.last_stats["visual_tokens_out"] == model.vlm_prune.last_stats["visual_tokens_out"]
        for p in clone.parameters():  # the copy runs its own weights, the original its own
            p.add_(0.01)
        assert torch.equal(model(**inputs).logits, before)
        assert not torch.allclose(clone(**inputs).logits, before)
    vlm_prune.unwrap(clone)
    vlm_prune.unwrap(model)


@pytest.mark.parametrize("method", ["random", "divprune", "fastv", "pdrop"])
def test_deepcopy_of_a_wrapped_gemma3(method):
    """Gemma 3's adapter patches its text model's forward over the shared path's patch: the copy
    gets the forward it had before wrap() (not the original's pruned decoder, whose per-request
    slots cannot be copied), answers as the original, and runs its own weights."""
    import copy

    import tiny_models_llavalike as L

    model = vlm_prune.wrap(L.tiny_gemma3(), method, keep=0.5)
    inputs = L.gemma3_inputs(model)
    with torch.no_grad():
        before = model(**inputs).logits
        clone = copy.deepcopy(model)
        assert clone.vlm_prune.adapter.model is clone and clone.vlm_prune.adapter.decoder is not model.vlm_prune.adapter.decoder
        assert torch.equal(clone(**inputs).logits, before)
        assert clone.vlm_prune.last_stats["visual_tokens_out"] == model.vlm_prune.last_stats["visual_tokens_out"]
        for p in clone.parameters():
            p.add_(0.01)
        assert torch.equal(model(**inputs).logits, before)
        assert not torch.allclose(clone(**inputs).logits, before)
    vlm_prune.unwrap(clone)
    unwrapped = copy.deepcopy(L.tiny_gemma3())  # same seed: the original's weights
    with torch.no_grad():
        assert torch.equal(vlm_prune.unwrap(model)(**inputs).logits, unwrapped(**inputs).logits)


def test_deepcopy_never_changes_the_original_while_another_thread_generates():
    """Issue 27: deepcopy used to unwrap the original for the copy's duration, so a thread generating
    meanwhile got unpruned answers. Now the original is never touched: every answer of the other
    thread equals the pruned serial answer, the original keeps its patches (the same objects) and
    hooks, and each copy is an independent wrapped model giving the same answer."""
    import copy
    import threading

    model = vlm_prune.wrap(T.tiny_llava(), "visionzip", keep=0.25)  # patches, a tower hook, the state
    inputs = T.llava_inputs()
    state, patched = model.vlm_prune, dict(vars(model))
    layer = model.vlm_prune.adapter.tap.layer
    hooks = dict(layer._forward_pre_hooks)

    def answer(m):
        with torch.no_grad():
            return m.generate(**inputs, max_new_tokens=3, do_sample=False)

    pruned = answer(model)
    unwrapped = answer(copy.deepcopy(T.tiny_llava()))
    assert not torch.equal(pruned, unwrapped)  # the other thread would notice an unwrapped original
    answers: list[torch.Tensor] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def generate_meanwhile() -> None:
        try:
            for _ in range(8):
                answers.append(answer(model))
                started.set()
        except BaseException as e:  # reported below
            errors.append(e)
            started.set()

    thread = threading.Thread(target=generate_meanwhile)
    thread.start()
    started.wait(120)
    clones = []
    while thread.is_alive() and len(clones) < 6:
        clones.append(copy.deepcopy(model))
    thread.join()
    assert not errors, errors
    assert clones and len(answers) == 8
    assert all(torch.equal(a, pruned) for a in answers), "an answer of the other thread was not pruned"
    assert model.vlm_prune is state and all(vars(model)[k] is v for k, v in patched.items())
    assert dict(layer._forward_pre_hooks) == hooks
    for clone in clones:
        assert clone.vlm_prune is not state and clone.vlm_prune.adapter.model is clone
        assert len(clone.vlm_prune.adapter.tap.layer._forward_pre_hooks) == len(hooks)
        assert torch.equal(answer(clone), pruned)
        vlm_prune.unwrap(clone)
        assert torch.equal(answer(clone), unwrapped) and not vars(clone).keys() - set(patched) - {"vlm_prune"}
        assert all(not m._forward_pre_hooks for m in clone.modules())
    vlm_prune.unwrap(model)
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("methods", ["divprune", "fastv", ["random", "fastv"]])
def test_dropped_caches_are_freed_without_the_garbage_collector(methods):
    """Issue 27: the KV cache (and the outputs) a wrapped model returns are freed by reference counting
    when the caller drops them, as the unwrapped model's are (the cache used to hold functions that
    referred to it: a cycle, alive until the cyclic garbage collector ran)."""
    import gc
    import weakref

    model = T.tiny_llava()
    inputs = T.llava_inputs()

    def alive_after_drop() -> tuple[int, int]:
        caches, logits = [], []
        for _ in range(3):
            with torch.no_grad():
                out = model(**inputs, use_cache=True)
            caches.append(weakref.ref(out.past_key_values))
            logits.append(weakref.ref(out.logits))
            del out
            with torch.no_grad():
                gen = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
            caches.append(weakref.ref(gen.past_key_values))
            del gen
        return sum(r() is not None for r in caches), sum(r() is not None for r in logits)

    gc.collect()
    gc.disable()
    try:
        assert alive_after_drop() == (0, 0)  # the unwrapped model
        vlm_prune.wrap(model, methods, keep=0.5)
        assert alive_after_drop() == (0, 0)
    finally:
        gc.enable()
        vlm_prune.unwrap(model)


def test_deepcopy_of_a_pruned_cache_speaks_for_itself():
    """A copy of a cache a pruned prefill returned (a cached prefix reused) reports and crops its own
    tokens, not the original's."""
    import copy

    model = vlm_prune.wrap(T.tiny_llava(), "fastv", keep=0.5)
    inputs = T.llava_inputs()
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = gen.past_key_values
    clone = copy.deepcopy(cache)
    n = cache.get_seq_length()
    assert clone.get_seq_length() == n and clone._vlm_prune is not cache._vlm_prune
    clone.crop(-1)
    assert (clone.get_seq_length(), cache.get_seq_length()) == (n - 1, n)
    assert clone.layers[0].keys.shape[2] == cache.layers[0].keys.shape[2] - 1
    vlm_prune.unwrap(model)


@pytest.mark.parametrize("method", ["divprune", "random", "visionzip"])
@pytest.mark.parametrize("placeholders, images", [(32, 1), (16, 2), (20, 1)])
def test_placeholders_that_do_not_match_the_images_get_transformers_message(method, placeholders, images):
    """Issue 27: inputs whose image placeholders do not match the images raised a bare "shape mismatch
    [16] vs [32]" from inside a vision-stage method; now transformers' own wording, with the counts and
    the fix, before the method runs (and the unwrapped model's ValueError type)."""
    model = T.tiny_llava()
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 5] + [T.IMAGE_TOKEN] * placeholders + [6]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.randn(images, 3, 32, 32, generator=g)}
    with pytest.raises(ValueError, match=f"Image features and image tokens do not match, tokens: {placeholders}"):
        with torch.no_grad():
            model(**inputs)  # the unwrapped model says so too
    vlm_prune.wrap(model, method, keep=0.5)
    try:
        with pytest.raises(ValueError) as err, torch.no_grad():
            model(**inputs)
        assert str(err.value).startswith(
            f"Image features and image tokens do not match, tokens: {placeholders}, features: {16 * images} rows")
        assert "build it with the model's processor" in str(err.value)
        good = T.llava_inputs()
        with torch.no_grad():
            model(**good)  # the model serves on
    finally:
        vlm_prune.unwrap(model)


def test_adjacent_image_placeholders_count_as_two_images():
    """<image><image>: budget= is per image, counted from the encoder's own images."""
    model = T.tiny_llava()
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[1, 7, 8] + [T.IMAGE_TOKEN] * 32 + [9, 10, 11]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    for method in ("fastv", "random"):
        vlm_prune.wrap(model, method, budget=3)
        try:
            with torch.no_grad():
                model(**inputs)
                model.generate(**inputs, max_new_tokens=2)
            assert model.vlm_prune.last_stats["visual_tokens_out"] == [6], method
        finally:
            vlm_prune.unwrap(model)


def test_inputs_embeds_with_placeholders_are_pruned_like_input_ids():
    model = vlm_prune.wrap(T.tiny_llava(), ["random", "fastv"], keep=0.5)
    inputs = T.llava_inputs()
    with torch.no_grad():
        by_ids = model(**inputs).logits
        stats = model.vlm_prune.last_stats["visual_tokens_out"]
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        by_embeds = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                          pixel_values=inputs["pixel_values"]).logits
        assert model.vlm_prune.last_stats["visual_tokens_out"] == stats
        torch.testing.assert_close(by_embeds, by_ids, atol=1e-6, rtol=0)
        hf_vlm._warn_once.cache_clear()  # (warned once per process: maybe by an earlier test)
        with pytest.warns(UserWarning, match="no image / video placeholder embeddings"):
            model(inputs_embeds=torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(9)))
    vlm_prune.unwrap(model)


LABEL_MODELS = {
    "llava": (T.tiny_llava, lambda m, pad: T.llava_inputs(pad=pad)),
    "qwen2_vl": (T.tiny_qwen2_vl, lambda m, pad: T.qwen2_vl_inputs(m, pad=pad)),
}


def _labelled(family: str, attn: str, pad: str):
    make, inputs = LABEL_MODELS[family]
    model = make(attn=attn)
    inp = inputs(model, pad)
    return model, inp, inp["input_ids"].masked_fill(inp["attention_mask"] == 0, -100)


def _loss_and_grads(model, inputs, labels):
    model.zero_grad()
    out = model(**inputs, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("pad", ["left", "right"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(LABEL_MODELS))
def test_labels_at_keep_one_give_the_unwrapped_loss_and_gradients(family, attn, pad):
    """keep=1.0 is the unwrapped model bit for bit, padding rows included: with left padding the
    last padding row predicts the first real token, and (as in transformers' masks) it attends to
    no key (eager spreads it over every key, SDPA returns zeros), so loss and gradients match."""
    model, inputs, labels = _labelled(family, attn, pad)
    ref_loss, ref_logits, ref_grads = _loss_and_grads(model, inputs, labels)
    vlm_prune.wrap(model, ["random", FastV(keep=1.0)], keep=1.0)  # (later stages keep their own defaults)
    try:
        loss, logits, grads = _loss_and_grads(model, inputs, labels)
    finally:
        vlm_prune.unwrap(model)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(logits, ref_logits)  # every row, padding rows too
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def _kept_row_loss(per_sample: list[tuple[torch.Tensor, torch.Tensor]], labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each kept row's logits against the input token that followed that row in
    the original sequence. per_sample: (logits [k, V], origin row [k]) of each sample."""
    logits, targets = [], []
    s = labels.shape[1]
    for b, (lg, origin) in enumerate(per_sample):
        for j, r in enumerate(origin.tolist()):
            if r + 1 < s and labels[b, r + 1] != -100:
                logits.append(lg[j])
                targets.append(labels[b, r + 1])
    return torch.nn.functional.cross_entropy(torch.stack(logits).float(), torch.stack(targets))


def _lm_grads(model) -> dict[str, torch.Tensor]:
    """Gradients of the decoder layers, final norm and head (what the language model's rows reach)."""
    lm = model.model.language_model
    named = [(f"layers.{n}", p) for n, p in lm.layers.named_parameters()] + \
            [(f"norm.{n}", p) for n, p in lm.norm.named_parameters()] + [("lm_head.weight", model.lm_head.weight)]
    return {n: p.grad.clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("family", list(LABEL_MODELS))
@pytest.mark.parametrize("method", ["random", "fastv"])
def test_labels_with_pruning_equal_a_hand_built_reference(family, method):
    """With pruning, the loss is over the kept rows, each predicting the input token that followed
    it (labels mapped through last_rows). Reference, independent of the engine: vision stage - the
    unwrapped language model on each sample's kept rows alone at their original positions;
    in-LLM - the full sequence with the removed rows masked as keys from the pruning layer on.
    Loss and the language model's gradients agree."""
    from reference import capture_lm_inputs, masked_llm_reference, positions_of

    model, inputs, labels = _labelled(family, "eager", "left")
    spec = FastV(layer=2, keep=0.5) if method == "fastv" else method
    vlm_prune.wrap(model, spec, keep=0.5)
    try:
        model.zero_grad()
        with capture_lm_inputs(model) as seen:
            out = model(**inputs, labels=labels)
        out.loss.backward()
        grads = _lm_grads(model)
        rows = model.vlm_prune.last_rows
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    assert rows.shape[1] < labels.shape[1]
    assert all(o < i for o, i in zip(stats["visual_tokens_out"], stats["visual_tokens_in"]))
    model.zero_grad()
    b, s = labels.shape
    per_sample = []
    if method == "random":
        embeds = seen[0]["inputs_embeds"].detach()
        pos = positions_of(seen[0], b, s)
        lm = model.model.language_model
        for i in range(b):
            keep = rows[i][rows[i] >= 0]
            p = pos[:, i : i + 1, keep]
            p = p if "Qwen2" in type(model).__name__ else p[0]
            h = lm(inputs_embeds=embeds[i : i + 1, keep], position_ids=p,
                   attention_mask=torch.ones(1, keep.numel(), dtype=torch.long)).last_hidden_state
            per_sample.append((model.lm_head(h)[0], keep))
    else:
        kept = torch.zeros(b, s, dtype=torch.bool)
        for i in range(b):
            kept[i, rows[i][rows[i] >= 0]] = True
        ref_logits = masked_llm_reference(model, inputs, 2, kept, grad=True)
        per_sample = [(ref_logits[i, rows[i][rows[i] >= 0]], rows[i][rows[i] >= 0]) for i in range(b)]
    ref = _kept_row_loss(per_sample, labels)
    ref.backward()
    ref_grads = _lm_grads(model)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), atol=1e-6, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("method", ["tome"])
def test_labels_with_merges_are_the_loss_over_the_kept_rows(method):
    """ToMe merges inside the tower: each kept row predicts the input token that followed it."""
    model = vlm_prune.wrap(T.tiny_llava(), method, keep=0.5)
    inputs = T.llava_inputs()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    out = model(**inputs, labels=labels)
    rows = model.vlm_prune.last_rows
    assert rows.shape[1] < labels.shape[1]
    ref = _kept_row_loss([(out.logits[b][rows[b] >= 0], rows[b][rows[b] >= 0]) for b in range(rows.shape[0])], labels)
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=0)
    out.loss.backward()
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    vlm_prune.unwrap(model)


def test_sliding_window_language_models_are_refused_at_wrap_time():
    model = T.tiny_onevision()
    model.model.language_model.config.layer_types = ["sliding_attention", "full_attention"] * 3
    with pytest.raises(ValueError, match="sliding_attention.*use_sliding_window"):
        vlm_prune.wrap(model, "fastv", keep=0.5)
    assert getattr(model, "vlm_prune", None) is None


# ---- images after a prefix already in the KV cache --------------------------------------------------
def _prefix_case(p: int = 3):
    """(inputs of one sample, its first p text tokens, the rest): a system prompt cached first."""
    inputs = T.llava_inputs(batch=1)
    ids = inputs["input_ids"]
    assert not bool((ids[:, :p] == T.IMAGE_TOKEN).any())
    prefix = {"input_ids": ids[:, :p], "attention_mask": torch.ones(1, p, dtype=torch.long)}
    rest = {"input_ids": ids[:, p:], "attention_mask": torch.ones_like(ids), "pixel_values": inputs["pixel_values"]}
    return inputs, prefix, rest


def _cached(model, prefix):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config())
    with torch.no_grad():
        model(**prefix, cache=cache)
    return cache


def test_images_after_a_cached_prefix_are_pruned_by_the_vision_stage():
    """A system prompt cached first, then image + question continuing it: the vision stage prunes
    the new image (last_stats says so); the kept rows' logits equal the unwrapped model given the
    same cached prefix and only the kept rows at their original positions; generate() continuing
    the cache equals generate() on the whole prompt (same kept set)."""
    from reference import capture_lm_inputs

    model = T.tiny_llava()
    inputs, prefix, rest = _prefix_case()
    p = prefix["input_ids"].shape[1]
    foreign = _cached(model, prefix)  # filled before wrap(): no bookkeeping of the engine on it
    vlm_prune.wrap(model, "random", keep=0.5)
    try:
        with torch.no_grad(), capture_lm_inputs(model) as seen:
            logits = model(**rest, cache=_cached(model, prefix)).logits
        rows, stats = model.vlm_prune.last_rows, model.vlm_prune.last_stats
        with torch.no_grad():
            assert torch.equal(model(**rest, cache=foreign).logits, logits)
        with torch.no_grad():
            whole = model.generate(**inputs, max_new_tokens=6, do_sample=False)
            continued = model.generate(**inputs, cache=_cached(model, prefix), max_new_tokens=6, do_sample=False)
            assert model.vlm_prune.last_stats["visual_tokens_out"] == [8]
    finally:
        vlm_prune.unwrap(model)
    assert stats["visual_tokens_in"] == [16] and stats["visual_tokens_out"] == [8]
    assert torch.equal(continued, whole)
    kept = rows[0][rows[0] >= 0]
    embeds = seen[-1]["inputs_embeds"][0, kept][None]
    with torch.no_grad():
        cache = _cached(model, prefix)
        h = model.model.language_model(inputs_embeds=embeds, position_ids=(kept + p)[None], cache=cache,
                                       attention_mask=torch.ones(1, p + kept.numel(), dtype=torch.long)).last_hidden_state
        ref = model.lm_head(h)
    torch.testing.assert_close(logits[0, rows[0] >= 0], ref[0], atol=1e-5, rtol=0)


def test_llm_stage_after_a_cached_prefix_warns_once_and_reports_nothing_pruned():
    """FastV cannot score images that follow a cached prefix (its scores would not see the cached
    rows): a warning once, last_stats reports the tokens as kept with the llm stage skipped, and the
    result is the unwrapped model's."""
    from vlm_prune import engine

    model = T.tiny_llava()
    inputs, prefix, rest = _prefix_case()
    with torch.no_grad():
        ref = model(**rest, cache=_cached(model, prefix)).logits
    vlm_prune.wrap(model, "fastv", keep=0.5)
    engine._warn_once.cache_clear()
    try:
        with torch.no_grad():
            with pytest.warns(UserWarning, match="fastv .llm stage. does not prune images that follow a prefix"):
                logits = model(**rest, cache=_cached(model, prefix)).logits
            stats = model.vlm_prune.last_stats
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once
                model(**rest, cache=_cached(model, prefix))
    finally:
        vlm_prune.unwrap(model)
    assert stats["visual_tokens_in"] == stats["visual_tokens_out"] == [16]
    assert [(r["stage"], r.get("skipped")) for r in stats["stages"]] == [("llm", "after a cached prefix")]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(LABEL_MODELS))
def test_generate_after_a_cached_prefix_equals_the_whole_prompt(family):
    """A cached text prefix, then generate() on the whole prompt with that cache: at keep=1.0 the
    unwrapped model's answer, pruned (random, keep=0.5) the wrapped model's answer to the whole
    prompt at once, with the image pruned as there (LLaVA and Qwen2-VL's M-RoPE)."""
    make, inputs = LABEL_MODELS[family]
    model = make()
    inp = inputs(model, "left")
    inp = {k: (v[:1] if k in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw") else v) for k, v in inp.items()}
    if family == "qwen2_vl":
        inp["pixel_values"] = inp["pixel_values"][: int(inp["image_grid_thw"][0].prod())]
    else:
        inp["pixel_values"] = inp["pixel_values"][:1]
    valid = inp["attention_mask"][0].bool()
    inp = {k: (v[:, valid] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in inp.items()}
    p = 3
    assert not bool((inp["input_ids"][:, :p] == T.IMAGE_TOKEN).any())
    prefix = {k: inp[k][:, :p] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inp}
    with torch.no_grad():
        unwrapped = model.generate(**inp, max_new_tokens=5, do_sample=False)
    for keep in (1.0, 0.5):
        vlm_prune.wrap(model, "random", keep=keep)
        try:
            with torch.no_grad():
                whole = model.generate(**inp, max_new_tokens=5, do_sample=False)
                continued = model.generate(**inp, cache=_cached(model, prefix), max_new_tokens=5, do_sample=False)
                stats = model.vlm_prune.last_stats
        finally:
            vlm_prune.unwrap(model)
        assert torch.equal(continued, unwrapped if keep == 1.0 else whole), keep
        assert stats["visual_tokens_out"] == [16 if keep == 1.0 else 8]


@pytest.mark.parametrize("methods", [["fastv"], ["random", "fastv"], ["pool", "adaptinfer"]], ids="+".join)
def test_use_cache_false_equals_the_cached_path_after_a_vision_stage(methods) -> None:
    """Without a cache generate() re-runs the generated tokens with the prompt: the in-LLM method must
    still choose from the prompt's rows, also when a vision stage has shortened them first."""
    model, inp = T.tiny_llava(), T.llava_inputs(batch=2)
    scores = {}
    for use_cache in (True, False):
        vlm_prune.wrap(model, methods, keep=0.5)
        try:
            out = model.generate(**inp, max_new_tokens=4, do_sample=False, use_cache=use_cache,
                                 output_scores=True, return_dict_in_generate=True)
        finally:
            vlm_prune.unwrap(model)
        scores[use_cache] = torch.stack(out.scores)
    torch.testing.assert_close(scores[False], scores[True], atol=1e-5, rtol=1e-5)
