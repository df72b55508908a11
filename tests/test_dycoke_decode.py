"""DyCoke's decode stage (KD-TAO/DyCoke@dd74634, llava/model/language_model/modeling_qwen2.py
``PrunableDynamicCache.dycoke_pruning`` / ``update_cache`` and ``Qwen2Model.forward``) against an
independent step-by-step re-statement on the tiny LLaVA-OneVision (Qwen2 language model) and the tiny
Qwen2-VL / Qwen2.5-VL (M-RoPE), video input. The official code runs on LLaVA-OneVision only; on Qwen2-VL
the rule is the same, on the language model's own layers and positions.

Re-statement: every decode step re-runs the whole sequence through the plain decoder layers with an
explicit mask per row - the prompt causal, each generated row as its own step saw the cache: full in
layers < L, and in layers >= L without the visual keys that step pruned. The step's choice comes from
the new row's head-averaged attention in layer L - 1 (computed by hand from the layer's weights): when
its cosine similarity with the previous step's attention over the visual keys but the last is below
0.9 (always at the first step), the last visual key and the top int((n - 1) (1 - p)) of the others
stay (the official's visual span, ``image_token_length``, is the TTM output less one token); otherwise
every key.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from flash_attn_standin import flash_attn_standin  # noqa: F401 - a fixture
from reference import capture_lm_inputs, positions_of
from test_fidelity_llm import attention_probs
from vlm_prune.frames.dycoke import DyCoke, dycoke_step
from vlm_prune.kv_cache import segments_of

STEPS = 5


@pytest.fixture(scope="module")
def model():
    return T.tiny_onevision()


def lm_of(model):
    return model.model.language_model


def rope(lm, x: torch.Tensor, pos: torch.Tensor):
    """(cos, sin) of the rows ``x`` [1, S, D] at positions ``pos`` [P, S] (P = 1, or M-RoPE's 3 axes)."""
    return lm.rotary_emb(x, pos[0][None] if pos.shape[0] == 1 else pos[:, None])


def forward_rows(model, embeds, pos0, tokens, missing, layer, decide=None):
    """Logits of the last row of the prompt ``embeds`` [S, D] (positions ``pos0`` [P, S]) followed by
    ``tokens`` (each one further on every axis), every row through the plain decoder layers with its
    own mask: causal, and in layers >= ``layer`` without the visual keys ``missing[j]`` for the row of
    tokens[j] (what its decode step pruned). ``decide``: the last row is a decode step: called with its
    head-averaged attention in layer ``layer`` - 1, it returns the keys that row misses (appended to
    ``missing``)."""
    lm = lm_of(model)
    s = embeds.shape[0]
    x = torch.cat([embeds, lm.embed_tokens(torch.tensor(tokens, dtype=torch.long))]) if tokens else embeds
    n = x.shape[0]
    pos = torch.cat([pos0, pos0[:, -1:] + 1 + torch.arange(n - s)], 1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    late = causal.clone()
    for j, miss in enumerate(missing):
        late[s + j, miss] = False
    pe = rope(lm, x[None], pos)
    h = x[None]
    for idx, dec in enumerate(lm.layers):
        if decide is not None and idx == layer - 1:
            miss = decide(attention_probs(dec, lambda x, p: rope(lm, x, p[0]), h[0], pos).mean(0)[-1])
            late[n - 1, miss] = False
            missing.append(miss)
        mask = torch.zeros(n, n).masked_fill(~(late if idx >= layer else causal), float("-inf"))[None, None]
        out = dec(h, attention_mask=mask, position_ids=pos[:1], position_embeddings=pe)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(lm.norm(h[0, -1:]))[0]


class OfficialSteps:
    """The official rule across steps over the visual keys but the last (which always stays): the
    attention remembered from the last step (None after a prompt), the top int((n - 1) (1 - p)) kept
    when the similarity is below 0.9. ``kept``: every visual key kept at each step."""

    def __init__(self, visual: torch.Tensor, p: float) -> None:
        cols = torch.nonzero(visual).squeeze(1)
        self.vis, self.last, self.p, self.prev, self.kept = cols[:-1], int(cols[-1]), p, None, []

    def __call__(self, attention: torch.Tensor) -> torch.Tensor:
        att = attention[self.vis]
        sim = 0.0 if self.prev is None else float(torch.nn.functional.cosine_similarity(att, self.prev, dim=0))
        self.prev = att
        miss = torch.tensor([], dtype=torch.long)
        if sim < 0.9:
            top = att.topk(int(self.vis.numel() * (1 - self.p))).indices
            miss = self.vis[~torch.isin(torch.arange(self.vis.numel()), top)]
        self.kept.append(sorted(set(self.vis.tolist()) - set(miss.tolist())) + [self.last])
        return miss


def prompts_of(model, inp) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, the unwrapped model's language-model input without its padding: (embeddings [S, D],
    positions [P, S]: 1-D, or M-RoPE's three axes)."""
    with torch.no_grad(), capture_lm_inputs(model) as seen:
        model(**inp)
    embeds = seen[0]["inputs_embeds"]
    b, s = embeds.shape[:2]
    pos = positions_of(seen[0], b, s)
    pos = pos[-3:] if pos.shape[0] == 4 else pos  # Qwen2-VL: the M-RoPE axes after its text row
    valid = inp["attention_mask"].bool()
    return [(embeds[i, valid[i]], pos[:, i, valid[i]]) for i in range(b)]


def prompt_of(model, inp) -> tuple[torch.Tensor, torch.Tensor]:
    return prompts_of(model, inp)[0]


def official_decode(model, inp, visual: torch.Tensor, layer: int, p: float, steps: int,
                    turn: list[int] | None = None, prompt: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[list, list]:
    """(logits of each generated step, the visual keys kept at each decode step), batch 1. ``turn``:
    after the steps, a second turn's new tokens arrive in one chunk (the last answer token first, then
    ``turn``): they attend to the whole cache, the memory starts afresh, and ``steps`` more follow.
    ``prompt``: (embeddings, positions) of the prompt rows (default: those of ``inp``)."""
    embeds, pos0 = prompt if prompt is not None else prompt_of(model, inp)
    rule = OfficialSteps(visual, p)
    logits, tokens, missing = [], [], []
    with torch.no_grad():
        for chunk in [None] + ([turn] if turn else []):
            if chunk is not None:  # the new turn in one forward: its rows miss nothing, the memory starts afresh
                tokens += chunk
                missing += [torch.tensor([], dtype=torch.long)] * (len(tokens) - len(missing))
                rule.prev = None
            for step in range(steps):
                logits.append(forward_rows(model, embeds, pos0, tokens, missing, layer, rule if step > 0 else None))
                tokens.append(int(logits[-1].argmax()))
    return logits, rule.kept


def test_dycoke_step_follows_the_official_rule():
    att = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.5], [0.1, 0.4, 0.2, 0.3, 0.5]])
    visual = torch.tensor([[False, True, True, True, False]] * 2)
    # first step: similarity 0; the last visual key (column 3) stays, the top int((3 - 1) * 0.5) = 1 of
    # the others too (over all three visual keys, int(3 * 0.5) = 1 would keep column 1 alone)
    keep, memory = dycoke_step(att, visual, None, p=0.5)
    assert keep.tolist() == [[True, True, False, True, True]] * 2
    assert memory[0].tolist() == pytest.approx([0.0, 0.4, 0.2, 0.0, 0.0])
    same, _ = dycoke_step(att, visual, memory[:, :4], p=0.5)  # unchanged attention: the whole cache this step
    assert same.all()
    other = torch.tensor([[0.1, 0.0, 0.9, 0.1, 0.5], [0.1, 0.4, 0.2, 0.9, 0.5]])
    changed, _ = dycoke_step(other, visual, memory, p=0.5)  # per sample: only the first changed
    assert changed.tolist() == [[True, False, True, True, True], [True] * 5]  # the second's last key is not compared
    four = torch.tensor([[False, True, True, True, True]])
    keep, _ = dycoke_step(torch.tensor([[0.1, 0.1, 0.3, 0.2, 0.05]]), four, None, p=0.5)
    assert keep.tolist() == [[True, False, True, False, True]]  # int(3 * 0.5) = 1 of columns 1-3, and column 4
    # (over all four, int(4 * 0.5) = 2 would keep columns 2 and 3 and drop column 4)


@pytest.mark.parametrize("p, attn", [(0.5, "sdpa"), (0.8, "sdpa"), (0.5, "eager")])
def test_decode_steps_equal_the_official_step_by_step_loop(model, p, attn):
    """keep=1.0 leaves the video whole, so the decode stage alone differs from the plain model; every
    step's logits equal the re-statement's (SDPA and eager attention), and turning the stage off
    changes them."""
    model = model if attn == "sdpa" else T.tiny_onevision(attn=attn)
    inp = T.onevision_video_inputs(model, batch=1, frames=4)
    vlm_prune.wrap(model, DyCoke(decode_pruning=True, p=p), keep=1.0)
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            segs = segments_of(gen.past_key_values)
    finally:
        vlm_prune.unwrap(model)
    visual = segs.key_visual[0][0, : inp["input_ids"].shape[1]]
    placeholders = inp["input_ids"][0] == model.config.video_token_id
    assert torch.equal(visual, placeholders & (torch.cumsum(placeholders.long(), 0) < int(placeholders.sum())))  # the newline is no token
    expected, kept = official_decode(model, inp, visual, 3, p, STEPS)
    assert any(len(k) < int(visual.sum()) for k in kept)  # some step pruned
    for step in range(STEPS):
        torch.testing.assert_close(gen.scores[step][0], expected[step], atol=1e-5, rtol=0)
    with torch.no_grad():
        plain = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)
    assert torch.equal(plain.scores[0], gen.scores[0]) and not torch.allclose(plain.scores[1], gen.scores[1], atol=1e-4)


def test_a_second_turn_on_the_returned_cache_equals_the_official_loop(model):
    """generate() continuing the conversation with the returned cache: the new turn's tokens attend to
    the whole cache in one forward (no step), the memory starts afresh, and its steps prune again."""
    inp = T.onevision_video_inputs(model, batch=1, frames=4)
    new = [5, 9, 11, 7, 3]
    vlm_prune.wrap(model, DyCoke(decode_pruning=True, p=0.5), keep=1.0)
    try:
        with torch.no_grad():
            first = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                   return_dict_in_generate=True, output_scores=True)
            visual = segments_of(first.past_key_values).key_visual[0][0, : inp["input_ids"].shape[1]].clone()
            full = torch.cat([first.sequences, torch.tensor([new])], 1)
            second = model.generate(input_ids=full, attention_mask=torch.ones_like(full), past_key_values=first.past_key_values,
                                    max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                    return_dict_in_generate=True, output_scores=True)
    finally:
        vlm_prune.unwrap(model)
    expected, kept = official_decode(model, inp, visual, 3, 0.5, STEPS, turn=new)
    got = list(first.scores) + list(second.scores)
    assert len(kept) == 2 * (STEPS - 1) and any(len(k) < int(visual.sum()) for k in kept[STEPS - 1:])
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a[0], b, atol=1e-5, rtol=0, msg=f"step {step}")


def test_batch_samples_decode_as_alone_and_beams_carry_their_state(model):
    """Batch 2 with padding: each sample's greedy steps equal that sample alone (its own attention
    and memory); beam search and num_return_sequences run with the memory moved with their rows."""
    inp = T.onevision_video_inputs(model, batch=2, frames=4)
    vlm_prune.wrap(model, DyCoke(decode_pruning=True, p=0.5), keep=1.0)
    try:
        with torch.no_grad():
            both = model.generate(**inp, max_new_tokens=STEPS, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
            for b in range(2):
                one = {k: v[b: b + 1] for k, v in inp.items()}
                cut = int((inp["attention_mask"][b] == 0).sum())
                one["input_ids"], one["attention_mask"] = one["input_ids"][:, cut:], one["attention_mask"][:, cut:]
                alone = model.generate(**one, max_new_tokens=STEPS, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True)
                for step in range(STEPS):
                    torch.testing.assert_close(both.scores[step][b], alone.scores[step][0], atol=1e-5, rtol=0)
            beams = model.generate(**inp, max_new_tokens=STEPS, num_beams=3, do_sample=False,
                                   return_dict_in_generate=True)
            assert segments_of(beams.past_key_values).decode_state["attention"].shape[0] == 6
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens.*decode_pruning=False"),
    ({"use_cache": False}, "use_cache=False.*decode_pruning=False"),
])
def test_paths_that_skip_the_steps_are_refused(model, kwargs, message):
    inp = T.onevision_video_inputs(model, batch=1, frames=4)
    vlm_prune.wrap(model, DyCoke(decode_pruning=True), keep=1.0)
    try:
        with pytest.raises(ValueError, match=message), torch.no_grad():
            model.generate(**inp, max_new_tokens=2, do_sample=False, **kwargs)
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("knob, value, message", [
    ("layer", 0, "layer L must be an integer >= 1"),
    ("p", 1.0, r"must lie in \[0, 1\)"),
    ("decode_pruning", 1, "must be True or False"),
])
def test_knob_refusals(knob, value, message):
    with pytest.raises(ValueError, match=message):
        DyCoke(**{knob: value})


@pytest.mark.usefixtures("flash_attn_standin")
def test_decode_pruning_under_flash_equals_sdpa():
    """FlashAttention-2 (the stand-in kernel): the per-step key masks reach FA2 as 2-D key masks; batch 2
    with padding, every step's scores equal SDPA's, and differ from no decode pruning."""
    from test_flash_path import models

    fa, sdpa, make = models("onevision_video")
    inp = make()

    def scores(model, method):
        vlm_prune.wrap(model, method, keep=1.0)
        try:
            with torch.no_grad():
                out = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
        finally:
            vlm_prune.unwrap(model)
        return torch.stack(out.scores)

    got, ref = scores(fa, DyCoke(decode_pruning=True, p=0.5)), scores(sdpa, DyCoke(decode_pruning=True, p=0.5))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(got[1:], scores(fa, DyCoke()).float()[1:], atol=1e-4)


def test_a_layer_without_softmax_attention_is_refused_with_the_choices():
    """Qwen3.5 (linear-attention layers 0 and 2, full attention 1 and 3): L - 1 must be a layer with
    a KV cache; layer=2 reads layer 1 and runs."""
    import tiny_models_qwen3 as Q

    model = Q.tiny_qwen3_5()
    inp = Q.qwen3_vl_inputs(model, batch=1, video=True)
    for layer, refused in ((3, True), (2, False)):
        vlm_prune.wrap(model, DyCoke(decode_pruning=True, layer=layer), keep=1.0)
        try:
            with torch.no_grad():
                if refused:
                    with pytest.raises(ValueError, match=r"layer 2, which is not a softmax-attention layer.*\[1, 3\]"):
                        model.generate(**inp, max_new_tokens=3, min_new_tokens=3, do_sample=False)
                else:
                    model.generate(**inp, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            vlm_prune.unwrap(model)


@pytest.mark.parametrize("v25, attn, keep", [(False, "sdpa", 0.75), (False, "eager", 1.0), (True, "sdpa", 1.0),
                                             (True, "eager", 0.75)])
def test_qwen_video_decode_steps_equal_the_official_loop(v25, attn, keep):
    """Qwen2-VL / Qwen2.5-VL video (M-RoPE), batch 2 with left padding, TTM (keep 0.75: the second
    frame keeps 8 of its 16 tokens) then the decode stage: every step's logits of each sample equal the
    re-statement on that sample's kept rows alone, at their M-RoPE positions (generated tokens one
    further on all three axes), its visual keys the video tokens among them."""
    model = T.tiny_qwen2_vl(attn=attn, v25=v25)
    inp = T.qwen2_vl_inputs(model, batch=2, video=True)

    def generate(decode_pruning: bool):
        vlm_prune.wrap(model, DyCoke(decode_pruning=decode_pruning, p=0.5), keep=keep)
        try:
            with torch.no_grad():
                out = model.generate(**inp, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
            return out, model.vlm_prune.last_rows
        finally:
            vlm_prune.unwrap(model)

    gen, rows = generate(True)
    plain, plain_rows = generate(False)
    assert torch.equal(rows, plain_rows) and torch.equal(gen.scores[0], plain.scores[0])  # the prefill is TTM's alone
    assert not torch.allclose(torch.stack(gen.scores[1:]), torch.stack(plain.scores[1:]), atol=1e-4)  # decode steps differ
    pad = (inp["attention_mask"] == 0).sum(1)
    assert int(pad.max()) > 0  # the samples differ in length
    for b, (embeds, pos) in enumerate(prompts_of(model, inp)):
        cols = rows[b][rows[b] >= 0]  # the input columns the frames stage kept, in order
        visual = inp["input_ids"][b, cols] == T.VIDEO_TOKEN
        n_video = int((inp["input_ids"][b] == T.VIDEO_TOKEN).sum())
        assert int(visual.sum()) == (n_video if keep == 1.0 else 24)
        sel = cols - pad[b]
        expected, kept = official_decode(model, None, visual, 3, 0.5, STEPS, prompt=(embeds[sel], pos[:, sel]))
        assert any(len(k) < int(visual.sum()) for k in kept)  # some step pruned
        for step in range(STEPS):
            torch.testing.assert_close(gen.scores[step][b], expected[step], atol=1e-5, rtol=0, msg=f"sample {b}, step {step}")


def test_qwen3_5_gated_query_scores_with_the_query_half_of_each_head():
    """Qwen3.5's q_proj gives each head its query and an output gate side by side: the engine's side
    attention (DyCoke's per-step scores) uses the query halves only, and equals the attention
    probabilities the model's own eager attention computes in that layer."""
    import tiny_models_qwen3 as Q

    model = Q.tiny_qwen3_5(attn="eager")
    inp = Q.qwen3_vl_inputs(model, batch=1, video=True)
    lm = lm_of(model)
    layer = lm.layers[1]
    assert layer.self_attn.q_proj.out_features == 2 * model.config.text_config.num_attention_heads * layer.self_attn.head_dim
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.update(h=a[0] if a else kw["hidden_states"]), with_kwargs=True),
             layer.self_attn.register_forward_hook(lambda m, a, out: seen.update(probs=out[1]))]
    try:
        with torch.no_grad(), capture_lm_inputs(model) as lm_in:
            model(**inp)
    finally:
        for h in hooks:
            h.remove()
    pos = positions_of(lm_in[0], 1, seen["h"].shape[1])
    pos = pos[-3:] if pos.shape[0] == 4 else pos
    vlm_prune.wrap(model, DyCoke(decode_pruning=True, layer=2), keep=1.0)
    try:
        q, k = model.vlm_prune.adapter.decoder.project_qk(1)(seen["h"], pos, rope=True)
    finally:
        vlm_prune.unwrap(model)
    s = q.shape[2]
    logits = (q @ k.transpose(-1, -2)) * layer.self_attn.scaling
    probs = torch.softmax(logits.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf")), -1)
    assert q.shape[1] == model.config.text_config.num_attention_heads
    torch.testing.assert_close(probs, seen["probs"], atol=1e-5, rtol=0)
