"""vlm_prune inside vLLM on Qwen3-VL (issue 29): one vLLM engine on a tiny random checkpoint
(``vlm_prune.vllm.tiny.write_qwen3_vl``: DeepStack features from tower blocks 0 and 1, timestamps
between a video's slices), each request with its own method and budget. The answers must equal
``wrap()``'s on the Hugging Face model, and the kept tokens must sit at their original M-RoPE
positions, their DeepStack features following them (a dropped token leaves every DeepStack layer).

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_vllm_qwen import (  # noqa: E402  (the same prompts, media, requests and HF reference as Qwen2-VL)
    ENGINE_ARGS,
    PROMPTS,
    _case_id,
    _media,
    check_plain_vllm,
    image_positions,
    load_hf,
    run_hf,
    run_vllm,
    vllm_request,
)

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import write_qwen3_vl  # noqa: E402
from vllm_safety_checks import (  # noqa: E402
    EDGE_FLOATS,
    EDGE_SPECS,
    check_dry_run_sees_the_item,
    check_edges_keep_the_engine,
)

pytestmark = pytest.mark.timeout(900)
#: 8 frames: 4 temporal slices of 4 x 6 merged tokens, each behind its own "<t seconds>" text
FRAMES = 8
CASES = [("image", "random", {"keep": 0.5}), ("image", "random", {"budget": 3}), ("image", "pool", {"keep": 0.25}),
         ("image", "pool", {"budget": 5}), ("video", "pool", {"budget": 7}),  # budgets that are no product grid
         ("image", "divprune", {"keep": 0.5}), ("image", "divprune", {"budget": 5}), ("image", "cdpruner", {"keep": 0.5}),
         ("video", "random", {"keep": 0.5}), ("video", "pool", {"keep": 0.25}), ("video", "divprune", {"budget": 5}),
         ("video", "cdpruner", {"keep": 0.5}),
         # frames method: whole slices (their timestamps stay), below one slice part of the middle one
         ("video", "uniform", {"keep": 0.5}), ("video", "uniform", {"budget": 10}),
         # DyCoke: pivot slices whole, compared slices share the rest (counts from the budget and shape alone)
         ("video", "dycoke", {"keep": 0.5}), ("video", "dycoke", {"keep": 0.8})]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_qwen3_vl(tmp_path_factory.mktemp("qwen3") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_keep_all_equals_unwrapped_hf(llm, hf, kind):
    tokens, logprobs = run_vllm(llm, kind, None, FRAMES)
    ref_tokens, ref_logprobs, _ = run_hf(hf, kind, None, FRAMES)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(checkpoint, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Qwen3-VL, bit for bit, on the image and the video
    prompts (its position layout with timestamps, DeepStack, the offset channels stripped)."""
    check_plain_vllm(checkpoint, llm, tmp_path, "Qwen3VLForConditionalGeneration")


@pytest.mark.parametrize("kind,method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(llm, hf, kind, method, budget):
    """Same greedy tokens and log-probabilities as wrap(same method, same budget) on Qwen3-VL, and the
    same kept tokens at the same (t, h, w) positions (the original ones; a video slice's own origin)."""
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, kind, method, FRAMES, **budget)
    tokens, logprobs = run_vllm(llm, kind, method, FRAMES, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    from vllm import SamplingParams

    for i, (prompt, media) in enumerate(zip(PROMPTS[kind], _media(kind, FRAMES))):
        llm.generate(vllm_request(prompt, media, method, **budget), SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def test_deepstack_follows_the_kept_tokens(llm, hf):
    """The DeepStack features matter on this checkpoint: the pruned answer of wrap() with the DeepStack
    mergers zeroed is far from the plugin's, so the equalities above (wrap()'s DeepStack rows follow the
    kept tokens) also check that the plugin's DeepStack rows follow them."""
    model, _ = hf
    _, logprobs = run_vllm(llm, "image", "divprune", FRAMES, keep=0.5)
    saved = [p.detach().clone() for p in model.model.visual.deepstack_merger_list.parameters()]
    try:
        with torch.no_grad():
            for p in model.model.visual.deepstack_merger_list.parameters():
                p.zero_()
        _, zero_logprobs, _ = run_hf(hf, "image", "divprune", FRAMES, keep=0.5)
    finally:
        with torch.no_grad():
            for p, s in zip(model.model.visual.deepstack_merger_list.parameters(), saved):
                p.copy_(s)
    assert np.abs(np.array(logprobs) - np.array(zero_logprobs)).max() > 1e-2


def test_refusals_per_request(llm):
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} needs the vision tower's attention"):
            run_vllm(llm, "image", name, keep=0.5)
    with pytest.raises(ValueError, match="vidcom2 gives each slice of a video its own share"):
        run_vllm(llm, "video", "vidcom2", keep=0.5)
    with pytest.raises(ValueError, match="keyscore chooses a video's slices from the tower's features"):
        run_vllm(llm, "video", "keyscore", keep=0.5)
    with pytest.raises(ValueError, match="quota is refused on Qwen3-VL"):
        run_vllm(llm, "video", "quota", keep=0.5)


def test_the_dry_run_sees_the_real_slices(llm, monkeypatch):
    check_slices_dry_run(llm, monkeypatch)


def check_slices_dry_run(llm, monkeypatch, prompts: dict = PROMPTS) -> None:
    """The processor dry-runs a video's temporal slices on their real grid at the engine's width and dtype
    (docs/serving-safety.md): a vision method on a slice, whose slots every slice's run gets; a frames method
    on the whole video, whose plan gives each run its share."""
    req = vllm_request(prompts["video"][1], _media("video", FRAMES, prompts)[1], None)
    slices = FRAMES // llm.llm_engine.model_config.hf_config.vision_config.temporal_patch_size
    for name, kind, runs in (("cdpruner", "image", slices), ("uniform", "video", 1)):
        assert check_dry_run_sees_the_item(llm, req, {"method": name, "keep": 0.5, "seed": 11}, monkeypatch,
                                           runs)[0] == kind


def test_edge_specs_keep_the_engine(llm):
    check_slice_edges(llm)


def check_slice_edges(llm, prompts: dict = PROMPTS) -> None:
    """Float knobs (DyCoke's too) and budgets at the edges on a video's slices: each refused with a 400 or
    answered; the engine answers on."""
    dycoke = [{"method": "dycoke", "keep": 0.5, "knobs": {"threshold": v, "p": v}} for v in EDGE_FLOATS]
    check_edges_keep_the_engine(llm, vllm_request(prompts["video"][1], _media("video", FRAMES, prompts)[1], None),
                                EDGE_SPECS + dycoke)
