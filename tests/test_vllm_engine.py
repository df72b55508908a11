"""vlm_prune inside vLLM (issue 19): one vLLM engine on a tiny LLaVA-1.5 checkpoint, shared by every
test here; each request picks its method and budget (``mm_processor_kwargs``).

Needs vLLM: CI installs it in a second environment (.ci/run) and runs this module there; in an
environment without vLLM the module is skipped with that reason.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: apply_model, fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared CI machine: no pinned spinning threads

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import vlm_prune  # noqa: E402
import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import LlavaShape, write_llava  # noqa: E402

pytestmark = pytest.mark.timeout(900)
STEPS = 6
PROMPTS = ["<s> user : <image> w5 w6 w7 w8 assistant :", "<s> user : w9 <image> w10 w11 w12 w13 w14 assistant :"]
CASES = [("random", {"keep": 0.5}), ("random", {"budget": 3}), ("pool", {"keep": 0.25}), ("divprune", {"keep": 0.5}),
         ("divprune", {"budget": 2}), ("cdpruner", {"keep": 0.5}), ("cdpruner", {"budget": 5}),
         ("visionzip", {"keep": 0.5}), ("visionzip", {"budget": 6})]


def _images() -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(32, 32, 3) * 255).astype("uint8")) for _ in PROMPTS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llava(tmp_path_factory.mktemp("llava") / "tiny", LlavaShape(), seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, enforce_eager=True, dtype="float32", max_model_len=256,
                    max_num_seqs=4, seed=0)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(1)
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model, AutoProcessor.from_pretrained(checkpoint)


def run_vllm(llm, method: str | None, **budget):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    requests = []
    for prompt, image in zip(PROMPTS, _images()):
        req = {"prompt": prompt, "multi_modal_data": {"image": image}}
        if method is not None:
            req["mm_processor_kwargs"] = vp.request_kwargs(method, **budget)
        requests.append(req)
    outs = llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def run_hf(hf, method: str | None, **budget):
    """Greedy tokens, their log-probabilities and the kept visual rows of the wrapped HF model."""
    model, proc = hf
    if method is not None:
        vlm_prune.wrap(model, method, processor=proc, **budget)
    try:
        tokens, logprobs, kept = [], [], []
        for prompt, image in zip(PROMPTS, _images()):
            inputs = proc(images=image, text=prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            new = out.sequences[0, inputs["input_ids"].shape[1]:]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            ids = inputs["input_ids"][0]
            if method is not None:
                rows = model.vlm_prune.last_rows[0]
                kept.append([int(r) for r in rows if r >= 0 and ids[r] == model.config.image_token_id])
        return tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def image_positions(llm) -> list[int]:
    """Positions of the image rows in the engine's latest prefill."""
    return llm.apply_model(lambda m: m.last_image_positions)[0]


@pytest.mark.parametrize("key", ["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                                 "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
                                 "vision_tower.encoder.layers.0.mlp.fc1.weight",
                                 "model.vision_tower.encoder.layers.0.mlp.fc1.weight"])
def test_checkpoint_namings_all_load(key):
    """The hub's naming and transformers 5's (CLIP without vision_model.) map to the same weight."""
    from vlm_prune.vllm.llava import VlmPruneLlavaForConditionalGeneration as M

    assert M.hf_to_vllm_mapper._map_name(key) == "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert M.hf_to_vllm_mapper._map_name("model.language_model.norm.weight") == "language_model.model.norm.weight"


def test_keep_all_equals_unwrapped_hf(llm, hf):
    tokens, logprobs = run_vllm(llm, None)
    ref_tokens, ref_logprobs, _ = run_hf(hf, None)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("method,budget", CASES, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in b.items())}" for m, b in CASES])
def test_method_equals_wrapped_hf(llm, hf, method, budget):
    """Same greedy tokens and log-probabilities as wrap(same method, same budget), and the same
    kept tokens at the same positions (the original ones)."""
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, **budget)
    tokens, logprobs = run_vllm(llm, method, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    # one request at a time: the kept tokens of each image and where the language model saw them
    for i, (prompt, image) in enumerate(zip(PROMPTS, _images())):
        from vllm import SamplingParams

        llm.generate({"prompt": prompt, "multi_modal_data": {"image": image},
                      "mm_processor_kwargs": vp.request_kwargs(method, **budget)},
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        # each image row's position is its slot's original position plus the offset the encoder sent
        # with the kept token (the index it kept): the kept tokens, where the language model saw them
        # (VisionZip packs its tokens into the image's first slots, as wrap() does)
        assert image_positions(llm) == ref_kept[i]
