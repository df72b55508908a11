"""VideoLLaMA3 quirks (adapters/videollama3.py): each image on its own grid from image_grid_thw /
image_merge_sizes, videos refused with the reason (the model's own token compression)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models_llavalike as L
import tiny_processors as P
import vlm_prune
from reference import grid_recording
from vlm_prune.methods.simple import Random

_built: dict = {}


def model():
    if "m" not in _built:
        _built["m"] = L.tiny_videollama3()
    return _built["m"]


def test_each_image_gets_its_own_grid_and_budget():
    """8 x 8 and 8 x 12 patches merged 2 x 2: grids (4, 4) and (4, 6), in a batch and with beams."""
    m = model()
    inp = L.videollama3_inputs(m)
    assert inp["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 12]]
    method = grid_recording(Random)
    vlm_prune.wrap(m, method, budget=5)
    try:
        with torch.no_grad():
            m(**inp)
            stats = m.vlm_prune.last_stats
            m.generate(**inp, max_new_tokens=2, num_beams=2)
    finally:
        vlm_prune.unwrap(m)
    assert stats["stages"][0]["tokens_in"] == [16, 24] and stats["stages"][0]["tokens_out"] == [5, 5]
    assert method.grids == [(4, 4), (4, 6)] + [(4, 4), (4, 4), (4, 6), (4, 6)]  # the forward, then 2 beams each


def test_videos_are_refused_with_the_reason_and_images_still_run():
    m = model()
    proc = P.videollama3_processor()
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what ?"}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True)
    frames = np.random.default_rng(0).integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)
    video = dict(proc(text=[text], videos=[frames], return_tensors="pt", do_sample_frames=False))
    with torch.no_grad():
        m(**video)  # the unwrapped model takes it
    vlm_prune.wrap(m, "divprune", keep=0.5)
    try:
        with pytest.raises(ValueError, match="vlm_prune prunes VideoLLaMA3 images only: its videos go through the "
                                             "model's own token compression"), torch.no_grad():
            m(**video)
        with torch.no_grad():
            m(**L.videollama3_inputs(m))
        assert m.vlm_prune.last_stats["visual_tokens_out"] == [8, 12]
    finally:
        vlm_prune.unwrap(m)


@pytest.mark.parametrize("method, message", [
    ("visionzip", "method 'visionzip' supports llava, llava_onevision models; this model is handled by the 'videollama3' adapter"),
    ("tome", "method 'tome' works in the 'vit' stage, which the videollama3 adapter does not offer"),
    ("uniform", "method 'uniform' works in the 'frames' stage, which the videollama3 adapter does not offer"),
])
def test_tower_and_frames_methods_are_refused_at_wrap_time(method, message):
    with pytest.raises(ValueError, match=message):
        vlm_prune.wrap(model(), method, keep=0.5)
