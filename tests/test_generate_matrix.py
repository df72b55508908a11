"""The generate() matrix: every method x every adapter x every decoding path.

Each path either equals its reference or raises the documented clear error:

- keep=1.0 (nothing pruned, every piece of plumbing still runs): the unwrapped model, for greedy,
  sampling with a seed, beams 3, num_return_sequences 2, prompt lookup, multi-turn continuation
  with the returned cache (both spellings: the whole conversation as input_ids, or only the new
  turn with the whole attention mask), use_cache=False.
- pruned (keep=0.5): the same wrapped model on the path the invariant tests pin to the exact
  references (a prefill, then cached greedy decode steps):
  * use_cache=False and prompt lookup equal cached greedy generate (the kept set comes from the
    prompt only, and rejected draft tokens are cropped from the engine's key bookkeeping);
  * both multi-turn spellings equal a hand-written loop: the new turn, then one token at a time,
    fed to model() with the returned cache;
  * beams 3 / num_return_sequences 2: every repeated sequence keeps exactly the rows its sample
    keeps in a plain prefill (last_rows, last_stats), and sampling with top_k=1 equals greedy.
- cache_implementation="static", output_attentions / output_hidden_states: refused with a
  message that names the feature and the alternative.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.frames.quota import QuoTA
from vlm_prune.methods import PACT

STEPS = 4


def _one(model, make):
    return make(model, batch=1)


ADAPTERS = {
    "llava": (T.tiny_llava, lambda m, batch=2: T.llava_inputs(batch=batch)),
    "llava_next": (T.tiny_llava_next, lambda m, batch=2: T.llava_next_inputs(m, batch=batch)),
    "onevision_image": (T.tiny_onevision, lambda m, batch=2: T.onevision_image_inputs(m, batch=batch)),
    "onevision_video": (T.tiny_onevision, lambda m, batch=2: T.onevision_video_inputs(m, batch=batch)),
    "qwen2_vl_image": (T.tiny_qwen2_vl, lambda m, batch=2: T.qwen2_vl_inputs(m, batch=batch)),
    "qwen2_vl_video": (T.tiny_qwen2_vl, lambda m, batch=2: T.qwen2_vl_inputs(m, batch=batch, video=True)),
}
VIDEO = {"onevision_video", "qwen2_vl_video"}
METHODS = ["random", "pool", "divprune", "cdpruner", "visionzip", "tome", "asvit", "fastv", "pact", "adaptinfer",
           "uniform", "quota"]
#: combinations a pruning call refuses with a documented message (no tower attention there)
CALL_REFUSALS = {("onevision_image", "visionzip"): "VisionZip runs on LLaVA-1.5 images and LLaVA-OneVision videos"}
_cache: dict = {}


def _method(name: str, keep: float):
    """The method as the matrix wraps it. At keep=1.0 the two methods that reshape what they keep
    get their identity setting: PACT clusters nothing (cutoff 0), QuoTA scores frames alike."""
    if name == "quota":  # a fixed scorer: no processor needed
        flat = keep == 1.0
        return QuoTA(scorer=lambda pixels, prompt: torch.full((pixels.shape[0],), 0.5) if flat
                     else torch.linspace(0.9, 0.1, pixels.shape[0]))
    if name == "pact" and keep == 1.0:
        return PACT(cutoff=0.0)
    return name


def setup(adapter: str):
    if adapter not in _cache:
        make, inputs = ADAPTERS[adapter]
        model = make()
        _cache[adapter] = (model, inputs(model), inputs(model, batch=1))
    return _cache[adapter]


def _turn_inputs(inp, first):
    """The second turn after the first answer: (tokens the cache has not seen - the answer's last
    token and 5 new ones -, the whole conversation, its attention mask, extras)."""
    b = first.shape[0]
    new = torch.randint(3, 80, (b, 5), generator=torch.Generator().manual_seed(7))
    full = torch.cat([first, new], 1)
    new = full[:, -6:]
    grow = full.shape[1] - inp["attention_mask"].shape[1]
    mask = torch.cat([inp["attention_mask"], torch.ones(b, grow, dtype=torch.long)], 1)
    extra = {}
    if "mm_token_type_ids" in inp:
        extra["mm_token_type_ids"] = torch.cat([inp["mm_token_type_ids"], torch.zeros(b, grow, dtype=torch.int)], 1)
    return new, full, mask, extra


def multi_turn(model, inp, spelling: str):
    first = model.generate(**inp, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True)
    new, full, mask, extra = _turn_inputs(inp, first.sequences)
    if spelling == "whole":
        out = model.generate(input_ids=full, attention_mask=mask, past_key_values=first.past_key_values,
                             max_new_tokens=STEPS, do_sample=False, **extra)
        return out[:, full.shape[1]:]
    out = model.generate(input_ids=new, attention_mask=mask, cache=first.past_key_values,
                         max_new_tokens=STEPS, do_sample=False, **extra)
    return out[:, new.shape[1]:]


def multi_turn_by_hand(model, inp):
    """Reference of a continuation: the new turn, then one token at a time, through model()."""
    first = model.generate(**inp, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True)
    new, _, mask, _ = _turn_inputs(inp, first.sequences)
    cache = first.past_key_values
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    toks, out = new, []
    cfg = model.generation_config
    eos = torch.tensor([] if cfg.eos_token_id is None else cfg.eos_token_id, dtype=torch.long).reshape(-1)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    done = torch.zeros(new.shape[0], 1, dtype=torch.bool)
    for _ in range(STEPS):
        p = pos[:, -toks.shape[1]:]
        if "mm_token_type_ids" in inp:  # M-RoPE: text continues on all three axes after the rope delta
            p = p[None].expand(3, -1, -1) + model.model.rope_deltas
        nxt = model(input_ids=toks, attention_mask=mask, cache=cache, position_ids=p).logits[:, -1].argmax(-1, keepdim=True)
        nxt = nxt.masked_fill(done, pad)  # as generate(): a finished sequence continues with padding
        done |= torch.isin(nxt, eos)
        out.append(nxt)
        toks = nxt
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
    return torch.cat(out, 1)


def same_answer(got: torch.Tensor, by_hand: torch.Tensor, model) -> bool:
    """generate() stops once every sequence has ended; the hand-written loop pads to the end."""
    pad = model.generation_config.pad_token_id or 0
    n = got.shape[1]
    return torch.equal(got, by_hand[:, :n]) and bool((by_hand[:, n:] == pad).all())


def _seeded(fn):
    torch.manual_seed(3)
    return fn()


PATHS = {
    "greedy": lambda m, i, i1: m.generate(**i, max_new_tokens=STEPS, do_sample=False),
    "sampling": lambda m, i, i1: _seeded(lambda: m.generate(**i, max_new_tokens=STEPS, do_sample=True, top_k=0)),
    "beams3": lambda m, i, i1: m.generate(**i, max_new_tokens=STEPS, num_beams=3, do_sample=False),
    "return2": lambda m, i, i1: _seeded(lambda: m.generate(**i, max_new_tokens=STEPS, num_return_sequences=2, do_sample=True)),
    "prompt_lookup": lambda m, i, i1: m.generate(**i1, max_new_tokens=2 * STEPS, prompt_lookup_num_tokens=3, do_sample=False),
    "turn_whole": lambda m, i, i1: multi_turn(m, i, "whole"),
    "turn_new": lambda m, i, i1: multi_turn(m, i, "new"),
    "no_cache": lambda m, i, i1: m.generate(**i, max_new_tokens=STEPS, do_sample=False, use_cache=False),
}


def unwrapped_reference(adapter: str) -> dict:
    key = ("ref", adapter)
    if key not in _cache:
        model, inp, inp1 = setup(adapter)
        with torch.no_grad():
            _cache[key] = {name: fn(model, inp, inp1) for name, fn in PATHS.items()}
    return _cache[key]


def wrapped(adapter: str, method: str, keep: float):
    """(model, inputs, batch-1 inputs) of the adapter wrapped with ``method``; None when wrap() or
    the call refuses the combination with its documented message."""
    if method in ("uniform", "quota") and adapter not in VIDEO:
        pytest.skip("frames methods act on video only")
    model, inp, inp1 = setup(adapter)
    return (model, inp, inp1) if wrap_or_refuse(model, method, adapter, inp, keep=keep) else None


def wrap_or_refuse(model, method, adapter, inp, **kw) -> bool:
    """Wrap; False when wrap() (or the call) refuses the combination with its documented message."""
    try:
        vlm_prune.wrap(model, _method(method, kw["keep"]), **kw)
    except ValueError as e:
        assert any(s in str(e) for s in ("does not offer", "supports", "needs", "CLS")), str(e)
        return False
    refusal = CALL_REFUSALS.get((adapter, method))
    if refusal is not None and kw["keep"] < 1.0:
        try:
            with pytest.raises(ValueError, match=refusal):
                model.generate(**inp, max_new_tokens=2)
        finally:
            vlm_prune.unwrap(model)
        return False
    return True


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_every_path_at_keep_one_equals_the_unwrapped_model(adapter, method):
    ref = unwrapped_reference(adapter)
    case = wrapped(adapter, method, keep=1.0)
    if case is None:
        return
    model, inp, inp1 = case
    try:
        with torch.no_grad():
            for name, fn in PATHS.items():
                got = fn(model, inp, inp1)
                assert torch.equal(got, ref[name]), f"{name} differs from the unwrapped model"
            _assert_refusals(model, inp)
    finally:
        vlm_prune.unwrap(model)


def _assert_refusals(model, inp):
    with pytest.raises(ValueError, match="cache_implementation='static'.*dynamic cache"):
        model.generate(**inp, max_new_tokens=2, cache_implementation="static")
    for flag in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match=f"{flag}.*unwrap"):
            model.generate(**inp, max_new_tokens=2, **{flag: True})
        with pytest.raises(ValueError, match="output_attentions / output_hidden_states.*last_rows"):
            model(**inp, **{flag: True})


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_every_path_when_pruning_equals_its_reference(adapter, method):
    case = wrapped(adapter, method, keep=0.5)
    if case is None:
        return
    model, inp, inp1 = case
    state = model.vlm_prune
    try:
        with torch.no_grad():
            model(**inp)
            rows, stats = state.last_rows, state.last_stats
            assert any(o < i for o, i in zip(stats["visual_tokens_out"], stats["visual_tokens_in"]))
            greedy = PATHS["greedy"](model, inp, inp1)
            assert torch.equal(PATHS["no_cache"](model, inp, inp1), greedy), "use_cache=False"
            assert torch.equal(_seeded(lambda: model.generate(**inp, max_new_tokens=STEPS, do_sample=True, top_k=1)), greedy)
            greedy1 = model.generate(**inp1, max_new_tokens=2 * STEPS, do_sample=False)
            assert torch.equal(PATHS["prompt_lookup"](model, inp, inp1), greedy1), "prompt lookup"
            by_hand = multi_turn_by_hand(model, inp)
            assert same_answer(multi_turn(model, inp, "whole"), by_hand, model), "multi-turn, whole conversation"
            assert same_answer(multi_turn(model, inp, "new"), by_hand, model), "multi-turn, new turn only"
            for name, copies in (("beams3", 3), ("return2", 2)):
                out = PATHS[name](model, inp, inp1)
                assert out.shape[0] == inp["input_ids"].shape[0] * (1 if name == "beams3" else 2)
                assert torch.equal(state.last_rows, rows.repeat_interleave(copies, 0)), name
                assert state.last_stats["visual_tokens_out"] == [n for n in stats["visual_tokens_out"] for _ in range(copies)]
    finally:
        vlm_prune.unwrap(model)
