"""Frames stage end to end through wrap(): LLaVA-OneVision and Qwen2-VL video."""
from __future__ import annotations

import pytest
import torch

import eval_tiny
import tiny_models as T
import vlm_prune
from vlm_prune.frames.quota import QuoTA, frame_prompt


def run(model, methods, inp, steps=20, **kw):
    vlm_prune.wrap(model, methods, **kw)
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        return gen, model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)


def _prefer_first_half(pixels, prompt):
    t = pixels.shape[0]
    return torch.tensor([0.9] * (t // 2) + [0.3] * (t - t // 2))


@pytest.mark.parametrize("frames", ["uniform", "keyscore", "quota"])
@pytest.mark.parametrize("family", ["onevision", "qwen2_vl"])
def test_frames_then_llm_generate_batch2(frames, family):
    if family == "onevision":
        model = T.tiny_onevision()
        inp = T.onevision_video_inputs(model, frames=6)
        per_frame, n_frames = 4, 6
    else:
        model = T.tiny_qwen2_vl()
        inp = T.qwen2_vl_inputs(model, video=True)
        per_frame, n_frames = 16, 2
    method = QuoTA(scorer=_prefer_first_half, variant="v2") if frames == "quota" else frames
    gen, stats = run(model, [method, "fastv"], inp, budget=per_frame * n_frames // 2)
    assert gen.shape == (2, inp["input_ids"].shape[1] + 20)
    frames_rec, llm_rec = stats["stages"]
    assert frames_rec["stage"] == "frames" and llm_rec["stage"] == "llm"
    n = per_frame * n_frames
    assert frames_rec["tokens_in"] == [n] * 2
    budget = n // 2
    share = round(n * (budget / n) ** 0.5)  # the frames stage takes an even share of the reduction
    for video, out in zip(frames_rec["videos"], frames_rec["tokens_out"]):
        assert sum(video["tokens_per_frame"]) == out
        if frames == "quota":  # the preferred first half gets the most; floors and the grid rule may leave some over
            half = n_frames // 2
            assert set(range(half)) <= set(video["kept_frames"]) and 0 < out <= share
            assert min(video["tokens_per_frame"][:half]) > max(video["tokens_per_frame"][half:])
        else:
            assert len(video["kept_frames"]) == share // per_frame and out == per_frame * (share // per_frame)
    # OneVision's video newline is not a visual token: the LLM stage sees the frames' tokens only
    assert llm_rec["tokens_in"] == frames_rec["tokens_out"]
    assert stats["visual_tokens_out"] == llm_rec["tokens_out"] == [min(budget, o) for o in frames_rec["tokens_out"]]


def test_quota_keeps_exactly_the_frames_its_scorer_prefers():
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=6)
    preferred = torch.tensor([0.0, 0.9, 0.0, 0.0, 0.95, 0.0])
    quota = QuoTA(scorer=lambda pixels, prompt: preferred, variant="v2")
    _, stats = run(model, quota, inp, steps=3, budget=8)
    (rec,) = stats["stages"]
    for video in rec["videos"]:  # w = 0.81 / 1.7125 and 0.9025 / 1.7125 of 8: 3 (grid 2 x 1) and 4 (2 x 2) tokens
        assert video["kept_frames"] == [1, 4]
        assert video["tokens_per_frame"] == [0, 2, 0, 0, 4, 0]
    assert rec["tokens_out"] == [6, 6]


def test_quota_scores_frames_with_the_wrapped_model_itself():
    """Default scorer: one yes/no prompt per frame through the unpruned model, p = P("A")."""
    model = eval_tiny.build_model()
    proc = eval_tiny.build_processor()
    frames = (torch.rand(5, 48, 48, 3) * 255).to(torch.uint8).numpy()
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what colour is the shape ?"}]}],
        add_generation_prompt=True,
    )
    inp = proc(text=[text], videos=[frames], return_tensors="pt")
    quota = QuoTA(decouple=False)
    _, stats = run(model, quota, inp, steps=2, keep=0.5, processor=proc)
    (video,) = stats["stages"][0]["videos"]
    scores = torch.tensor(video["frame_scores"])
    # the same probabilities computed by hand with the unwrapped model
    adapter_ids = proc.tokenizer.encode("A", add_special_tokens=False)[-1]
    assert scores.shape == (5,) and bool(((scores > 0) & (scores < 1)).all())
    n = 9 + 1
    prompt = frame_prompt("what colour is the shape ?", [])  # no decoupling: the query prompt
    t = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                 add_generation_prompt=True)
    ids = proc.tokenizer(t, add_special_tokens=False, return_tensors="pt").input_ids[0].tolist()
    vid = model.config.video_token_id
    ids = [x for i in ids for x in ([vid] * n if i == vid else [i])]
    pixels = inp["pixel_values_videos"][0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids] * 5), pixel_values_videos=pixels[:, None]).logits[:, -1]
    expected = torch.softmax(logits, -1)[:, adapter_ids]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)


def test_quota_without_processor_is_refused_at_wrap_time():
    with pytest.raises(ValueError, match="processor=processor"):
        vlm_prune.wrap(T.tiny_onevision(), "quota", keep=0.5)


def test_quota_on_qwen2_vl_without_processor_is_refused_at_wrap_time():
    with pytest.raises(ValueError, match="processor=processor"):
        vlm_prune.wrap(T.tiny_qwen2_vl(), "quota", keep=0.5)


def test_qwen2_vl_unpatchify_recovers_the_processed_frames():
    from transformers import Qwen2VLImageProcessor

    from vlm_prune.adapters.qwen2_vl import unpatchify

    proc = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56, do_resize=False)
    img = (torch.rand(56, 56, 3) * 255).to(torch.uint8).numpy()
    out = proc(images=[img], return_tensors="pt")
    frames = unpatchify(out["pixel_values"], tuple(out["image_grid_thw"][0].tolist()), _qwen_vc(proc))
    mean = torch.tensor(proc.image_mean).view(3, 1, 1)
    std = torch.tensor(proc.image_std).view(3, 1, 1)
    expected = (torch.from_numpy(img).permute(2, 0, 1).float() / 255 - mean) / std
    torch.testing.assert_close(frames[0], expected, atol=1e-4, rtol=0)


def _qwen_vc(proc):
    from types import SimpleNamespace

    return SimpleNamespace(spatial_merge_size=proc.merge_size, temporal_patch_size=proc.temporal_patch_size,
                           patch_size=proc.patch_size)


def test_quota_on_qwen2_vl_places_resized_frames_on_their_own_m_rope_grid():
    """QuoTA's resized slice keeps its temporal position and gets (row, col) positions of its new
    grid from the video's origin; the result equals the unwrapped language model run on the
    kept tokens at those positions."""
    from reference import capture_lm_inputs

    model = T.tiny_qwen2_vl()
    inp = T.qwen2_vl_inputs(model, video=True, batch=1)
    quota = QuoTA(scorer=lambda pixels, prompt: torch.tensor([0.1, 0.9]))  # 2 temporal slices of 4 x 4
    vlm_prune.wrap(model, quota, budget=9)
    try:
        with torch.no_grad(), capture_lm_inputs(model) as seen:
            logits = model(**inp).logits
        rows = model.vlm_prune.last_rows[0]
        (rec,) = model.vlm_prune.last_stats["stages"]
    finally:
        vlm_prune.unwrap(model)
    assert rec["videos"][0]["kept_frames"] == [1] and rec["videos"][0]["tokens_per_frame"] == [0, 6]
    pos = seen[0]["position_ids"]
    pos = pos[1:] if pos.shape[0] == 4 else pos  # [3, 1, S] original M-RoPE positions
    video = torch.nonzero(inp["input_ids"][0] == T.VIDEO_TOKEN).squeeze(1)
    origin = pos[:, 0, video[0]]
    slice1_t = pos[0, 0, video[16]]  # first token of the second temporal slice
    kept_video = [int(r) for r in rows if int(r) in set(video.tolist())]
    assert kept_video == video[:6].tolist()
    expected = pos.clone()
    for k, r in enumerate(kept_video):  # grid_for(8) = 3 x 2, row-major
        expected[:, 0, r] = torch.stack([slice1_t, origin[1] + k // 2, origin[2] + k % 2])
    keep = rows[rows >= 0]
    lm = model.model.language_model
    with torch.no_grad():
        h = lm(inputs_embeds=seen[0]["inputs_embeds"][:, keep], position_ids=expected[:, :, keep],
               attention_mask=torch.ones(1, keep.numel(), dtype=torch.long)).last_hidden_state
        ref = model.lm_head(h)[0]
    torch.testing.assert_close(logits[0, rows >= 0], ref, atol=1e-5, rtol=0)


def test_another_vlm_scores_frames_for_quota():
    """QuoTA(scorer=vlm_scorer(other_model, other_processor)): P("A") from another VLM, one frame
    per image turn, equals that model run by hand; and it drives QuoTA inside a wrapped model."""
    from vlm_prune.frames import vlm_scorer
    from vlm_prune.frames.keyscore import pixels_to_rgb

    scorer_model, scorer_proc = eval_tiny.build_model(seed=3), eval_tiny.build_processor()
    scorer = vlm_scorer(scorer_model, scorer_proc, batch_size=2)
    pixels = torch.randn(3, 3, 48, 48)
    p = scorer(pixels, "is the shape red ?")
    text = scorer_proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "is the shape red ?"}]}],
        add_generation_prompt=True)
    a = scorer_proc.tokenizer.encode("A", add_special_tokens=False)[-1]
    expected = []
    for img in pixels_to_rgb(pixels):
        inputs = scorer_proc(images=[img], text=[text], return_tensors="pt")
        with torch.no_grad():
            expected.append(torch.softmax(scorer_model(**inputs).logits[0, -1], -1)[a])
    torch.testing.assert_close(p, torch.stack(expected), atol=1e-5, rtol=0)

    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=4)
    _, stats = run(model, QuoTA(scorer=scorer, variant="v2"), inp, steps=2, keep=0.5)
    (video, _) = stats["stages"][0]["videos"]
    assert len(video["frame_scores"]) == 4 and sum(video["tokens_per_frame"]) <= 8


def test_qwen2_vl_scores_its_own_slices_for_quota():
    """Default QuoTA scorer on Qwen2-VL: each temporal slice as a one-slice video through the
    unpruned model, P("A"), equal to running the model by hand; then the allocation follows."""
    model = T.tiny_qwen2_vl()
    tok = T.qwen_tokenizer()
    inp = T.qwen2_vl_inputs(model, video=True, batch=1)
    _, stats = run(model, QuoTA(decouple=False), inp, steps=2, budget=16, processor=tok)
    (video,) = stats["stages"][0]["videos"]
    from vlm_prune.frames.quota import frame_prompt

    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                    "text": frame_prompt(_question(tok, inp), [])}]}], add_generation_prompt=True,
                                   tokenize=False)
    ids = [x for i in tok(text, add_special_tokens=False).input_ids for x in ([T.VIDEO_TOKEN] * 16 if i == T.VIDEO_TOKEN else [i])]
    ids = torch.tensor([ids])
    a = tok.encode("A", add_special_tokens=False)[-1]
    expected = []
    for j in range(2):
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values_videos=inp["pixel_values_videos"][j * 64:(j + 1) * 64],
                           video_grid_thw=torch.tensor([[1, 8, 8]]), mm_token_type_ids=((ids == T.VIDEO_TOKEN) * 2).int()).logits
        expected.append(torch.softmax(logits[0, -1], -1)[a])
    torch.testing.assert_close(torch.tensor(video["frame_scores"]), torch.stack(expected), atol=1e-5, rtol=0)
    assert sum(video["tokens_per_frame"]) <= 16


def _question(tok, inp):
    """The question text after the last video token, as the adapter recovers it."""
    ids = inp["input_ids"][0]
    after = ids[int(torch.nonzero(ids == T.VIDEO_TOKEN).max()) + 1:]
    return tok.decode(after, skip_special_tokens=True).strip()


def test_keyscore_default_embeddings_are_projected_frames_and_question_words():
    """KeyScore's in-model embeddings: each frame's projected, pooled tokens (not the newline)
    mean-pooled, against the input embeddings of the question's words only - no padding, chat
    template, placeholders or assistant prefix - for every video of a left-padded batch."""
    from vlm_prune.frames.keyscore import KeyScore, keyscore

    model, proc = eval_tiny.build_model(), eval_tiny.build_processor()
    questions = ["what colour is the shape ?", "is the shape red ?"]
    texts = [proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q}]}],
                                      add_generation_prompt=True) for q in questions]
    gen = torch.Generator().manual_seed(0)
    videos = [(torch.rand(5, 48, 48, 3, generator=gen) * 255).to(torch.uint8).numpy() for _ in questions]
    inp = proc(text=texts, videos=videos, return_tensors="pt", padding=True)
    assert (inp["attention_mask"] == 0).any()  # the shorter question is left-padded
    _, stats = run(model, KeyScore(proposals="all"), inp, steps=1, keep=0.4, processor=proc)  # every frame scored
    embed = model.get_input_embeddings()
    with torch.no_grad():
        feats = model.model.get_video_features(inp["pixel_values_videos"]).pooler_output
        for q, f, video in zip(questions, feats, stats["stages"][0]["videos"]):
            words = torch.tensor(proc.tokenizer.encode(q, add_special_tokens=False))
            expected = keyscore(f[:45].reshape(5, 9, -1).mean(1), embed(words).mean(0), negate=True).score  # in-model: -cos
            torch.testing.assert_close(torch.tensor(video["frame_scores"]), expected, atol=1e-5, rtol=0)


def test_quota_scorer_reuses_the_features_at_a_smaller_grid():
    """score_grid=(2, 2): each frame's already computed 3 x 3 tokens are bilinearly resized to
    2 x 2 for scoring; equal to the model run by hand on those embeddings (no pixels)."""
    from vlm_prune.frames.quota import OFFICIAL_PROMPTS

    model, proc = eval_tiny.build_model(), eval_tiny.build_processor()
    frames = (torch.rand(4, 48, 48, 3, generator=torch.Generator().manual_seed(2)) * 255).to(torch.uint8).numpy()
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what colour is the shape ?"}]}],
        add_generation_prompt=True)
    inp = proc(text=[text], videos=[frames], return_tensors="pt")
    _, stats = run(model, QuoTA(decouple=False, score_grid=(2, 2)), inp, steps=1, keep=0.5, processor=proc)
    scores = torch.tensor(stats["stages"][0]["videos"][0]["frame_scores"])
    with torch.no_grad():
        feats = model.model.get_video_features(inp["pixel_values_videos"]).pooler_output[0]
        maps = feats[:36].reshape(4, 3, 3, -1).permute(0, 3, 1, 2)
        small = torch.nn.functional.interpolate(maps, size=(2, 2), mode="bilinear").flatten(2).transpose(1, 2)
        video = torch.cat([small, feats[-1:].expand(4, 1, -1)], dim=1)  # 4 tokens + the newline per frame
        prompt = frame_prompt("what colour is the shape ?", [])
        t = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}],
                                     add_generation_prompt=True)
        ids = proc.tokenizer(t, add_special_tokens=False).input_ids
        vid = model.config.video_token_id
        ids = torch.tensor([x for i in ids for x in ([vid] * 5 if i == vid else [i])])
        embeds = model.get_input_embeddings()(ids)[None].repeat(4, 1, 1)
        embeds[:, ids == vid] = video
        logits = model(inputs_embeds=embeds).logits[:, -1]
    a = proc.tokenizer.encode(OFFICIAL_PROMPTS.answer, add_special_tokens=False)[-1]
    torch.testing.assert_close(scores, torch.softmax(logits, -1)[:, a], atol=1e-5, rtol=0)


def test_decoupling_generation_stops_once_the_answer_parses():
    model, proc = eval_tiny.build_model(), eval_tiny.build_processor()
    vlm_prune.wrap(model, QuoTA(decouple=True), keep=0.5, processor=proc)
    try:
        generate = model.vlm_prune.adapter.generate_text_fn()
        text = generate("what colour is the shape ?", lambda answer: len(answer.split()) >= 3, 4096)
        assert len(text.split()) == 3  # stopped at the first token that completed the third word
        assert len(generate("what", None, 5).split()) <= 5
    finally:
        vlm_prune.unwrap(model)


def test_quota_default_scorer_needs_its_answer_token_at_wrap_time():
    """The shipped synthetic video model has no "A": the default prompts are refused by wrap()
    itself; PLAIN_PROMPTS ("is there a ... ?", P(yes) vs P(no)) score with its own words."""
    from vlm_prune.eval.synthetic import load
    from vlm_prune.frames.quota import PLAIN_PROMPTS

    model, proc = load("video")
    with pytest.raises(ValueError, match="no token for the answer 'A'.*PLAIN_PROMPTS"):
        vlm_prune.wrap(model, QuoTA(), keep=0.5, processor=proc)
    assert not hasattr(model, "vlm_prune") or model.vlm_prune is None
    quota = QuoTA.for_processor(proc, variant="v2")
    assert quota._prompts == PLAIN_PROMPTS and not quota.decouple and quota.variant == "v2"
    assert QuoTA.for_processor(eval_tiny.build_processor())._prompts.answer == "A"
    from vlm_prune.eval.synthetic import encode, make_dataset

    sample = next(s for s in make_dataset("video", "test", 8) if s.answer_frames)
    _, stats = run(model, quota, encode(proc, [sample]), steps=1, keep=0.25, processor=proc)
    scores = torch.tensor(stats["stages"][0]["videos"][0]["frame_scores"])
    # P(yes) vs P(no) to the user's own question: the frames showing the answer score highest
    assert set(torch.topk(scores, len(sample.answer_frames)).indices.tolist()) == set(sample.answer_frames)


def test_qwen2_vl_scorer_leaves_generate_positions_alone():
    """The default scorer runs the model on its own batch; generate() afterwards must continue
    from the request's rope deltas, i.e. equal a run whose scores come from a stub scorer."""
    model = T.tiny_qwen2_vl()
    tok = T.qwen_tokenizer()
    inp = T.qwen2_vl_inputs(model, video=True, batch=1)
    gen, stats = run(model, QuoTA(decouple=False), inp, steps=6, budget=16, processor=tok)
    p = torch.tensor(stats["stages"][0]["videos"][0]["frame_scores"])
    ref, _ = run(model, QuoTA(decouple=False, scorer=lambda pixels, prompt: p), inp, steps=6, budget=16)
    assert torch.equal(gen, ref)


def test_qwen2_vl_scorer_at_a_smaller_grid_places_it_on_its_own_m_rope_grid():
    """score_grid=(2, 2) on 4 x 4 slices: the scorer's one-slice videos are 2 x 2 (video_grid_thw
    [1, 4, 4] after the 2 x 2 merge), so the model sees 4 placeholders per slice; scores stay
    probabilities and differ from the full-grid ones."""
    model = T.tiny_qwen2_vl()
    tok = T.qwen_tokenizer()
    inp = T.qwen2_vl_inputs(model, video=True, batch=1)
    scores = []
    for grid in ((2, 2), None):
        _, stats = run(model, QuoTA(decouple=False, score_grid=grid), inp, steps=1, budget=16, processor=tok)
        scores.append(torch.tensor(stats["stages"][0]["videos"][0]["frame_scores"]))
    assert all(bool(((s > 0) & (s < 1)).all()) and s.shape == (2,) for s in scores)
    assert not torch.allclose(scores[0], scores[1])


def _qwen_processor():
    """A Qwen2-VL processor around the tiny word-level tokenizer (32 x 32 images -> 4 x 4 tokens)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tok = T.qwen_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                          "<|vision_end|>"]})
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} :{% for part in m['content'] %}"
                         "{% if part['type'] == 'image' %} <|vision_start|><|image_pad|><|vision_end|>"
                         "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %} {% endfor %}"
                         "{% if add_generation_prompt %}assistant :{% endif %}")
    kw = dict(min_pixels=32 * 32, max_pixels=32 * 32, patch_size=4, merge_size=2, temporal_patch_size=2)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**kw), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(**kw), chat_template=tok.chat_template)


def test_a_separate_qwen2_vl_scores_frames_as_images_as_the_official_code():
    """The official scorer: a separate Qwen2-VL seeing each frame as an image, P("A") of the last
    position, frames batched; equal to running it on one frame at a time by hand."""
    from vlm_prune.frames import vlm_scorer
    from vlm_prune.frames.keyscore import pixels_to_rgb

    scorer_model, proc = T.tiny_qwen2_vl(seed=5), _qwen_processor()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    p = vlm_scorer(scorer_model, proc, batch_size=2)(pixels, "what colour is the shape ?")
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                     "text": "what colour is the shape ?"}]}], add_generation_prompt=True)
    a = proc.tokenizer.encode("A", add_special_tokens=False)[-1]
    expected = []
    for img in pixels_to_rgb(pixels):
        with torch.no_grad():
            logits = scorer_model(**proc(images=[img], text=[text], return_tensors="pt")).logits
        expected.append(torch.softmax(logits[0, -1], -1)[a])
    torch.testing.assert_close(p, torch.stack(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llava_next_video", "llava_onevision15"])
def test_quota_scores_frames_with_the_model_itself_on_frame_run_families(family):
    """Default scorer where a video is the run of its frames' tokens (LLaVA-NeXT-Video,
    LLaVA-OneVision-1.5): each frame's score is the unwrapped model's P("A") on that frame alone,
    sent through the processor as a one-frame video with the frame prompt."""
    import tiny_processors as P
    from vlm_prune.frames.scorers import vocab_id

    make, make_processor, _ = P.FAMILIES[family]
    model, proc = make(), make_processor()
    frames = (torch.rand(4, 32, 32, 3, generator=torch.Generator().manual_seed(3)) * 255).to(torch.uint8).numpy()

    def chat(text):
        return proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}],
                                        add_generation_prompt=True)

    inp = proc(text=[chat("what colour is the shape ?")], videos=[frames], return_tensors="pt")
    _, stats = run(model, QuoTA(decouple=False), inp, steps=2, keep=0.5, processor=proc)
    scores = torch.tensor(stats["stages"][0]["videos"][0]["frame_scores"])
    single = proc(text=[chat(frame_prompt("what colour is the shape ?", []))] * 4,
                  videos=[frames[i : i + 1] for i in range(4)], return_tensors="pt")
    with torch.no_grad():
        logits = model(**single).logits[:, -1]
    expected = torch.softmax(logits.float(), -1)[:, vocab_id(proc.tokenizer, "A")]
    assert len(set(scores.tolist())) == 4  # the frames differ
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
