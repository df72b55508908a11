"""vlm_prune inside vLLM on GLM-4.1V and GLM-4.5V (issue 29): one vLLM engine per architecture on a tiny
random checkpoint (``vlm_prune.vllm.tiny.write_glm4v``: GLM's tower, GLM-4's decoder with partial rotary on
M-RoPE's axes, video slices written with the image placeholder, each followed by its second as text;
``write_glm4v_moe``: GLM-4.5V's MoE decoder, laid out as the hub's checkpoints, one Linear per expert), each
request with its own method and budget. The answers must equal ``wrap()``'s on the Hugging Face
model, with the kept tokens at their original M-RoPE positions (a video slice's own origin).

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

import numpy as np  # noqa: E402
from test_vllm_qwen import (  # noqa: E402  (the same media, requests and HF reference as Qwen2-VL)
    ENGINE_ARGS,
    _case_id,
    check_batch_equals_alone,
    _media,
    check_plain_vllm,
    check_positions,
    load_hf,
    run_hf,
    run_vllm,
    vllm_request,
)
from test_vllm_qwen3 import check_slice_edges, check_slices_dry_run  # noqa: E402  (the same slice machinery)

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import write_glm4v, write_glm4v_moe  # noqa: E402

pytestmark = pytest.mark.timeout(900)
IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"
#: test_vllm_qwen's prompts in GLM's placeholders, the media at different offsets. No image before a video:
#: transformers 5.19's GLM-4.1V (the vLLM environment's, the reference here) counts a video's placeholders as the
#: image's too when one prompt has both (its get_placeholder_mask: "Image features and image tokens do not match")
PROMPTS = {
    "image": [f"<s> user : {IMAGE} w5 w6 w7 w8 assistant :", f"<s> user : w9 w10 {IMAGE} w11 w12 w13 assistant :"],
    "video": [f"<s> user : w5 {VIDEO} w6 w7 assistant :", f"<s> user : w9 w10 w11 {VIDEO} w12 assistant :"],
    "image_in_video": False,
}
#: 8 frames: 4 temporal slices of 4 x 6 merged tokens, each followed by its second ("0" .. "3")
FRAMES = 8
CASES = [("image", "random", {"keep": 0.5}), ("image", "random", {"budget": 3}), ("image", "pool", {"keep": 0.25}),
         ("image", "pool", {"budget": 5}), ("video", "pool", {"budget": 7}),  # budgets that are no product grid
         ("image", "divprune", {"keep": 0.5}), ("image", "divprune", {"budget": 5}), ("image", "cdpruner", {"keep": 0.5}),
         ("video", "random", {"keep": 0.5}), ("video", "pool", {"keep": 0.25}), ("video", "divprune", {"budget": 5}),
         ("video", "cdpruner", {"keep": 0.5}),
         # frames methods: whole slices (their start / end tokens and seconds stay), below one slice part of one
         ("video", "uniform", {"keep": 0.5}), ("video", "uniform", {"budget": 10}),
         ("video", "dycoke", {"keep": 0.5}), ("video", "dycoke", {"keep": 0.8})]
#: GLM-4.5V shares every line of the plugin with GLM-4.1V: one case of each kind on its MoE language model
CASES_MOE = [("image", "divprune", {"keep": 0.5}), ("image", "pool", {"budget": 5}), ("image", "cdpruner", {"keep": 0.5}),
             ("video", "random", {"keep": 0.5}), ("video", "uniform", {"budget": 10}), ("video", "dycoke", {"keep": 0.5})]
#: checkpoint class -> (tiny checkpoint writer, name in the refusals). The MoE engine first: the engines of one
#: process share vLLM's distributed state, whose expert-parallel group only an MoE model's engine creates
ARCHS = {"Glm4vMoeForConditionalGeneration": (write_glm4v_moe, "GLM-4.5V"),
         "Glm4vForConditionalGeneration": (write_glm4v, "GLM-4.1V")}


@pytest.fixture(scope="module", params=list(ARCHS), ids=["glm-4.5v", "glm-4.1v"])
def arch(request, tmp_path_factory):
    """(checkpoint class, folder); its engine and HF model live while its tests run."""
    return request.param, ARCHS[request.param][0](tmp_path_factory.mktemp("glm4v") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(arch):
    engine = vp.LLM(str(arch[1]), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(arch):
    return load_hf(arch[1])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_keep_all_equals_unwrapped_hf(llm, hf, kind):
    tokens, logprobs = run_vllm(llm, kind, None, FRAMES, prompts=PROMPTS)
    ref_tokens, ref_logprobs, _ = run_hf(hf, kind, None, FRAMES, prompts=PROMPTS)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(arch, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own GLM-4.1V / GLM-4.5V, bit for bit, on the image and the
    video prompts (its position layout per slice, the offset channels stripped)."""
    check_plain_vllm(arch[1], llm, tmp_path, arch[0], prompts=PROMPTS)


@pytest.mark.parametrize("kind,method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(arch, llm, hf, kind, method, budget):
    """Same greedy tokens and log-probabilities as wrap(same method, same budget) on GLM-4.1V / 4.5V, and the
    same kept tokens at the same (t, h, w) positions (the original ones; a video slice's own origin)."""
    if arch[0] != "Glm4vForConditionalGeneration" and (kind, method, budget) not in CASES_MOE:
        pytest.skip("CASES_MOE covers GLM-4.5V: the plugin runs the same code on both (see CASES_MOE)")
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, kind, method, FRAMES, prompts=PROMPTS, **budget)
    tokens, logprobs = run_vllm(llm, kind, method, FRAMES, prompts=PROMPTS, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    check_positions(llm, kind, method, FRAMES, ref_kept, prompts=PROMPTS, **budget)


#: one batch of requests of both kinds, each with its own method and budget (or none: the engine's keep=1.0);
#: (kind, prompt index, method, budget); kind "both": an image and a video in one prompt (vLLM only, see PROMPTS)
MIXED = [("image", 0, "divprune", {"keep": 0.5}), ("video", 1, "uniform", {"keep": 0.5}), ("image", 1, None, {}),
         ("video", 0, "dycoke", {"keep": 0.5}), ("image", 0, "pool", {"budget": 5}), ("video", 1, "cdpruner", {"budget": 9}),
         ("both", 0, "divprune", {"budget": 4}), ("both", 0, "uniform", {"budget": 30})]
BOTH = f"<s> user : {IMAGE} w5 {VIDEO} w6 w7 assistant :"


def test_mixed_batch_equals_each_alone(llm):
    """Requests with different methods, budgets and media share a batch: each answer and its prompt
    (slots) are what the request gets alone."""
    requests = [vllm_request(BOTH, _media("video", FRAMES)[0], method, **budget) if kind == "both" else
                vllm_request(PROMPTS[kind][i], _media(kind, FRAMES, PROMPTS)[i], method, **budget)
                for kind, i, method, budget in MIXED]
    check_batch_equals_alone(llm, requests)


def test_refusals_per_request(arch, llm):
    """What GLM-4.1V / 4.5V cannot run in vLLM is refused per request with its reason; the engine serves on."""
    title = ARCHS[arch[0]][1]
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} needs the vision tower's attention"):
            run_vllm(llm, "image", name, prompts=PROMPTS, keep=0.5)
    for name in ("fastvid", "holitom"):
        with pytest.raises(ValueError, match=f"{name} ranks a video's tokens by the attention"):
            run_vllm(llm, "video", name, prompts=PROMPTS, keep=0.5)
    with pytest.raises(ValueError, match=f"vidcom2 gives each slice of a video its own share.* on {title}"):
        run_vllm(llm, "video", "vidcom2", prompts=PROMPTS, keep=0.5)
    with pytest.raises(ValueError, match=f"keyscore chooses a video's slices from the tower's features, but on {title}"):
        run_vllm(llm, "video", "keyscore", prompts=PROMPTS, keep=0.5)
    with pytest.raises(ValueError, match=f"quota is refused on {title}"):
        run_vllm(llm, "video", "quota", prompts=PROMPTS, keep=0.5)
    with pytest.raises(ValueError, match="prunes inside the language model"):
        run_vllm(llm, "image", "fastv", prompts=PROMPTS, keep=0.5)
    tokens, _ = run_vllm(llm, "image", "divprune", FRAMES, prompts=PROMPTS, keep=0.5)
    assert len(tokens) == 2 and all(len(t) == 6 for t in tokens)


def test_the_dry_run_sees_the_real_slices(llm, monkeypatch):
    """Qwen3-VL's check on GLM's slices (each between its image start / end tokens)."""
    check_slices_dry_run(llm, monkeypatch, PROMPTS)


def test_edge_specs_keep_the_engine(llm):
    check_slice_edges(llm, PROMPTS)
