"""The lmms-eval plugin against lmms-eval's real model base class and registry."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (pip install 'vlm-prune[lmms]')")

from eval_tiny import build_model, build_processor, write_video  # noqa: E402
from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.api.model import lmms  # noqa: E402

from vlm_prune.eval.lmms_plugin import VLMPruneLMM  # noqa: E402
from vlm_prune.eval.runner import Predictor  # noqa: E402
from vlm_prune.video import read_frames  # noqa: E402


def test_registered_through_the_entry_point():
    from lmms_eval.models import get_model

    assert get_model("vlm_prune") is VLMPruneLMM
    assert issubclass(VLMPruneLMM, lmms)


def test_generate_until_answers_like_the_predictor(tmp_path):
    torch.set_num_threads(1)
    video = write_video(str(tmp_path / "v.mp4"), n_frames=10)
    model, processor = build_model(), build_processor()
    lm = VLMPruneLMM(pretrained="unused", model=model, processor=processor, max_frames="4", max_new_tokens="5")
    docs = [{"path": video}, {"path": None}]
    lm.task_dict = {"toy": {"test": docs}}
    to_visual = lambda doc: [doc["path"]] if doc["path"] else []
    reqs = [Instance(request_type="generate_until", arguments=("what is the answer ?", {"until": ["shape"]}, to_visual, i, "toy", "test"),
                     idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(2)]
    got = lm.generate_until(reqs)
    frames, _ = read_frames(video, num_frames=4)
    direct = Predictor(model, processor, 5)
    want = [direct.generate("what is the answer ?", [frames], "video", stop=["shape"]).text,
            direct.generate("what is the answer ?", [], None, stop=["shape"]).text]
    assert got == want and all("shape" not in g for g in got)
    with pytest.raises(NotImplementedError, match="generate_until tasks only"):
        lm.loglikelihood(reqs)


def test_wraps_with_the_method_and_budget():
    pytest.importorskip("vlm_prune.adapters.llava_onevision", reason="LLaVA-OneVision adapter not in this build")
    model, processor = build_model(), build_processor()
    lm = VLMPruneLMM(pretrained="unused", model=model, processor=processor, method="random", keep="0.5")
    assert [m.name for m in model.vlm_prune.pipeline] == ["random"]
    frames = np.random.default_rng(0).integers(0, 255, (4, 40, 56, 3), dtype=np.uint8)
    gen = lm.predictor.generate("what ?", [frames], "video", max_new_tokens=1)
    assert gen.visual_tokens_out < gen.visual_tokens_in


TOY_TASK = """task: vlmprune_toy
dataset_path: {root}/ds
dataset_kwargs:
  load_from_disk: True
test_split: test
output_type: generate_until
doc_to_visual: !function toy_utils.doc_to_visual
doc_to_text: !function toy_utils.doc_to_text
doc_to_target: "answer"
generation_kwargs:
  max_new_tokens: 2
  do_sample: false
process_results: !function toy_utils.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TOY_UTILS = '''
def doc_to_visual(doc):
    return [doc["video"]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"acc": float(results[0].strip().startswith(doc["answer"]))}
'''


@pytest.mark.slow
def test_two_ranks_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node 2 -m lmms_eval --model vlm_prune`: both ranks answer, every doc once,
    each answer as a single process gives it."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("filelock._api") is None:
        pytest.skip("lmms-eval 0.7 imports filelock._api, which filelock 4 removed: pip install 'vlm-prune[lmms]'")
    datasets = pytest.importorskip("datasets")
    model, processor = build_model(), build_processor()
    with torch.no_grad():  # special tokens never win, so every answer is a visible word
        model.lm_head.weight[: len(processor.tokenizer.all_special_ids) + 2] = 0.0
    model.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    rows = [{"video": write_video(str(tmp_path / f"v{i}.mp4"), n_frames=6, seed=i), "question": "what is the colour ?",
             "answer": "A"} for i in range(5)]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "toy.yaml").write_text(TOY_TASK.format(root=tmp_path))
    (tmp_path / "toy_utils.py").write_text(TOY_UTILS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "lmms_eval",
           "--model", "vlm_prune", "--model_args", f"pretrained={tmp_path / 'ckpt'},max_frames=2",
           "--tasks", "vlmprune_toy", "--include_path", str(tmp_path), "--batch_size", "1",
           "--output_path", str(tmp_path / "out"), "--log_samples"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Running on rank 1" in done.stdout + done.stderr  # two processes really ran
    [samples] = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs if "_samples_" in f]
    got = {r["doc_id"]: r["filtered_resps"] for r in map(json.loads, open(samples))}
    assert sorted(got) == [0, 1, 2, 3, 4]  # every doc once, from both ranks
    lm = VLMPruneLMM(pretrained="unused", model=model, processor=processor, max_frames="2")
    lm.task_dict = {"toy": {"test": rows}}
    reqs = [Instance(request_type="generate_until", idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1},
                     arguments=("what is the colour ?", {"max_new_tokens": 2}, lambda d: [d["video"]], i, "toy", "test"))
            for i in range(5)]
    want = lm.generate_until(reqs)
    assert [got[i] for i in range(5)] == want and all(w.strip() for w in want)


def test_multi_process_contract_attributes():
    model, processor = build_model(), build_processor()
    lm = VLMPruneLMM(pretrained="unused", model=model, processor=processor)
    assert (lm.rank, lm.world_size, lm.device, lm.batch_size) == (0, 1, torch.device("cpu"), 1)


def test_questions_about_one_video_decode_it_once(tmp_path, monkeypatch):
    import vlm_prune.video as video

    path = write_video(str(tmp_path / "v.mp4"), n_frames=6)
    calls = []
    real = video.read_frames
    monkeypatch.setattr(video, "read_frames", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    lm = VLMPruneLMM(pretrained="unused", model=build_model(), processor=build_processor(), max_frames="2",
                     max_new_tokens="1")
    lm.task_dict = {"toy": {"test": [{"path": path}] * 3}}
    reqs = [Instance(request_type="generate_until", arguments=("what ?", {}, lambda d: [d["path"]], i, "toy", "test"),
                     idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(3)]
    assert len(lm.generate_until(reqs)) == 3 and calls == [path]


def test_an_undecodable_video_is_a_failed_document_and_the_run_goes_on(tmp_path, caplog):
    """Issue 27: one corrupt video used to abort the whole lmms-eval run (nothing written, exit 0). Now that
    document fails (logged, counted in failed_documents, answered with an empty string) and the others are
    answered as before."""
    import logging
    import os

    torch.set_num_threads(1)
    good = write_video(str(tmp_path / "v.mp4"), n_frames=6)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(os.urandom(4000))
    lm = VLMPruneLMM(pretrained="unused", model=build_model(), processor=build_processor(), max_frames="2",
                     max_new_tokens="2")
    lm.task_dict = {"toy": {"test": [{"path": good}, {"path": str(broken)}, {"path": good}]}}
    reqs = [Instance(request_type="generate_until", arguments=("what ?", {}, lambda d: [d["path"]], i, "toy", "test"),
                     idx=0, metadata={"task": "toy", "doc_id": i, "repeats": 1}) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="vlm_prune.lmms"):
        got = lm.generate_until(reqs)
    alone = VLMPruneLMM(pretrained="unused", model=lm.model, processor=lm.predictor.processor, max_frames="2",
                        max_new_tokens="2")
    alone.task_dict = lm.task_dict
    want = alone.generate_until([reqs[0]])[0]
    assert got[0] == got[2] == want and got[1] == ""
    assert [(f["task"], f["doc_id"]) for f in lm.failed_documents] == [("toy", 1)]
    assert "VideoDecodeError" in lm.failed_documents[0]["error"]
    assert "toy/test document 1 failed" in caplog.text and "1 of 3 documents failed" in caplog.text
