"""Synthetic benchmark: generator determinism and ground truth, processors from disk, shipped models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage
from transformers import AutoProcessor, LlavaOnevisionProcessor, LlavaProcessor

from vlm_prune.eval.synthetic import (
    Difficulty, build_processor, evaluate, load, make_dataset, make_sample, model_path, trained_qtypes,
)
from vlm_prune.eval.synthetic.ablation import frames, masked_accuracy, random_tokens
from vlm_prune.eval.synthetic.processing import prompt
from vlm_prune.eval.synthetic.scenes import (
    BACKGROUND_TINTS, COLOURS, COUNTS, FONT, IMAGE_QTYPES, KINDS, NUM_FRAMES, OBJECT_KINDS, VIDEO_QTYPES,
)
from vlm_prune.eval.synthetic.train import IGNORE, colours_present, colour_word_positions, one_cycle, patch_labels, relation_columns

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


def _components(mask: np.ndarray) -> int:
    return ndimage.label(mask)[1]


def _centre_x(mask: np.ndarray) -> float:
    return float(np.nonzero(mask)[-1].mean())


def test_image_families_answers_match_the_rendered_scene() -> None:
    for s in make_dataset("image", "test", 60, qtypes=IMAGE_QTYPES):
        colours, kinds = s.colour_map, s.kind_map
        present = {NAMES[v - 1] for v in np.unique(colours) if v}
        assert s.answer in s.options
        if s.qtype == "count":
            asked = s.question.split()[2]
            assert _components(colours == NAMES.index(asked) + 1) == COUNTS.index(s.answer) + 1
        elif s.qtype == "binding":
            asked = s.question.split()[-2]
            assert len(present) == 3 and {NAMES[v - 1] for v in np.unique(colours[kinds == KINDS.index(asked) + 1])} == {s.answer}
        elif s.qtype == "relation":
            a, b = s.question.split()[2], s.question.split()[-3]
            left = _centre_x(colours == NAMES.index(a) + 1) < _centre_x(colours == NAMES.index(b) + 1)
            assert (s.answer == "yes") == left
        elif s.qtype == "global":
            pixels = np.asarray(s.image).reshape(-1, 3).astype(float)[colours.reshape(-1) == 0]
            shift = pixels.mean(0) - pixels.mean()
            profile = {t: np.corrcoef(shift, np.asarray(COLOURS[t], float))[0, 1] for t in BACKGROUND_TINTS}
            assert max(profile, key=profile.get) == s.answer
        elif s.qtype == "digit":
            ys, xs = np.nonzero(kinds)
            assert set(np.unique(kinds[ys, xs])) == {OBJECT_KINDS.index(f"digit {s.answer}") + 1}
            cell = (np.ptp(ys) + 1) // 5  # every glyph spans its full 3 x 5 cells: read them back
            assert np.ptp(xs) + 1 == 3 * cell
            read = tuple("".join("1" if kinds[ys.min() + r * cell + cell // 2, xs.min() + c * cell + cell // 2] else "0"
                                 for c in range(3)) for r in range(5))
            assert read == FONT[s.answer]
        elif s.qtype == "colour":
            assert present == {s.answer}
            ys, xs = np.nonzero(colours)
            centre = np.asarray(s.image)[int(np.median(ys)), int(np.median(xs))].astype(int)
            assert np.abs(centre - COLOURS[s.answer]).max() <= 6  # drawn colour plus pixel noise
        elif s.qtype == "exist":
            assert (s.answer == "yes") == bool(present)
        elif s.qtype == "position":
            assert (s.answer == "left") == (_centre_x(colours > 0) < colours.shape[1] / 2)
        elif s.qtype == "kind":
            ys, xs = np.nonzero(colours)
            fill = len(ys) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))  # square ~1, circle ~pi/4, triangle ~1/2
            expected = {"square": (0.9, 1.01), "circle": (0.7, 0.86), "triangle": (0.4, 0.65)}[s.answer]
            assert expected[0] <= fill <= expected[1], (s.answer, fill)


def _runs(frames: list[int]) -> int:
    return sum(1 for i, f in enumerate(frames) if i == 0 or frames[i - 1] != f - 1)


def test_video_families_answers_live_in_the_frames_they_name() -> None:
    for s in make_dataset("video", "test", 40, qtypes=VIDEO_QTYPES):
        assert s.frames.shape[0] == NUM_FRAMES and s.frames.dtype == np.uint8
        showing = {name: [t for t in range(NUM_FRAMES) if (s.colour_map[t] == i + 1).any()] for i, name in enumerate(NAMES)}
        visible = [t for t in range(NUM_FRAMES) if s.colour_map[t].any()]
        if s.qtype == "order":
            first = min(visible)
            assert s.answer == next(n for n, f in showing.items() if first in f) and s.answer_frames == visible
            assert sum(bool(f) for f in showing.values()) == 2
        elif s.qtype == "times":
            asked = s.question.split()[5]
            assert _runs(showing[asked]) == COUNTS.index(s.answer) + 1 and showing[asked] == s.answer_frames
        elif s.qtype == "glimpse":
            assert visible == s.answer_frames and len(visible) == 1 and showing[s.answer] == visible
        elif s.qtype == "small":
            asked = s.question.split()[3]
            assert (s.answer == "yes") == bool(showing[asked]) and showing[asked] == s.answer_frames
            assert max((s.colour_map[t] > 0).sum() for t in visible) <= 2 * 6 * 6  # small objects
        elif s.qtype in ("colour", "exist", "position"):
            assert visible == s.answer_frames
            if s.answer == "no":
                assert visible == []
                continue
            assert 2 <= len(visible) <= 3 and visible == list(range(visible[0], visible[-1] + 1))


def test_difficulty_knobs_change_the_rendering() -> None:
    def object_pixels(sample) -> np.ndarray:
        return np.asarray(sample.image)[sample.colour_map > 0].astype(int)

    plain = make_sample("image", "test", 1, qtypes=("binding",))
    grey = make_sample("image", "test", 1, qtypes=("binding",), difficulty=Difficulty(saturation=0.0))
    spread = lambda px: (px.max(1) - px.min(1)).mean()  # noqa: E731
    assert spread(object_pixels(plain)) > 100 and spread(object_pixels(grey)) <= 12
    big = make_sample("image", "test", 1, qtypes=("binding",), difficulty=Difficulty(size=1.5))
    assert 1.8 < (big.colour_map > 0).sum() / (plain.colour_map > 0).sum() < 2.7  # area ~ size^2
    def colourful_clutter(clutter: tuple[int, int]) -> int:  # saturated pixels that are not an object
        s = make_sample("image", "test", 1, qtypes=("colour",), difficulty=Difficulty(clutter=clutter, clutter_saturation=1.0))
        px = np.asarray(s.image).astype(int)[s.colour_map == 0]
        return int(((px.max(1) - px.min(1)) > 80).sum())

    assert colourful_clutter((0, 0)) == 0 and colourful_clutter((12, 12)) > 400
    long = make_dataset("video", "test", 6, qtypes=("colour",), difficulty=Difficulty(answer_frames=(5, 5)))
    assert all(len(s.answer_frames) == 5 for s in long)
    with pytest.raises(ValueError, match="saturation"):
        Difficulty(saturation=1.5)


def test_hand_checked_sample() -> None:
    s = make_sample("image", "test", 1)
    assert (s.qtype, s.options) == ("binding", NAMES)
    assert s.question.startswith("what colour is the ") and s.question.split()[-2] in KINDS
    assert sorted(np.unique(s.kind_map).tolist()) == [0, 1, 2, 3]  # circle, square and triangle
    with pytest.raises(ValueError, match="question types"):
        make_sample("video", "test", 0, qtypes=("count",))


def test_patch_labels_mark_colour_kind_and_column() -> None:
    s = make_sample("image", "test", 0)
    s.colour_map = np.zeros((64, 64), np.uint8)
    s.kind_map = np.zeros((64, 64), np.uint8)
    s.colour_map[8:16, 40:48], s.kind_map[8:16, 40:48] = 2, 3  # green triangle fills patch (row 1, col 5)
    s.colour_map[0:8, 0:1], s.kind_map[0:8, 0:1] = 1, 5  # red "digit 1" ink: 8 of patch (0, 0)'s 64 pixels: enough
    s.colour_map[56:63, 0:1], s.kind_map[56:63, 0:1] = 3, 1  # blue covers 7 (< 8): too little
    labels = {k: v.view(8, 8) for k, v in patch_labels([s]).items()}
    colour = torch.zeros(8, 8, dtype=torch.long)
    colour[1, 5], colour[0, 0] = 2, 1
    assert torch.equal(labels["colour"], colour)
    kind, column = torch.full((8, 8), IGNORE), torch.full((8, 8), IGNORE)
    kind[1, 5], kind[0, 0] = 2, 4
    column[1, 5], column[0, 0] = 5, 0
    assert torch.equal(labels["kind"], kind) and torch.equal(labels["column"], column)


def test_cls_target_lists_the_colours_present() -> None:
    a, b = make_sample("image", "test", 0), make_sample("image", "test", 1)
    a.colour_map = np.zeros((64, 64), np.uint8)
    b.colour_map = np.zeros((64, 64), np.uint8)
    a.colour_map[3, 3], a.colour_map[40, 9] = 2, 4  # a single pixel counts
    expected = torch.zeros(2, len(COLOURS))
    expected[0, [1, 3]] = 1
    assert torch.equal(colours_present([a, b]), expected)


def test_relation_target_is_the_named_objects_columns() -> None:
    """The relation heads' target: the patch column of the first, then the second object the
    question names; the objects stand at least 14 pixels apart, so "yes" is exactly "first column <
    second column"; other families carry no target."""
    samples = make_dataset("image", "train", 200)
    columns = relation_columns(samples)
    relation = [i for i, s in enumerate(samples) if s.qtype == "relation"]
    assert len(relation) == 40 and (columns[[i for i in range(200) if i not in relation]] == IGNORE).all()
    for i in relation:
        a, b = (w for w in samples[i].question.split() if w in COLOURS)
        for colour, column in zip((a, b), columns[i].tolist()):
            xs = np.nonzero(samples[i].colour_map == NAMES.index(colour) + 1)[1]
            assert xs.min() // 8 <= column <= xs.max() // 8  # a column the object covers
        assert (samples[i].answer == "yes") == bool(columns[i, 0] < columns[i, 1])


def test_relation_heads_read_the_colour_words_and_the_answer_position() -> None:
    """The relation heads' loss reaches the decoder only at the question's colour words (after
    WORD_LAYER layers) and at the answer position (after ANSWER_LAYER), and only on relation samples."""
    from vlm_prune.eval.synthetic.train import ANSWER_LAYER, WORD_LAYER, AuxHeads

    samples = make_dataset("image", "train", 5)  # one of each family; index 2 is the relation question
    torch.manual_seed(0)
    heads = AuxHeads(96, "image", text_width=16)
    patches = torch.randn(5, 64, 96)
    hidden = tuple(torch.randn(5, 20, 16, requires_grad=True) for _ in range(7))
    words = torch.tensor([[0, 0], [3, 0], [5, 9], [0, 0], [0, 0]])
    with_heads = heads.loss(patches, None, samples, hidden, words)
    with_heads.backward()
    assert with_heads > heads.loss(patches, None, samples)
    for layer, h in enumerate(hidden):
        touched = set() if h.grad is None else {tuple(ix) for ix in h.grad.abs().sum(-1).nonzero().tolist()}
        expected = {(2, 5), (2, 9)} if layer == WORD_LAYER else {(2, 17)} if layer == ANSWER_LAYER else set()
        assert touched == expected, layer


def test_colour_word_positions_find_the_question_colours() -> None:
    samples = [s for s in make_dataset("image", "train", 10) if s.qtype in ("relation", "count")]
    processor = build_processor("image")
    ids = processor(images=[s.image for s in samples], text=[prompt(processor, s.question, "image") for s in samples],
                    padding=True, return_tensors="pt")["input_ids"]
    colour_ids = torch.tensor(processor.tokenizer.convert_tokens_to_ids(NAMES))
    positions = colour_word_positions(ids, colour_ids)
    for s, row, pos in zip(samples, ids, positions):
        named = [w for w in s.question.split() if w in COLOURS]
        words = processor.tokenizer.convert_ids_to_tokens(row[pos].tolist())
        assert words[: len(named)] == named and (len(named) == 2 or pos[1] == 0)


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


@pytest.fixture(scope="module", params=["image", "video"])
def shipped(request):
    if not (model_path(request.param) / "model.safetensors").exists():
        pytest.fail(f"shipped {request.param} model missing at {model_path(request.param)}")
    torch.manual_seed(0)
    model, processor = load(request.param)
    return request.param, model, processor


def test_shipped_model_reproduces_its_card_and_beats_chance(shipped) -> None:
    """The card's per-family test accuracy (256 test samples, written by train.py) is what the
    shipped float16 weights score here, and every family the bench asks is above chance."""
    from vlm_prune.eval.synthetic import accuracy_by_qtype, model_card
    from vlm_prune.eval.synthetic.train import learned_families

    kind, model, processor = shipped
    card = model_card(kind)
    test = make_dataset(kind, "test", card["test_samples"])
    accs = accuracy_by_qtype(model, processor, test, batch_size=32)
    for family, expected in card["test_accuracy"].items():
        n = len(test) if family == "all" else sum(s.qtype == family for s in test)
        assert abs(accs[family] - expected) <= 1 / n + 1e-9, family  # one answer may flip with the thread count
    learned, chance = learned_families(test, accs)
    assert list(trained_qtypes(kind)) == learned and learned
    assert all(accs[q] > chance[q] + 0.10 for q in learned)


def test_blind_pruning_hurts_the_shipped_model(shipped) -> None:
    kind, model, processor = shipped
    samples = make_dataset(kind, "test", 64, qtypes=trained_qtypes(kind))
    accuracy = evaluate(model, processor, samples, batch_size=32)
    keep_all = masked_accuracy(model, processor, samples, random_tokens(1.0), batch_size=32)
    assert keep_all == accuracy  # the masking path is exact when nothing is dropped
    blind = random_tokens(0.05) if kind == "image" else frames([0, 5, 10, 15])
    assert masked_accuracy(model, processor, samples, blind, batch_size=32) <= accuracy - 0.10


def test_ablation_command_prints_every_setting(capsys) -> None:
    from vlm_prune.eval.synthetic.ablation import BLIND, main

    main(["--samples", "4"])
    out = capsys.readouterr().out
    assert out.count("unpruned {") == 2
    for kind, selectors in BLIND.items():
        for name in selectors:
            assert f"{kind}: {name} -> " in out


def test_half_top_half_random_keeps_the_top_half_and_random_others() -> None:
    from vlm_prune.eval.synthetic.baselines import half_top_half_random

    scores = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.0, 0.7, 0.2])
    for seed in range(5):
        kept = half_top_half_random(scores, 5, torch.Generator().manual_seed(seed)).tolist()
        assert len(kept) == 5 and kept == sorted(set(kept)) and {1, 3, 5} <= set(kept)  # ceil(5 / 2) top scores
    draws = {tuple(half_top_half_random(scores, 4, torch.Generator().manual_seed(s)).tolist()) for s in range(20)}
    assert len(draws) > 1 and all({1, 3} <= set(d) for d in draws)


def test_saturation_baselines_pick_the_colourful_patches_and_frames() -> None:
    from vlm_prune.eval.synthetic.baselines import PixelTap, SaturationFrames, SaturationTokens, saturation
    from vlm_prune.methods.base import FramesContext, VisionContext

    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    rgb = torch.full((3, 16, 16), 0.5)
    rgb[:, 8:16, 0:8] = torch.tensor([0.9, 0.1, 0.1])[:, None, None]  # patch (1, 0) is red
    pixels = (rgb - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert saturation(pixels, mean, std)[12, 3] == pytest.approx(0.8) and saturation(pixels, mean, std)[0, 0] == pytest.approx(0.0)
    class Stub(torch.nn.Module):
        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return pixel_values

    model = Stub()
    tap = PixelTap(model)
    model(torch.zeros(1, 3, 16, 16))
    model(pixels[None])  # the tap keeps the latest call's pixels, positional or keyword
    method = SaturationTokens(tap, mean, std, patch=8, keep=0.25)
    ctx = VisionContext(features=torch.zeros(4, 2), n_keep=1, generator=torch.Generator().manual_seed(0))
    assert method.reduce_image(ctx).indices.tolist() == [2]  # row-major patch (1, 0)
    model(pixel_values=torch.zeros(1, 3, 16, 16))
    assert tap.pixels.abs().sum() == 0
    tap.close()
    frames = rgb[None].repeat(6, 1, 1, 1)
    frames[:, :, 8:, :8] = 0.5
    frames[4, :, :4, :4] = torch.tensor([0.1, 0.9, 0.1])[:, None, None]  # only frame 4 holds colour
    frames = (frames - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    plan = SaturationFrames(mean, std).allocate(FramesContext(features=torch.zeros(6, 4, 2), grid=(2, 2), n_total=8, pixels=frames))
    assert 4 in plan.kept_frames and len(plan.kept_frames) == 2 and plan.tokens_per_frame[4] == 4


def test_training_writes_float16_weights_and_the_model_card(tmp_path) -> None:
    import json

    from transformers import AutoModelForImageTextToText

    from vlm_prune.eval.synthetic.train import train

    threads = torch.get_num_threads()
    try:
        train("image", steps=2, batch_size=2, lr=1e-3, seed=3, out=tmp_path, threads=1, val_samples=2, test_samples=4)
    finally:
        torch.set_num_threads(threads)
    card = json.loads((tmp_path / "synthetic.json").read_text())
    # two steps learn nothing: no family is benchmarked, and each family's chance level is recorded
    assert card["eval_qtypes"] == [] and card["steps"] == 2 and set(card["chance"]) <= {"count", "binding", "relation", "global", "digit"}
    assert card["seed"] == 3 and card["test_samples"] == 4 and set(card["test_accuracy"]) >= {"all", "count"}
    model = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    weights = next(model.parameters())
    assert weights.dtype == torch.float32 and torch.equal(weights, weights.half().float())  # stored as float16
    assert one_cycle(0.0) == pytest.approx(0.04) and one_cycle(0.1) == pytest.approx(1.0) and one_cycle(1.0) == pytest.approx(0.0)


def test_training_on_chosen_families_only(tmp_path, monkeypatch) -> None:
    """``--qtypes`` / ``qtypes=``: every training sample is of those families, the card says so, and the
    test still asks every family; an unknown family is refused before training."""
    import json
    import sys

    import vlm_prune.eval.synthetic.train as train_module

    seen: list[tuple[str, str]] = []
    real = train_module.make_sample

    def spy(kind, split, index, seed=None, qtypes=None, difficulty=None):
        sample = real(kind, split, index, seed, qtypes, difficulty)
        seen.append((split, sample.qtype))
        return sample

    monkeypatch.setattr(train_module, "make_sample", spy)
    threads = torch.get_num_threads()
    try:
        train_module.train("image", steps=2, batch_size=3, lr=1e-3, seed=3, out=tmp_path, threads=1, val_samples=2,
                           test_samples=5, qtypes=("relation",))
    finally:
        torch.set_num_threads(threads)
    assert {q for split, q in seen if split == "train"} == {"relation"} and len(seen) == 6
    card = json.loads((tmp_path / "synthetic.json").read_text())
    assert card["train_qtypes"] == ["relation"] and set(card["test_accuracy"]) == {"all", "count", "binding", "relation", "global", "digit"}
    monkeypatch.setattr(sys, "argv", ["train", "--kind", "video", "--qtypes", "relation", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit) as exit_info:
        train_module.main()
    assert exit_info.value.code == 2 and not (tmp_path / "x").exists()


def test_fine_tuning_continues_the_model_and_its_training_stream(tmp_path, monkeypatch) -> None:
    """``--init``: training goes on from the given model's weights, draws the training samples that
    follow the ones the model has seen, and its card keeps the first card; a wrong path is refused."""
    import json

    from safetensors.torch import load_file

    import vlm_prune.eval.synthetic.train as train_module

    indices: list[int] = []
    real = train_module.make_sample

    def spy(kind, split, index, seed=None, qtypes=None, difficulty=None):
        if split == "train":
            indices.append(index)
        return real(kind, split, index, seed, qtypes, difficulty)

    monkeypatch.setattr(train_module, "make_sample", spy)
    threads = torch.get_num_threads()
    first, second = tmp_path / "first", tmp_path / "second"
    try:
        train_module.train("image", steps=2, batch_size=2, lr=1e-3, seed=3, out=first, threads=1, val_samples=2, test_samples=2)
        before = load_file(first / "model.safetensors")
        train_module.train("image", steps=1, batch_size=3, lr=0.0, seed=3, out=second, threads=1, val_samples=2,
                           test_samples=2, init=first, relation_heads=True)
    finally:
        torch.set_num_threads(threads)
    assert indices == [0, 1, 2, 3, 4, 5, 6]  # two steps of two, then one step of three after them
    after = load_file(second / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr 0: the weights it started from
    card = json.loads((second / "synthetic.json").read_text())
    assert card["first_sample"] == 4 and card["init"]["steps"] == 2 and card["init"]["first_sample"] == 0
    assert card["relation_heads"] and not card["init"]["relation_heads"]
    with pytest.raises(FileNotFoundError, match="--init"):
        train_module.train("image", steps=1, batch_size=1, lr=0.0, seed=3, out=tmp_path / "x", threads=1, init=tmp_path)
    with pytest.raises(ValueError, match="holds a model of kind .image."):
        train_module.train("video", steps=1, batch_size=1, lr=0.0, seed=3, out=tmp_path / "x", threads=1, init=first)
