"""Synthetic benchmark: generator determinism and ground truth, processors from disk, shipped models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage
from transformers import AutoProcessor, LlavaOnevisionProcessor, LlavaProcessor

from vlm_prune.eval.synthetic import build_processor, evaluate, load, make_dataset, make_sample, model_path
from vlm_prune.eval.synthetic.ablation import frames, masked_accuracy, random_tokens
from vlm_prune.eval.synthetic.processing import prompt
from vlm_prune.eval.synthetic.scenes import COLOURS, COUNTS, IMAGE_QTYPES, NUM_FRAMES
from vlm_prune.eval.synthetic.train import colours_present, patch_labels

NAMES = list(COLOURS)


def _pixels(sample) -> np.ndarray:
    return np.asarray(sample.image) if sample.image is not None else sample.frames


def test_same_seed_same_samples_and_splits_differ() -> None:
    for kind in ("image", "video"):
        a, b = make_dataset(kind, "val", 6), make_dataset(kind, "val", 6)
        assert [(s.question, s.answer) for s in a] == [(s.question, s.answer) for s in b]
        assert all(np.array_equal(_pixels(x), _pixels(y)) for x, y in zip(a, b))
        for other in (make_dataset(kind, "test", 6), make_dataset(kind, "val", 6, seed=7)):
            assert not any(np.array_equal(_pixels(x), _pixels(y)) for x, y in zip(a, other))


def test_image_answers_match_the_rendered_scene() -> None:
    for s in make_dataset("image", "test", 40, qtypes=IMAGE_QTYPES):
        labels = s.colour_map
        present = {NAMES[v - 1] for v in np.unique(labels) if v}
        assert s.answer in s.options
        if s.qtype == "colour":
            assert present == {s.answer}
            ys, xs = np.nonzero(labels)
            centre = np.asarray(s.image)[int(np.median(ys)), int(np.median(xs))].astype(int)
            assert np.abs(centre - COLOURS[s.answer]).max() <= 6  # drawn colour plus pixel noise
        elif s.qtype == "exist":
            assert (s.answer == "yes") == bool(present)
        elif s.qtype == "position":
            xs = np.nonzero(labels)[1]
            assert (s.answer == "left") == (xs.mean() < labels.shape[1] / 2)
        elif s.qtype == "count":
            assert ndimage.label(labels > 0)[1] == COUNTS.index(s.answer) + 1
        elif s.qtype == "kind":
            ys, xs = np.nonzero(labels)
            fill = len(ys) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))  # square ~1, circle ~pi/4, triangle ~1/2
            expected = {"square": (0.9, 1.01), "circle": (0.7, 0.86), "triangle": (0.4, 0.65)}[s.answer]
            assert expected[0] <= fill <= expected[1], (s.answer, fill)


def test_video_answer_lives_in_a_few_consecutive_frames() -> None:
    for s in make_dataset("video", "test", 12):
        assert s.frames.shape[0] == NUM_FRAMES and s.frames.dtype == np.uint8
        visible = [t for t in range(NUM_FRAMES) if s.colour_map[t].any()]
        assert visible == s.answer_frames
        if s.qtype == "exist" and s.answer == "no":
            assert visible == []
            continue
        assert 2 <= len(visible) <= 3 and visible == list(range(visible[0], visible[-1] + 1))
        if s.qtype == "colour":
            assert {NAMES[v - 1] for v in np.unique(s.colour_map) if v} == {s.answer}


def test_hand_checked_sample() -> None:
    s = make_sample("image", "test", 0)
    assert (s.qtype, s.question, s.options) == ("colour", "what colour is the shape ?", NAMES)
    assert np.unique(s.colour_map).tolist() == [0, NAMES.index(s.answer) + 1]
    with pytest.raises(ValueError, match="question types"):
        make_sample("video", "test", 0, qtypes=("count",))


def test_patch_labels_mark_colour_and_side() -> None:
    s = make_sample("image", "test", 0)
    s.colour_map = np.zeros((64, 64), np.uint8)
    s.colour_map[8:16, 40:48] = 2  # green fills patch (row 1, col 5): right half
    s.colour_map[0:8, 0:3] = 1  # red covers 24 of patch (0, 0)'s 64 pixels: enough
    s.colour_map[56:64, 0:1] = 3  # blue covers 8 (< 16): too little
    labels = patch_labels([s]).view(8, 8)
    expected = torch.zeros(8, 8, dtype=torch.long)
    expected[1, 5], expected[0, 0] = 1 + 2 * 1 + 1, 1 + 2 * 0 + 0
    assert torch.equal(labels, expected)


def test_cls_target_lists_the_colours_present() -> None:
    a, b = make_sample("image", "test", 0), make_sample("image", "test", 1)
    a.colour_map = np.zeros((64, 64), np.uint8)
    b.colour_map = np.zeros((64, 64), np.uint8)
    a.colour_map[3, 3], a.colour_map[40, 9] = 2, 4  # a single pixel counts
    expected = torch.zeros(2, len(COLOURS))
    expected[0, [1, 3]] = 1
    assert torch.equal(colours_present([a, b]), expected)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_processor_round_trip_from_disk(kind: str, tmp_path) -> None:
    built = build_processor(kind)
    built.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded) is (LlavaProcessor if kind == "image" else LlavaOnevisionProcessor)
    assert loaded.tokenizer.padding_side == "left"
    samples = make_dataset(kind, "val", 2)
    text = prompt(loaded, samples[0].question, kind)
    assert text == f"<s>user : <{kind}> {samples[0].question} assistant :"
    ids = loaded.tokenizer(text)["input_ids"]
    assert ids == built.tokenizer(text)["input_ids"] and loaded.tokenizer.unk_token_id not in ids
    assert loaded.tokenizer.decode(ids) == text.replace("<s>", "<s> ")
    media = {"images": [s.image for s in samples]} if kind == "image" else {"videos": [s.frames for s in samples]}
    batch = loaded(text=[text, text + " red"], padding=True, return_tensors="pt", **media)
    token = loaded.tokenizer.convert_tokens_to_ids(f"<{kind}>")
    expected = 64 if kind == "image" else NUM_FRAMES * 4 + 1  # 8x8 patches; 2x2 pooled per frame + newline
    assert (batch["input_ids"] == token).sum(1).tolist() == [expected, expected]
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][1].all()  # left padding


TARGETS = {"image": 0.90, "video": 0.85}


@pytest.fixture(scope="module", params=["image", "video"])
def shipped(request):
    if not (model_path(request.param) / "model.safetensors").exists():
        pytest.fail(f"shipped {request.param} model missing at {model_path(request.param)}")
    torch.manual_seed(0)
    model, processor = load(request.param)
    return request.param, model, processor, make_dataset(request.param, "test", 64)


def test_shipped_model_is_accurate_and_blind_pruning_hurts(shipped) -> None:
    kind, model, processor, samples = shipped
    accuracy = evaluate(model, processor, samples, batch_size=32)
    assert accuracy >= TARGETS[kind]
    keep_all = masked_accuracy(model, processor, samples, random_tokens(1.0), batch_size=32)
    assert keep_all == accuracy  # the masking path is exact when nothing is dropped
    blind = random_tokens(0.11) if kind == "image" else frames([0, 5, 10, 15])
    assert masked_accuracy(model, processor, samples, blind, batch_size=32) <= accuracy - 0.10


def test_ablation_command_prints_every_setting(capsys) -> None:
    from vlm_prune.eval.synthetic.ablation import BLIND, main

    main(["--samples", "4"])
    out = capsys.readouterr().out
    assert out.count("unpruned {") == 2
    for kind, selectors in BLIND.items():
        for name in selectors:
            assert f"{kind}: {name} -> " in out
