"""vlm_prune inside vLLM on Qwen3.5 (issue 29): one vLLM engine on a tiny random checkpoint
(``vlm_prune.vllm.tiny.write_qwen3_5``: Qwen3-VL's tower without DeepStack, a decoder alternating
Gated DeltaNet and full-attention layers, timestamps between a video's slices), each request with its
own method and budget. The kept tokens must be ``wrap()``'s on the Hugging Face model, at their original
M-RoPE positions; the linear-attention layers' recurrent states see the kept rows only, in vLLM as in ``wrap()``.

vLLM 0.32's CPU kernel of the gated delta rule runs in bfloat16 only ("CPU GDN attention requires BF16"), so
the engine runs in bfloat16 and the answers are compared with the float32 wrapped model teacher-forced on
vLLM's tokens: every vLLM token is that model's greedy choice up to bfloat16 rounding (its log-probability
within :data:`BF16_ATOL` of the step's best) and vLLM's log-probabilities are within :data:`BF16_ATOL` of it at
every step and within :data:`BF16_MEAN_ATOL` of it on average over a prompt's steps. (Free-running greedy sequences of the two can part at a near tie: 3 of 9 cases on this checkpoint.)

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
    check_batch_equals_alone,
    check_plain_vllm,
    check_positions,
    load_hf,
    run_hf,
    run_vllm,
    vllm_request,
)
from test_vllm_qwen3 import (  # noqa: E402  (Qwen3-VL's cases and checks: the same processor and layout)
    CASES,
    FRAMES,
    check_slice_edges,
    check_slices_dry_run,
)

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import write_qwen3_5  # noqa: E402

pytestmark = pytest.mark.timeout(900)
#: the engine's dtype (vLLM's CPU Gated DeltaNet kernel takes bfloat16 only)
ENGINE = dict(ENGINE_ARGS, dtype="bfloat16")
#: how far a bfloat16 engine's log-probability may lie from the float32 model's at one step. vLLM's CPU kernel
#: keeps the gated delta rule's state in bfloat16 (transformers' runs it in float32, so the HF model in bfloat16
#: stays within 0.03 of it on the chosen tokens): measured up to 0.11 at one decode step of the MoE checkpoint, 0.04 elsewhere
BF16_ATOL = 0.15
#: ... and on average over a prompt's steps: measured at most 0.03 on the right context, at least 0.11 when the
#: reference keeps other tokens (another random draw, another method, a budget one token larger)
BF16_MEAN_ATOL = 0.05


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def forced_logprobs(hf, kind: str, method, tokens: list[list[int]], **budget) -> list[torch.Tensor]:
    """Per prompt of ``kind``: the log-probabilities [steps, vocab] of the HF model (wrapped with ``method``
    where given) at each step of ``generate()`` forced to decode ``tokens`` (vLLM's): the prompt's prefill,
    then one cached step per token, as wrap() generates (CDPruner's question is the prompt's)."""
    import vlm_prune

    model, proc = hf
    if method is not None:
        vlm_prune.wrap(model, method, processor=proc, **budget)
    try:
        out = []
        for prompt, media, new in zip(PROMPTS[kind], _media(kind, FRAMES), tokens):
            inputs = hf_inputs(proc, prompt, media)
            n = inputs["input_ids"].shape[1]
            with torch.no_grad():
                res = model.generate(**inputs, max_new_tokens=len(new), min_new_tokens=len(new), do_sample=False,
                                     prefix_allowed_tokens_fn=lambda _, ids, new=new: [new[ids.shape[-1] - n]],
                                     output_logits=True, return_dict_in_generate=True)
            assert res.sequences[0, n:].tolist() == new
            out.append(torch.log_softmax(torch.cat(res.logits).float(), -1))
        return out
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def hf_inputs(proc, prompt: str, media: dict) -> dict:
    """The HF processor's inputs of one prompt, as run_hf builds them."""
    from test_vllm_qwen import meta
    from transformers.video_utils import VideoMetadata

    extra = {}
    if "video" in media:
        info = VideoMetadata(**{k: v for k, v in meta(len(media["video"])).items() if k != "do_sample_frames"})
        extra = {"videos": [media["video"]], "video_metadata": [info], "do_sample_frames": False}
    return dict(proc(images=media.get("image"), text=prompt, return_tensors="pt", **extra))


def check_greedy_up_to_bf16(hf, kind: str, method, tokens: list[list[int]], logprobs: list[list[float]], **budget):
    """vLLM's tokens are the (wrapped) float32 model's greedy choices up to bfloat16 rounding, its
    log-probabilities within BF16_ATOL of that model's at each step and BF16_MEAN_ATOL on average."""
    for new, lps, ref in zip(tokens, logprobs, forced_logprobs(hf, kind, method, tokens, **budget)):
        chosen = ref[torch.arange(len(new)), torch.tensor(new)]
        assert (ref.max(-1).values - chosen).max() < BF16_ATOL, (new, ref.argmax(-1).tolist())
        np.testing.assert_allclose(lps, chosen.numpy(), atol=BF16_ATOL)
        assert np.abs(np.asarray(lps) - chosen.numpy()).mean() < BF16_MEAN_ATOL, (lps, chosen.tolist())


@pytest.mark.parametrize("kind", ["image", "video"])
def test_keep_all_equals_unwrapped_hf(llm, hf, kind):
    tokens, logprobs = run_vllm(llm, kind, None, FRAMES)
    check_greedy_up_to_bf16(hf, kind, None, tokens, logprobs)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(checkpoint, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Qwen3.5 (both in bfloat16), bit for bit, on the image and
    the video prompts."""
    check_plain_vllm(checkpoint, llm, tmp_path, "Qwen3_5ForConditionalGeneration", dtype=ENGINE["dtype"])


@pytest.mark.parametrize("kind,method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(llm, hf, kind, method, budget):
    """The same kept tokens at the same (t, h, w) positions as wrap(same method, same budget) on Qwen3.5
    (the original ones; a video slice's own origin), and its greedy answer up to bfloat16 rounding."""
    _, _, ref_kept = run_hf(hf, kind, method, FRAMES, **budget)
    tokens, logprobs = run_vllm(llm, kind, method, FRAMES, **budget)
    check_greedy_up_to_bf16(hf, kind, method, tokens, logprobs, **budget)
    check_positions(llm, kind, method, FRAMES, ref_kept, **budget)


#: (kind, prompt index, method, budget or {} with no method: the engine's keep=1.0); video prompt 0 has an image too
MIXED = [("image", 0, "divprune", {"keep": 0.5}), ("video", 1, "uniform", {"keep": 0.5}), ("image", 1, None, {}),
         ("video", 0, "dycoke", {"keep": 0.5}), ("image", 0, "pool", {"budget": 5}), ("video", 1, "cdpruner", {"budget": 9}),
         ("video", 0, "divprune", {"budget": 4})]


def test_mixed_batch_equals_each_alone(llm):
    """Requests with different methods, budgets and media share a batch (the hybrid model's recurrent
    states per request): each answer and its prompt (slots) are what the request gets alone."""
    check_batch_equals_alone(llm, [vllm_request(PROMPTS[kind][i], _media(kind, FRAMES)[i], method, **budget)
                                   for kind, i, method, budget in MIXED])


def test_refusals_per_request(llm):
    """What Qwen3.5 cannot run in vLLM is refused per request with its reason; the engine serves on."""
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} needs the vision tower's attention"):
            run_vllm(llm, "image", name, keep=0.5)
    for name in ("fastvid", "holitom"):
        with pytest.raises(ValueError, match=f"{name} ranks a video's tokens by the attention"):
            run_vllm(llm, "video", name, keep=0.5)
    with pytest.raises(ValueError, match="vidcom2 gives each slice of a video its own share.* on Qwen3.5"):
        run_vllm(llm, "video", "vidcom2", keep=0.5)
    with pytest.raises(ValueError, match="keyscore chooses a video's slices from the tower's features, but on Qwen3.5"):
        run_vllm(llm, "video", "keyscore", keep=0.5)
    with pytest.raises(ValueError, match="quota is refused on Qwen3.5"):
        run_vllm(llm, "video", "quota", keep=0.5)
    with pytest.raises(ValueError, match="prunes inside the language model"):
        run_vllm(llm, "image", "fastv", keep=0.5)
    tokens, _ = run_vllm(llm, "image", "divprune", FRAMES, keep=0.5)
    assert len(tokens) == 2 and all(len(t) == 6 for t in tokens)


def test_the_dry_run_sees_the_real_slices(llm, monkeypatch):
    """Qwen3-VL's check (the engine's bfloat16 here)."""
    check_slices_dry_run(llm, monkeypatch)


def test_edge_specs_keep_the_engine(llm):
    check_slice_edges(llm)
