"""vlm_prune inside vLLM on Mistral 3 (issue 29): one vLLM engine on a tiny random checkpoint
(``vlm_prune.vllm.tiny.write_mistral3``: a Pixtral tower at each image's own resolution, 2 x 2 patches
merged, so a 32 x 48 px image is 4 rows of 6 tokens, each row ended by ``[IMG_BREAK]``, the image by
``[IMG_END]``), each request with its own method and budget. The answers must equal ``wrap()``'s on the
Hugging Face model, the kept tokens and the row breaks must sit at wrap()'s positions, and with nothing
pruned the plugin must be vLLM's own Mistral 3, prompt and answers bit for bit.

The shared helpers (requests, the HF reference, plain vLLM in a child process, mixed batches, refusals)
are test_vllm_gemma3's. Needs vLLM: CI runs this module in the vLLM environment (.ci/run).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from test_vllm_gemma3 import (  # noqa: E402
    ENGINE_ARGS,
    Family,
    _case_id,
    check_mixed_batch,
    check_plain_vllm,
    check_refusal,
    image_positions,
    load_hf,
    refusals,
    request,
    run_hf,
    run_vllm,
    vp_count,
)

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import write_mistral3  # noqa: E402
from vllm_safety_checks import check_dry_run_sees_the_item, check_edges_keep_the_engine  # noqa: E402

pytestmark = pytest.mark.timeout(900)
IMAGE = "[IMG]"
PROMPTS = [f"<s> user : {IMAGE} w5 w6 w7 assistant :", f"<s> user : w9 w10 {IMAGE} w11 {IMAGE} w12 w13 assistant :"]
#: (height, width) px of each prompt's images: 4 x 6, then 6 x 4 and 4 x 4 merged tokens (8 px a token)
SIZES = [[(32, 48)], [(48, 32), (32, 32)]]
CASES = [("random", {}, {"keep": 0.5}), ("random", {}, {"budget": 3}), ("pool", {}, {"keep": 0.25}),
         ("pool", {}, {"budget": 5}), ("divprune", {}, {"keep": 0.5}), ("divprune", {"positions": "keep"}, {"keep": 0.5}),
         ("cdpruner", {}, {"keep": 0.5}), ("cdpruner", {}, {"budget": 6})]


def _images() -> list[list[Image.Image]]:
    rng = np.random.RandomState(0)
    return [[Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes] for sizes in SIZES]


FAMILY = Family(PROMPTS, _images, "Mistral3ForConditionalGeneration", (IMAGE, "[IMG_BREAK]"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_mistral3(tmp_path_factory.mktemp("mistral3") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def test_keep_all_equals_unwrapped_hf(llm, hf):
    """Nothing pruned: the Hugging Face model's prompt (rows, breaks and end as Pixtral's processor writes
    them), greedy tokens and log-probabilities."""
    ids, tokens, logprobs = run_vllm(llm, fam=FAMILY)
    ref_ids, ref_tokens, ref_logprobs, _ = run_hf(hf, fam=FAMILY)
    assert ids == ref_ids
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(checkpoint, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Mistral 3 bit for bit: prompt ids (its own layout of
    rows and breaks), greedy tokens and log-probabilities."""
    check_plain_vllm(checkpoint, llm, tmp_path, "test_vllm_mistral3")


@pytest.mark.parametrize("method,knobs,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(llm, hf, method, knobs, budget):
    """wrap()'s greedy tokens and log-probabilities; each image keeps the method's count of its rows x cols
    tokens (breaks not counted) in k + rows - 1 slots (its kept tokens and its breaks) before [IMG_END],
    the rest of the prompt as HF's; the kept tokens and the breaks at wrap()'s positions."""
    from vllm import SamplingParams

    model, proc = hf
    ref_ids, ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, knobs, fam=FAMILY, **budget)
    ids, tokens, logprobs = run_vllm(llm, method, knobs, fam=FAMILY, **budget)
    image, brk = proc.tokenizer.convert_tokens_to_ids([IMAGE, "[IMG_BREAK]"])
    slots = [sum(vp_count(method, knobs, budget, (h // 8) * (w // 8)) + h // 8 - 1 for h, w in sizes) for sizes in SIZES]
    assert [p.count(image) for p in ids] == slots
    assert [[t for t in p if t != image] for p in ids] == [[t for t in p if t not in (image, brk)] for p in ref_ids]
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i, (prompt, images) in enumerate(zip(PROMPTS, _images())):
        llm.generate(request(prompt, images, method, knobs, **budget), SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def test_mixed_batch_equals_each_alone(llm):
    """Requests with different methods and budgets in one batch get the answers each gets alone."""
    check_mixed_batch(llm, FAMILY)


@pytest.mark.parametrize("name,message", refusals("Mistral 3"))
def test_refusals_per_request(llm, checkpoint, name, message):
    """Methods vLLM cannot run on Mistral 3 are refused per request, by validate_spec, and for the engine."""
    check_refusal(llm, checkpoint, FAMILY, name, message)


def test_the_dry_run_sees_the_real_image(llm, monkeypatch):
    """The processor dry-runs each image on its own rows x cols tokens (not the canonical probe's square; docs/
    serving-safety.md) at the engine's width and dtype; its slots (less the breaks) are the prompt's."""
    _, shape, _ = check_dry_run_sees_the_item(llm, request(PROMPTS[0], _images()[0]),
                                              {"method": "cdpruner", "keep": 0.5, "seed": 11}, monkeypatch)
    assert shape[1] == tuple(px // 8 for px in SIZES[0][0])  # (rows, cols): 8 px a merged token


def test_edge_specs_keep_the_engine(llm):
    """Float knobs and budgets at the edges: each refused with a 400 or answered; the engine answers on."""
    check_edges_keep_the_engine(llm, request(PROMPTS[0], _images()[0]))
