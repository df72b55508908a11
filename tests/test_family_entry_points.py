"""The issue-29 families through every entry point that takes ``--model``: a tiny random model of the
real class and its real processor (tests/tiny_processors.py) saved to a folder, loaded as a checkpoint
by `vlm-prune eval` (run_eval: check_family, load_model, the Predictor), the lmms-eval plugin,
`vlm-prune bench --model` (targets, run_model) and the demo (make_session, Session.run); images and,
for the families that take them, videos."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

import tiny_processors as P
from eval_tiny import write_image, write_video
from vlm_prune.eval.runner import EvalConfig, EvalConfigError, Predictor, load_model, run_eval
from vlm_prune.eval import sharding

FAMILIES = list(P.FAMILIES)
VIDEO_FAMILIES = [f for f in FAMILIES if "video" in P.FAMILIES[f][2]]
#: families whose processor takes videos that their adapter refuses, and the refusal
VIDEO_REFUSED = {"videollama3": "vlm_prune prunes VideoLLaMA3 images only"}
#: a vision-stage method every family runs
METHOD = "divprune"


_saved: dict = {}


@pytest.fixture
def checkpoint(request, tmp_path_factory):
    family = request.param
    if family == "smolvlm":
        pytest.importorskip("num2words")  # SmolVLMProcessor needs it
    if family not in _saved:
        make, proc, _ = P.FAMILIES[family]
        path = tmp_path_factory.mktemp(family)
        model = make()
        model.save_pretrained(path)
        proc().save_pretrained(path)
        _saved[family] = (str(path), type(model).__name__)
    return (family, *_saved[family])


def frames_given(inputs: dict, model) -> int:
    """Video frames the processor handed to the model."""
    if "video_grid_thw" in inputs:
        vp = getattr(model.config.vision_config, "temporal_patch_size", 1) or 1
        return int(inputs["video_grid_thw"][0, 0]) * vp
    if "pixel_values_videos" in inputs:
        return int(inputs["pixel_values_videos"].shape[1])
    pixels = inputs["pixel_values"]
    return int(pixels.shape[1] if pixels.dim() == 5 else pixels.shape[0])  # SmolVLM2 / InternVL: frames as images


@pytest.mark.parametrize("checkpoint", FAMILIES, indirect=True)
def test_eval_harness_loads_the_checkpoint_and_prunes(checkpoint, tmp_path):
    """`vlm-prune eval --model <folder>`: the class check, AutoModelForImageTextToText + AutoProcessor,
    then image questions answered unpruned and with a vision-stage method (fewer visual tokens)."""
    family, path, cls = checkpoint
    write_image(str(tmp_path / "img" / "a.png"))
    with open(tmp_path / "vqa.jsonl", "w") as f:
        f.write(json.dumps({"image": "img/a.png", "question": "what colour ?", "options": ["red", "blue"], "answer": "A"}) + "\n")
    cfg = EvalConfig(model=path, data=str(tmp_path / "vqa.jsonl"), dataset="image", out=str(tmp_path / "out"),
                     methods=["none", METHOD], keeps=[0.5], max_new_tokens=2, decode_timeout=None)
    rows = run_eval(cfg)
    records = [json.loads(line) for f in sorted((tmp_path / "out").rglob("results.jsonl")) for line in open(f)]
    assert len(records) == 2 and not [r["error"] for r in records if "error" in r]
    by = {r["method"]: r for r in rows}
    assert by["none"]["visual_tokens_in"] > 0
    assert 0 < by[METHOD]["visual_tokens_out"] < by[METHOD]["visual_tokens_in"], rows
    model, _ = load_model(cfg, sharding.current())
    assert type(model).__name__ == cls


@pytest.mark.parametrize("checkpoint", [f for f in FAMILIES if f not in VIDEO_FAMILIES][:1] + ["smolvlm"], indirect=True)
def test_eval_refuses_a_stage_the_family_lacks_before_loading(checkpoint, tmp_path):
    family, path, _ = checkpoint
    write_image(str(tmp_path / "img" / "a.png"))
    with open(tmp_path / "vqa.jsonl", "w") as f:
        f.write(json.dumps({"image": "img/a.png", "question": "what colour ?", "answer": "A"}) + "\n")
    cfg = EvalConfig(model=path, data=str(tmp_path / "vqa.jsonl"), dataset="image", out=str(tmp_path / "out"),
                     methods=["uniform"], keeps=[0.5])
    with pytest.raises(EvalConfigError, match=f"--method uniform: method 'uniform' works in the 'frames' stage, which "
                                              f"the {P.family_of(family)} adapter does not offer"):
        run_eval(cfg)


@pytest.mark.parametrize("checkpoint", VIDEO_FAMILIES, indirect=True)
def test_videos_reach_the_model_with_every_frame_given_and_their_times(checkpoint, tmp_path):
    """The harness samples the frames itself: the processor keeps all of them (recent processors
    sample again by default: Qwen3-VL cut 8 frames to 4, GLM-4.1V refused frames without metadata),
    and the frames' times reach the prompt's timestamps; the video is pruned."""
    import vlm_prune

    family, path, _ = checkpoint
    cfg = EvalConfig(model=path, data="", dataset="", out="", dtype="float32")
    model, processor = load_model(cfg, sharding.current())
    frames = np.random.default_rng(0).integers(0, 255, (8, 32, 32, 3), dtype=np.uint8)
    times = [0.5 * i for i in range(8)]
    pred = Predictor(model, processor, max_new_tokens=2)
    inputs = pred.inputs("what colour ?", [frames], "video", times)
    assert frames_given(inputs, model) == 8
    vlm_prune.wrap(model, METHOD, keep=0.5, processor=processor)
    try:
        gen = pred.generate("what colour ?", [frames], "video", times=times)
    finally:
        vlm_prune.unwrap(model)
    assert 0 < gen.visual_tokens_out < gen.visual_tokens_in


def test_processor_video_kwargs_carry_the_frames_times():
    from vlm_prune.video import processor_video_kwargs

    proc = P.qwen3_vl_processor()
    kw = processor_video_kwargs(proc, [[0.0, 0.5, 1.25]])
    assert kw["do_sample_frames"] is False
    assert [round(t, 6) for t in kw["video_metadata"][0].timestamps] == [0.0, 0.5, 1.25]
    assert processor_video_kwargs(proc) == {"do_sample_frames": False}
    assert processor_video_kwargs(P.gemma3_processor(), [[0.0]]) == {}  # no video processor: nothing


@pytest.mark.parametrize("checkpoint", FAMILIES, indirect=True)
def test_lmms_plugin_answers_image_and_video_documents(checkpoint, tmp_path):
    pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (pip install 'vlm-prune[lmms]')")
    from lmms_eval.api.instance import Instance
    from PIL import Image

    from vlm_prune.eval.lmms_plugin import VLMPruneLMM

    family, path, _ = checkpoint
    lm = VLMPruneLMM(pretrained=path, method=METHOD, keep="0.5", max_new_tokens="2", max_frames="4", dtype="float32")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    docs = [{"visual": [image]}]
    if family in VIDEO_FAMILIES:
        docs.append({"visual": [write_video(str(tmp_path / "v.mp4"), n_frames=8)]})
    lm.task_dict = {"toy": {"test": docs}}
    reqs = [Instance(request_type="generate_until", arguments=("what ?", {}, lambda d: d["visual"], i, "toy", "test"),
                     idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(len(docs))]
    answers = lm.generate_until(reqs)
    assert len(answers) == len(docs) and not lm.failed_documents
    stats = lm.model.vlm_prune.last_stats
    assert 0 < sum(stats["visual_tokens_out"]) < sum(stats["visual_tokens_in"])


@pytest.mark.parametrize("checkpoint", FAMILIES, indirect=True)
def test_bench_model_runs_the_synthetic_questions(checkpoint):
    """`vlm-prune bench --model <folder>`: loaded, its kind (video for families with a frames stage),
    the synthetic questions rendered for its processor, a pruned row with fewer visual tokens."""
    from vlm_prune.eval import bench

    family, path, cls = checkpoint
    args = argparse.Namespace(model=path, device="cpu", quick=True, keep=(0.5,), limit=4, kinds=("image", "video"),
                              seeds=None, methods=f"{METHOD},random", batch_size=2, time_batches=1, repeats=1, seed=0,
                              data_seed=None)
    name, _, model, processor, samples, keeps = next(bench.targets(args))
    assert type(model).__name__ == cls and keeps == (0.5,)
    rows, skipped = bench.run_model(name, model, processor, samples[:4], keeps, args)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"none", METHOD, "random"}, skipped
    assert 0 < by["random"]["kept_fraction"] < 1


@pytest.mark.parametrize("checkpoint", FAMILIES, indirect=True)
def test_demo_serves_the_checkpoint(checkpoint, tmp_path):
    """`vlm-prune demo --model <folder>`: a session for the media the processor takes, an image request
    (and a video request where the processor takes videos) answered with pruned columns."""
    from vlm_prune.demo.app import make_session

    family, path, _ = checkpoint
    session = make_session(path, num_frames=4, max_new_tokens=2)
    assert (session.models["video"] is not None) == (family in VIDEO_FAMILIES or family in VIDEO_REFUSED)
    out = session.run(write_image(str(tmp_path / "a.png")), "what colour ?", [METHOD], keep=0.5)
    col = out.columns[0]
    assert not col.error, col.error
    assert 0 < sum(col.stats["visual_tokens_out"]) < sum(col.stats["visual_tokens_in"])
    if family in VIDEO_REFUSED:  # the processor takes videos, the adapter refuses them: the column says why
        out = session.run(write_video(str(tmp_path / "v.mp4"), n_frames=8), "what colour ?", [METHOD], keep=0.5)
        assert VIDEO_REFUSED[family] in out.columns[0].error
    if family in VIDEO_FAMILIES:
        out = session.run(write_video(str(tmp_path / "v.mp4"), n_frames=8), "what colour ?", [METHOD], keep=0.5)
        col = out.columns[0]
        assert not col.error, col.error
        assert 0 < sum(col.stats["visual_tokens_out"]) < sum(col.stats["visual_tokens_in"])


@pytest.mark.parametrize("checkpoint", ["smolvlm"], indirect=True)
def test_a_missing_package_of_the_processor_is_named(checkpoint, tmp_path, monkeypatch):
    """SmolVLM's processor needs num2words: every loader says so in one line (no traceback)."""
    import transformers.models.smolvlm.processing_smolvlm as smolvlm_processing

    from vlm_prune.demo.session import DemoError, load_checkpoint

    _, path, _ = checkpoint
    monkeypatch.setattr(smolvlm_processing, "num2words", None)
    with pytest.raises(EvalConfigError, match="needs a package that is not installed: .*pip install num2words"):
        load_model(EvalConfig(model=path, data="", dataset="", out=""), sharding.current())
    with pytest.raises(DemoError, match="needs a package that is not installed .*num2words"):
        load_checkpoint(path)
