"""vlm_prune inside vLLM on LLaVA-NeXT-Video (issue 29): its videos (CLIP frames pooled by 2, no newline
tokens), the vision methods per frame and the frames methods, against the Hugging Face model wrapped with
vlm_prune.wrap() (QuoTA in its two passes through vp.quota_request). One engine on a tiny checkpoint (vlm_prune.vllm.tiny.write_llava_next_video), shared by
every test here; each request picks its method and budget (``mm_processor_kwargs``). vLLM's own class takes
video only (no images), so images are not served on this family.

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402

import vlm_prune  # noqa: E402
import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import LlavaNextVideoShape, hub_naming, video_token_id, write_llava_next_video  # noqa: E402

from test_vllm_llava_next import _method, check_plain_vllm, run_vllm  # noqa: E402
from test_vllm_llava_next import run_hf as run_hf_next  # noqa: E402

pytestmark = pytest.mark.timeout(900)
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"video": 1}, "enable_prefix_caching": False}
STEPS = 5
#: (prompt, frames): 16 tokens per pooled 4 x 4 frame
PROMPTS = [("<s> user : w9 <video> w10 w11 w12 w13 assistant :", 8), ("<s> user : <video> w14 w15 assistant :", 6)]
#: keyscore's in-model default ranks STACFP's proposals (OpenCV); "all" frames without them
KEYSCORE = {} if importlib.util.find_spec("cv2") is not None else {"proposals": "all"}
CASES = [("random", {}, {"keep": 0.5}), ("pool", {}, {"keep": 0.25}), ("divprune", {}, {"keep": 0.5}),
         ("divprune", {"positions": "keep"}, {"budget": 5}), ("cdpruner", {}, {"keep": 0.25}),
         ("cdpruner", {}, {"budget": 7}),
         # frames methods: a count per video fixed by the budget, the frames chosen from the features
         ("uniform", {}, {"keep": 0.5}), ("uniform", {}, {"budget": 40}), ("uniform", {}, {"budget": 10}),
         ("keyscore", KEYSCORE, {"keep": 0.5}), ("keyscore", KEYSCORE, {"budget": 10}),
         ("vidcom2", {}, {"keep": 0.25}), ("vidcom2", {}, {"budget": 50}), ("dycoke", {}, {"keep": 0.5})]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in {**kn, **b}.items())}" for m, kn, b in CASES]


def _video(frames: int) -> np.ndarray:
    """Frames that change slowly, with a cut (keyscore's temporal term finds it), 32 x 32 RGB."""
    rng = np.random.RandomState(frames)
    base = rng.rand(2, 32, 32, 3)
    return (np.stack([base[t // 5] * (0.7 + 0.05 * t) for t in range(frames)]).clip(0, 1) * 255).astype("uint8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny checkpoint in the hub's naming, which vLLM's own class loads too."""
    folder = write_llava_next_video(tmp_path_factory.mktemp("llava_next_video") / "tiny", LlavaNextVideoShape())
    hub_naming(folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    from test_vllm_qwen import load_hf

    return load_hf(checkpoint)


def requests(cases, prompts=PROMPTS) -> list[dict]:
    out = []
    for (prompt, frames), case in zip(prompts, cases):
        req = {"prompt": prompt, "multi_modal_data": {"video": _video(frames)}}
        if case is not None:
            name, knobs, budget = case
            req["mm_processor_kwargs"] = vp.request_kwargs(_method(name, knobs), **budget)
        out.append(req)
    return out


def run_hf(hf, case, prompts=PROMPTS):
    """test_vllm_llava_next's run_hf on video prompts."""
    return run_hf_next(hf, case, prompts, lambda proc, prompt, frames: proc(text=prompt, videos=[_video(frames)],
                                                                          return_tensors="pt"), "video_token_id")


def test_keep_all_equals_unwrapped_hf(llm, hf):
    tokens, logprobs, prompt_ids = run_vllm(llm, requests([None, None]))
    ref_tokens, ref_logprobs, _, _ = run_hf(hf, None)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    assert [ids.count(video_token_id(LlavaNextVideoShape())) for ids in prompt_ids] == [8 * 16, 6 * 16]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_method_equals_wrapped_hf(llm, hf, case):
    """The same greedy tokens, log-probabilities, video slots and kept rows at the same positions as wrap()."""
    ref_tokens, ref_logprobs, ref_kept, ref_slots = run_hf(hf, case)
    tokens, logprobs, prompt_ids = run_vllm(llm, requests([case, case]))
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    assert [ids.count(video_token_id(LlavaNextVideoShape())) for ids in prompt_ids] == ref_slots
    for i in range(len(PROMPTS)):  # one request at a time: where the language model saw the kept rows
        run_vllm(llm, requests([case], prompts=[PROMPTS[i]]))
        assert llm.apply_model(lambda m: m.last_image_positions)[0] == ref_kept[i], PROMPTS[i][0]


def test_mixed_batch_equals_each_alone(llm):
    """One batch of requests with different methods (vision, frames, none) gives each what it gets alone."""
    cases = [CASES[2], CASES[11], None, CASES[6]]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    batch = run_vllm(llm, requests(cases, prompts))
    for i, (case, prompt) in enumerate(zip(cases, prompts)):
        alone = run_vllm(llm, requests([case], [prompt]))
        assert batch[0][i] == alone[0][0] and batch[2][i] == alone[2][0]
        np.testing.assert_allclose(batch[1][i], alone[1][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec, message", [
    ({"method": "hired", "keep": 0.5}, "hired is refused on LLaVA-NeXT-Video's video, as wrap() refuses it there "
     "(HiRED runs on its anyres images only"),
    ({"method": "visionzip", "keep": 0.5}, "visionzip supports llava, llava_onevision"),
    ({"method": "prumerge", "keep": 0.5}, "prumerge supports llava"),
    ({"method": "fastvid", "keep": 0.5}, "fastvid supports llava_onevision"),
    ({"method": "quota", "keep": 0.5}, "send each QuoTA request through vlm_prune.vllm.quota_request"),  # no scores
    ({"method": "dycoke", "keep": 0.5, "knobs": {"decode_pruning": True}}, "dycoke's decode-time KV pruning"),
])
def test_refusals_per_request(llm, spec, message):
    """What wrap() refuses on this family's video, and what vLLM cannot run, is refused per request with its
    reason; the engine serves on."""
    from vllm import SamplingParams

    req = requests([None])[0]
    with pytest.raises(ValueError, match="mm_processor_kwargs.vlm_prune") as err:
        llm.generate({**req, "mm_processor_kwargs": {"vlm_prune": json.dumps(spec)}}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
    assert message in str(err.value)
    tokens, _, _ = run_vllm(llm, requests([CASES[0]]))
    assert len(tokens[0]) == STEPS


QUOTA_CASES = [({"decouple": False}, {"keep": 0.5}),
               ({"decouple": False, "variant": "v2", "score_grid": (2, 2)}, {"budget": 40})]


@pytest.mark.parametrize("knobs,budget", QUOTA_CASES, ids=["v1-keep0.5", "v2-grid2-budget40"])
def test_quota_two_pass_equals_wrapped_hf(llm, hf, knobs, budget):
    """QuoTA through vp.quota_request: pass 1 scores each frame in the same engine (one-frame video requests,
    the pooled 4 x 4 maps fitted into score_grid, P("A") from the prompt log-probabilities), pass 2 serves the
    plan on the pooled maps: the same frame scores as wrap(model, QuoTA(...)) with the model itself as its
    scorer (adapters/llava_next_video.py score_frames), the same greedy tokens, video slots and kept rows."""
    from vlm_prune.frames import QuoTA

    model, proc = hf
    prompt, frames = PROMPTS[0]
    video = _video(frames)
    req = vp.quota_request(llm, {"prompt": prompt, "multi_modal_data": {"video": video}}, QuoTA(**knobs), **budget)
    scores = json.loads(req["mm_processor_kwargs"]["vlm_prune"])["quota"]["scores"]
    vlm_prune.wrap(model, QuoTA(**knobs), processor=proc, **budget)
    try:
        with torch.no_grad():
            model(**proc(text=prompt, videos=[video], return_tensors="pt"))
        record = model.vlm_prune.last_stats["stages"][0]["videos"][0]
    finally:
        vlm_prune.unwrap(model)
    np.testing.assert_allclose(scores, record["frame_scores"], rtol=1e-4)
    assert len(set(record["tokens_per_frame"])) > 1  # the scores made a difference

    ref_tokens, ref_logprobs, ref_kept, ref_slots = run_hf(hf, ("quota", knobs, budget), prompts=[PROMPTS[0]])
    tokens, logprobs, prompt_ids = run_vllm(llm, [req])
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    assert [ids.count(video_token_id(LlavaNextVideoShape())) for ids in prompt_ids] == ref_slots
    assert llm.apply_model(lambda m: m.last_image_positions)[0] == ref_kept[0]


def plain_vllm_main(model: str, out: str) -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`."""
    from test_vllm_llava_next import plain_vllm_main as main

    main(model, out, ENGINE_ARGS, requests([None, None]))


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(llm, checkpoint, tmp_path):
    """Nothing pruned, the plugin is vLLM's own LLaVA-NeXT-Video bit for bit: prompt tokens, greedy tokens,
    log-probabilities."""
    check_plain_vllm(llm, checkpoint, tmp_path, "test_vllm_llava_next_video", "LlavaNextVideoForConditionalGeneration",
                     requests([None, None]))
