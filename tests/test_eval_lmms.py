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
