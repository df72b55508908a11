"""vlm_prune inside vLLM on LLaVA-NeXT (issue 29): anyres images (base image + tiles, unpadded, one
image_newline per row), the vision-stage methods wrap() runs there, against the Hugging Face model
wrapped with vlm_prune.wrap(). One engine on a tiny checkpoint (vlm_prune.vllm.tiny.write_llava_next),
shared by every test here; each request picks its method and budget (``mm_processor_kwargs``).

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import vlm_prune  # noqa: E402
import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.registry import make_method  # noqa: E402
from vlm_prune.vllm.tiny import LlavaNextShape, hub_naming, image_token_id, write_llava_next  # noqa: E402
from vllm_safety_checks import (  # noqa: E402
    EDGE_FLOATS,
    EDGE_SPECS,
    check_dry_run_sees_the_item,
    check_edges_keep_the_engine,
)

pytestmark = pytest.mark.timeout(900)
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"image": 2},
               "enable_prefix_caching": False}  # each request prefills its images (positions are read there)
STEPS = 5
#: a wide image (base + 2 tiles, unpadded columns), then two tall ones in one prompt (no square image: its base
#: image and its one tile would be the same pixels, duplicate tokens that DivPrune breaks ties between by noise)
PROMPTS = [("<s> user : <image> w5 w6 w7 w8 assistant :", ((40, 70),)),
           ("<s> user : w9 <image> w10 <image> w11 w12 w13 assistant :", ((56, 44), (70, 40)))]
CASES = [("random", {}, {"keep": 0.5}), ("random", {}, {"budget": 10}), ("pool", {}, {"keep": 0.25}),
         ("divprune", {}, {"keep": 0.5}), ("divprune", {"positions": "keep"}, {"budget": 7}),
         ("cdpruner", {}, {"keep": 0.25}), ("cdpruner", {}, {"budget": 9}),
         # HiRED: the budget over the base image and the tiles by early-layer [CLS] attention (layer 0 of 3),
         # each partition's top tokens by the feature layer's (layer 1)
         ("hired", {}, {"keep": 0.5}), ("hired", {}, {"budget": 20}),
         ("hired", {"alpha": 0.3, "positions": "keep"}, {"keep": 0.3})]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in {**kn, **b}.items())}" for m, kn, b in CASES]


def _images(sizes) -> list[Image.Image]:
    rng = np.random.RandomState(sum(h * w for h, w in sizes))
    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny checkpoint in the hub's naming, which vLLM's own LLaVA-NeXT loads too (the plugin's mapper takes
    either)."""
    folder = write_llava_next(tmp_path_factory.mktemp("llava_next") / "tiny", LlavaNextShape(), seed=0)
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


def _method(name: str, knobs: dict):
    return make_method(name, **knobs) if knobs else name


def requests(cases, prompts=PROMPTS) -> list[dict]:
    """One request per (prompt, case); case None: no spec (the engine's keep=1.0)."""
    out = []
    for (prompt, sizes), case in zip(prompts, cases):
        req = {"prompt": prompt, "multi_modal_data": {"image": _images(sizes)}}
        if case is not None:
            name, knobs, budget = case
            req["mm_processor_kwargs"] = vp.request_kwargs(_method(name, knobs), **budget)
        out.append(req)
    return out


def run_vllm(llm, reqs: list[dict]):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    outs = llm.generate(reqs, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    prompts = [list(o.prompt_token_ids) for o in outs]
    return tokens, logprobs, prompts


def hf_inputs(proc, prompt: str, sizes) -> dict:
    return proc(images=_images(sizes), text=prompt, return_tensors="pt")


def run_hf(hf, case, prompts=PROMPTS, inputs=hf_inputs, media_token: str = "image_token_id"):
    """Greedy tokens, their log-probabilities, the kept media rows (renumbered where the method renumbers) and
    the media slots wrap() keeps, per prompt (``inputs(processor, prompt, media)``: the processor's call)."""
    model, proc = hf
    if case is not None:
        name, knobs, budget = case
        vlm_prune.wrap(model, _method(name, knobs), processor=proc, **budget)
    try:
        tokens, logprobs, kept, slots = [], [], [], []
        media_id = getattr(model.config, media_token)
        for prompt, media in prompts:
            batch = inputs(proc, prompt, media)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            new = out.sequences[0, batch["input_ids"].shape[1]:]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            ids = batch["input_ids"][0]
            if case is not None:
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0]
                renumber = getattr(model.vlm_prune.methods.get("vision"), "renumber_positions", False)
                kept.append([j if renumber else r for j, r in enumerate(rows) if ids[r] == media_id])
                slots.append(sum(1 for r in rows if ids[r] == media_id))
        return tokens, logprobs, kept, slots
    finally:
        if case is not None:
            vlm_prune.unwrap(model)


def image_positions(llm) -> list[int]:
    return llm.apply_model(lambda m: m.last_image_positions)[0]


def test_keep_all_equals_unwrapped_hf(llm, hf):
    tokens, logprobs, prompt_ids = run_vllm(llm, requests([None, None]))
    ref_tokens, ref_logprobs, _, _ = run_hf(hf, None)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    model, proc = hf
    for ids, (prompt, sizes) in zip(prompt_ids, PROMPTS):  # vLLM's slots: HF's placeholders, newlines included
        assert ids == proc(images=_images(sizes), text=prompt, return_tensors="pt")["input_ids"][0].tolist()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_method_equals_wrapped_hf(llm, hf, case):
    """The same greedy tokens, log-probabilities, image slots and kept rows at the same positions
    (original, or renumbered where the official code feeds the shorter sequence) as wrap()."""
    ref_tokens, ref_logprobs, ref_kept, ref_slots = run_hf(hf, case)
    tokens, logprobs, prompt_ids = run_vllm(llm, requests([case, case]))
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    image_id = image_token_id(LlavaNextShape())
    assert [ids.count(image_id) for ids in prompt_ids] == ref_slots
    for i in range(len(PROMPTS)):  # one request at a time: where the language model saw the kept rows
        run_vllm(llm, requests([case], prompts=[PROMPTS[i]]))
        assert image_positions(llm) == ref_kept[i], PROMPTS[i][0]


def test_budget_is_the_readme_count_of_visual_tokens(llm):
    """keep / budget count an image's visual tokens (base + unpadded tiles), never its newlines: the wide
    image has 64 base + 112 tile tokens and 8 newlines; slots = the method's count + the newlines."""
    image_id = image_token_id(LlavaNextShape())
    counts = []
    for case in (None, ("divprune", {}, {"budget": 30}), ("hired", {}, {"keep": 0.5}), ("pool", {}, {"budget": 500})):
        counts.append(run_vllm(llm, requests([case], [PROMPTS[0]]))[2][0].count(image_id))
    assert counts == [184, 30 + 8, 88 + 8, 184]


def test_mixed_batch_equals_each_alone(llm):
    """One batch of requests with different methods and budgets (and one without a spec) gives each request
    what it gets alone."""
    cases = [CASES[3], CASES[7], None, CASES[5]]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    batch = run_vllm(llm, requests(cases, prompts))
    for i, (case, prompt) in enumerate(zip(cases, prompts)):
        alone = run_vllm(llm, requests([case], [prompt]))
        assert batch[0][i] == alone[0][0] and batch[2][i] == alone[2][0]
        np.testing.assert_allclose(batch[1][i], alone[1][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec, field, message", [
    ({"method": "visionzip", "keep": 0.5}, "vlm_prune.method", "visionzip reads one tower row per image, but a LLaVA-NeXT "
     "image is a base image plus anyres tiles"),
    ({"method": "fastervlm", "keep": 0.5}, "vlm_prune.method", "fastervlm supports llava, llava_onevision"),
    ({"method": "vispruner", "budget": 9}, "vlm_prune.method", "Use hired (per-tile [CLS] attention)"),
    ({"method": "prumerge", "keep": 0.5}, "vlm_prune.method", "wrap() refuses it there too (prumerge supports llava)"),
    ({"method": "hired"}, "vlm_prune.method", "hired without keep / budget keeps the official count on LLaVA-NeXT"),
    ({"method": "uniform", "keep": 0.5}, "vlm_prune.method", "frames method 'uniform' chooses video frames"),
    ({"method": "fastv", "keep": 0.5}, "vlm_prune", "paged KV cache"),
    ({"method": "hired", "keep": 0.5, "knobs": {"early_layer": 2}}, None, "hired early_layer=2: vLLM builds the "
     "tower's first 2 layers"),
])
def test_refusals_per_request(llm, spec, field, message):
    """What wrap() refuses on LLaVA-NeXT, and what vLLM cannot size before the encoder, is refused per request
    with its reason; the engine serves on."""
    from vllm import SamplingParams

    req = requests([None])[0]
    with pytest.raises(ValueError) as err:
        llm.generate({**req, "mm_processor_kwargs": {"vlm_prune": json.dumps(spec)}}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
    assert message in str(err.value)
    if field is not None:
        assert f"mm_processor_kwargs.{field}: " in str(err.value)
    tokens, _, _ = run_vllm(llm, requests([CASES[0]]))
    assert len(tokens[0]) == STEPS


def plain_vllm_main(model: str, out: str, engine_args: dict = ENGINE_ARGS, reqs=None) -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`: vLLM's own class on ``model``, unpruned."""
    import vllm

    llm = vllm.LLM(model=model, **engine_args)
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    with open(out, "w") as f:
        json.dump({"class": served, "result": list(run_vllm(llm, reqs or requests([None, None])))}, f)
    llm.llm_engine.engine_core.shutdown()


def check_plain_vllm(llm, checkpoint, tmp_path, module: str, served: str, reqs: list[dict]) -> None:
    """vLLM's own ``served`` class (in a child process, test module ``module``'s plain_vllm_main) and the plugin
    at keep=1.0 give the same prompt tokens, greedy tokens and log-probabilities, bit for bit."""
    from test_vllm_engine import plain_vllm_in_child

    plain = plain_vllm_in_child(tmp_path, str(checkpoint), module=module)
    assert plain["class"] == served
    tokens, logprobs, prompts = run_vllm(llm, reqs)
    assert plain["result"][0] == tokens and plain["result"][2] == prompts
    np.testing.assert_array_equal(plain["result"][1], logprobs)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(llm, checkpoint, tmp_path):
    """Nothing pruned, the plugin is vLLM's own LLaVA-NeXT bit for bit (three identical M-RoPE rows run vLLM's
    1-D rotary embeddings on one position row: llava.FirstPositionRow, plain_rotary)."""
    check_plain_vllm(llm, checkpoint, tmp_path, "test_vllm_llava_next", "LlavaNextForConditionalGeneration",
                     requests([None, None]))


def test_the_dry_run_sees_the_real_image(llm, monkeypatch):
    """The processor dry-runs an image on its visual tokens (base + unpadded tiles, not its newlines) at the
    engine's width and dtype, and a method that selects per crop (CDPruner, HiRED) on the image's own tile map
    (vLLM's packing, as the encoder builds it; docs/serving-safety.md)."""
    req = requests([None])[0]
    for name, crops in (("divprune", False), ("cdpruner", True), ("hired", True)):
        _, shape, _ = check_dry_run_sees_the_item(llm, req, {"method": name, "keep": 0.5, "seed": 11}, monkeypatch)
        assert (shape[3] is not None) == crops, name


def test_edge_specs_keep_the_engine(llm):
    """Float knobs (HiRED's alpha too, on the image's tiles) and budgets at the edges: each refused with a 400 or
    answered; the engine answers on."""
    hired = [{"method": "hired", "budget": 9, "knobs": {"alpha": v}} for v in EDGE_FLOATS + [0.0, 1.0]]
    check_edges_keep_the_engine(llm, requests([None])[0], EDGE_SPECS + hired)
