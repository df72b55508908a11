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


@pytest.mark.parametrize("frames", ["uniform", "keyscore"])
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
    gen, stats = run(model, [frames, "fastv"], inp, budget=per_frame * n_frames // 2)
    assert gen.shape == (2, inp["input_ids"].shape[1] + 20)
    frames_rec, llm_rec = stats["stages"]
    assert frames_rec["stage"] == "frames" and llm_rec["stage"] == "llm"
    assert frames_rec["tokens_in"] == [per_frame * n_frames] * 2
    assert frames_rec["tokens_out"] == [per_frame * n_frames // 2] * 2
    for video in frames_rec["videos"]:
        assert len(video["kept_frames"]) == n_frames // 2
        assert sum(video["tokens_per_frame"]) == per_frame * n_frames // 2
    tail = 1 if family == "onevision" else 0  # OneVision's video newline is always kept
    assert llm_rec["tokens_in"] == [n + tail for n in frames_rec["tokens_out"]]
    assert stats["visual_tokens_out"] == llm_rec["tokens_out"]


def test_quota_keeps_exactly_the_frames_its_scorer_prefers():
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, frames=6)
    preferred = torch.tensor([0.0, 0.9, 0.0, 0.0, 0.95, 0.0])
    quota = QuoTA(scorer=lambda pixels, prompt: preferred, variant="v2")
    _, stats = run(model, quota, inp, steps=3, budget=8)
    (rec,) = stats["stages"]
    for video in rec["videos"]:
        assert video["kept_frames"] == [1, 4]
        assert video["tokens_per_frame"] == [0, 4, 0, 0, 4, 0]
    assert rec["tokens_out"] == [8, 8]


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
    quota = QuoTA(decouple=True)
    _, stats = run(model, quota, inp, steps=2, keep=0.5, processor=proc)
    (video,) = stats["stages"][0]["videos"]
    scores = torch.tensor(video["frame_scores"])
    # the same probabilities computed by hand with the unwrapped model
    adapter_ids = proc.tokenizer.encode("A", add_special_tokens=False)[-1]
    assert scores.shape == (5,) and bool(((scores > 0) & (scores < 1)).all())
    n = 9 + 1
    prompt = frame_prompt("what colour is the shape ?", [])  # decoupling found no objects
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


def test_quota_on_qwen2_vl_says_what_to_use_instead():
    with pytest.raises(ValueError, match="uniform"):
        vlm_prune.wrap(T.tiny_qwen2_vl(), QuoTA(scorer=lambda p, q: torch.ones(2)), keep=0.5)
