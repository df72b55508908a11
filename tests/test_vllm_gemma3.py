"""vlm_prune inside vLLM on Gemma 3 (issue 29): one vLLM engine on a tiny random checkpoint
(``vlm_prune.vllm.tiny.write_gemma3``: SigLIP's 8 x 8 patches pooled to 16 soft tokens per image between
Gemma 3's image markup; sliding-window and global layers with their own rotary tables, the global ones
linearly scaled), each request with its own method and budget. The answers must equal ``wrap()``'s on the
Hugging Face model, the kept tokens must sit at wrap()'s positions (the original ones, or renumbered where
the method's official code renumbers), and with nothing pruned the plugin must be vLLM's own Gemma 3.

vLLM's CPU build attends causally among an image's tokens (its attention backend ignores the bidirectional
ranges of ``is_mm_prefix_lm`` models; docs/design/vllm-plugin.md, "Gemma 3"), so the reference is the Hugging Face model
fed without ``token_type_ids`` (causal too); ``test_cpu_build_attends_causally`` pins that fact.

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: apply_model, fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import vlm_prune  # noqa: E402
import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.methods.divprune import DivPrune  # noqa: E402
from vlm_prune.vllm.config import SpecError, validate_spec  # noqa: E402
from vlm_prune.vllm.gemma3 import PAN_AND_SCAN_REFUSAL  # noqa: E402
from vlm_prune.vllm.tiny import write_gemma3  # noqa: E402

from test_vllm_qwen import load_hf  # noqa: E402  (float32, SDPA, eval; and its processor)
from vllm_safety_checks import check_dry_run_sees_the_item, check_edges_keep_the_engine  # noqa: E402

pytestmark = pytest.mark.timeout(900)
STEPS = 6
IMAGE = "<start_of_image>"
#: one image in the first prompt, two in the second (ranks 0 and 1: random's generator, two shifts)
PROMPTS = [f"<s> user : {IMAGE} w5 w6 w7 assistant :", f"<s> user : w9 w10 {IMAGE} w11 {IMAGE} w12 w13 assistant :"]
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"image": 2}}
#: (method, knobs, budget); 16 soft tokens per image on a 4 x 4 grid
CASES = [("random", {}, {"keep": 0.5}), ("random", {}, {"budget": 3}), ("pool", {}, {"keep": 0.25}),
         ("pool", {}, {"budget": 5}),  # 5 cells: no product grid
         ("divprune", {}, {"keep": 0.5}), ("divprune", {}, {"budget": 5}), ("divprune", {"positions": "keep"}, {"keep": 0.5}),
         ("cdpruner", {}, {"keep": 0.5}), ("cdpruner", {}, {"budget": 6})]
#: methods whose official code feeds the language model the shorter sequence on 1-D positions (wrap() too)
RENUMBERS = ("divprune", "cdpruner")


def _images() -> list[list[Image.Image]]:
    rng = np.random.RandomState(0)
    pics = [Image.fromarray((rng.rand(32, 32, 3) * 255).astype("uint8")) for _ in range(3)]
    return [pics[:1], pics[1:]]


@dataclass(frozen=True)
class Family:
    """What the shared helpers need of a family's test: its prompts, their images, vLLM's own class, and the
    tokens whose rows wrap() reports as an image's (its visual tokens; Mistral 3: and the row breaks)."""

    prompts: list[str]
    images: Callable[[], list[list[Image.Image]]]
    served: str
    rows: tuple[str, ...]


GEMMA3 = Family(PROMPTS, _images, "Gemma3ForConditionalGeneration", ("<image_soft_token>",))


def _method(name: str, knobs: dict):
    return DivPrune(**knobs) if knobs else name


def _case_id(name: str, knobs: dict, budget: dict) -> str:
    return "-".join([name, *(f"{k}{v}" for k, v in {**knobs, **budget}.items())])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny", seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def request(prompt: str, images: list, method=None, knobs: dict | None = None, **budget) -> dict:
    req = {"prompt": prompt, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}
    if method is not None:
        req["mm_processor_kwargs"] = vp.request_kwargs(_method(method, knobs or {}), **budget)
    return req


def answers(outs) -> tuple[list, list, list]:
    """(prompt token ids, greedy tokens, their log-probabilities) of vLLM's outputs."""
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return [list(o.prompt_token_ids) for o in outs], tokens, logprobs


def run_vllm(llm, method=None, knobs: dict | None = None, fam: Family = GEMMA3, **budget) -> tuple[list, list, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    reqs = [request(p, im, method, knobs, **budget) for p, im in zip(fam.prompts, fam.images())]
    return answers(llm.generate(reqs, params, use_tqdm=False))


def run_hf(hf, method=None, knobs: dict | None = None, bidirectional: bool = False, fam: Family = GEMMA3, **budget):
    """Prompt ids, greedy tokens, log-probabilities and the positions of the kept image rows (``fam.rows``)
    of the (wrapped) HF model; Gemma 3 causal unless ``bidirectional`` (then with the processor's
    token_type_ids)."""
    model, proc = hf
    if method is not None:
        vlm_prune.wrap(model, _method(method, knobs or {}), processor=proc, **budget)
    try:
        ids, tokens, logprobs, kept = [], [], [], []
        image_rows = set(proc.tokenizer.convert_tokens_to_ids(list(fam.rows)))
        for prompt, images in zip(fam.prompts, fam.images()):
            inputs = proc(images=images, text=prompt, return_tensors="pt")
            if not bidirectional:
                inputs.pop("token_type_ids", None)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True)
            n = inputs["input_ids"].shape[1]
            new = out.sequences[0, n:]
            ids.append(inputs["input_ids"][0].tolist())
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            if method is not None:
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0]
                renumber = method in RENUMBERS and not knobs
                kept.append([i if renumber else r for i, r in enumerate(rows) if ids[-1][r] in image_rows])
        return ids, tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def image_positions(llm) -> list[int]:
    """Positions of the image rows (in prompt order) of the engine's latest prefill."""
    return llm.apply_model(lambda m: m.last_image_positions)[0]


def test_keep_all_equals_unwrapped_hf(llm, hf):
    """Nothing pruned: the Hugging Face model's prompt (Gemma 3's image markup as its processor writes it),
    greedy tokens and log-probabilities."""
    ids, tokens, logprobs = run_vllm(llm)
    ref_ids, ref_tokens, ref_logprobs, _ = run_hf(hf)
    assert ids == ref_ids
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


def test_cpu_build_attends_causally(llm, hf):
    """vLLM's CPU build (its own Gemma 3 too: test_keep_all_equals_plain_vllm) attends causally among an
    image's tokens: the Hugging Face model with token_type_ids (bidirectional image blocks) is far from it,
    the one without them (causal) is within 2e-4 (the test above)."""
    _, _, logprobs = run_vllm(llm)
    _, _, bidirectional, _ = run_hf(hf, bidirectional=True)
    assert np.abs(np.array(logprobs) - np.array(bidirectional)).max() > 1e-2


def plain_vllm_main(model: str, out: str, module: str) -> None:
    """The child of :func:`check_plain_vllm`: vLLM's own class on ``model``, the prompts of test ``module``."""
    import importlib

    import vllm

    fam = importlib.import_module(module).FAMILY
    llm = vllm.LLM(model=model, **ENGINE_ARGS)
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    with open(out, "w") as f:
        json.dump({"class": served, "answers": run_vllm(llm, fam=fam)}, f)
    llm.llm_engine.engine_core.shutdown()


FAMILY = GEMMA3


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(checkpoint, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Gemma 3 bit for bit (its rotary tables per layer type,
    the image markup, the offset channels stripped)."""
    check_plain_vllm(checkpoint, llm, tmp_path, "test_vllm_gemma3")


def check_plain_vllm(checkpoint, llm, tmp_path, module: str) -> None:
    """The plugin's engine ``llm`` (nothing pruned) answers test ``module``'s prompts as vLLM's own class
    does on ``checkpoint``, bit for bit, with the same prompt ids; vLLM's engine runs in a child process
    (a second engine in this one would share its global state)."""
    import importlib
    import subprocess
    import sys

    from test_vllm_engine import Child

    fam = importlib.import_module(module).FAMILY
    out = tmp_path / "result.json"
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_vllm_gemma3 as t; t.plain_vllm_main(*sys.argv[2:])"
    child = Child([sys.executable, "-c", code, os.path.dirname(__file__), str(checkpoint), str(out), module],
                  tmp_path / "log")
    try:
        child.proc.wait(500)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the engine did not answer in 500 s:\n{child.log_tail()}") from None
    finally:
        child.stop()
    assert child.proc.returncode == 0, f"the engine failed ({child.proc.returncode}):\n{child.log_tail()}"
    plain = json.loads(out.read_text())
    assert plain["class"] == fam.served
    ids, tokens, logprobs = plain["answers"]
    ref_ids, ref_tokens, ref_logprobs = run_vllm(llm, fam=fam)
    assert ids == ref_ids
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logprobs, ref_logprobs)


@pytest.mark.parametrize("method,knobs,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(llm, hf, method, knobs, budget):
    """Same prompt (the method's count of soft tokens inside the markup), greedy tokens and
    log-probabilities as wrap(same method, same budget), and the kept tokens at the same positions."""
    from vllm import SamplingParams

    ref_ids, ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, knobs, **budget)
    ids, tokens, logprobs = run_vllm(llm, method, knobs, **budget)
    image = hf[0].config.image_token_index
    k = vp_count(method, knobs, budget)
    assert [p.count(image) for p in ids] == [k * len(ims) for ims in _images()]
    assert [[t for t in p if t != image] for p in ids] == [[t for t in p if t != image] for p in ref_ids]
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i, (prompt, images) in enumerate(zip(PROMPTS, _images())):
        llm.generate(request(prompt, images, method, knobs, **budget), SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def vp_count(method: str, knobs: dict, budget: dict, n: int = 16) -> int:
    """The visual tokens wrap() keeps of an image's ``n`` (the README's budget: visual tokens per image)."""
    from vlm_prune.vllm.config import method_of, method_spec

    return method_of(method_spec(_method(method, knobs), **budget)).n_keep(n, 1)


def test_mixed_batch_equals_each_alone(llm):
    """Requests with different methods and budgets in one batch get the answers each gets alone."""
    check_mixed_batch(llm, GEMMA3)


def check_mixed_batch(llm, fam: Family) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    mix = [("divprune", {}, {"keep": 0.5}), ("pool", {}, {"budget": 4}), ("random", {}, {"budget": 3}),
           (None, None, {}), ("cdpruner", {}, {"keep": 0.25}), ("divprune", {"positions": "keep"}, {"budget": 2})]
    reqs = [request(fam.prompts[i % 2], fam.images()[i % 2], m, k, **b) for i, (m, k, b) in enumerate(mix)]
    together = answers(llm.generate(reqs, params, use_tqdm=False))
    alone = [answers(llm.generate([r], params, use_tqdm=False)) for r in reqs]
    for j, single in enumerate(alone):
        assert together[0][j] == single[0][0] and together[1][j] == single[1][0], mix[j]
        np.testing.assert_allclose(together[2][j], single[2][0], atol=1e-5)
    assert len({len(ids) for ids in together[0]}) > 2  # the budgets made different prompts


def refusals(title: str) -> list[tuple[str, str]]:
    """(method, the reason's words) of the methods an image-only family cannot run in vLLM."""
    return [*((name, f"method '{name}' runs on the llava, llava_onevision models, not on {title}")
              for name in ("visionzip", "fastervlm", "vispruner")),
            *((name, f"frames method '{name}' chooses video frames") for name in ("uniform", "keyscore", "quota")),
            ("fastv", "prunes inside the language model"), ("tome", "acts in the 'vit' stage")]


@pytest.mark.parametrize("name,message", refusals("Gemma 3"))
def test_refusals_per_request(llm, checkpoint, name, message):
    """Methods vLLM cannot run on Gemma 3 are refused per request (the server's HTTP 400), by
    validate_spec for the model, and for the engine before vLLM starts."""
    check_refusal(llm, checkpoint, GEMMA3, name, message)


def check_refusal(llm, checkpoint, fam: Family, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_vllm(llm, name, fam=fam, keep=0.5)
    with pytest.raises(SpecError, match=message):
        validate_spec({"method": name, "keep": 0.5}, fam.served)
    engine = "QuoTA's token count per video follows its frame scores" if name == "quota" else message
    with pytest.raises(ValueError, match=engine):  # (quota: never an engine's method, on any model)
        vp.engine_kwargs(str(checkpoint), name, keep=0.5)
    if name == "visionzip":  # the reason names what runs instead
        with pytest.raises(SpecError, match="use random, pool, divprune, cdpruner"):
            validate_spec({"method": name, "keep": 0.5}, fam.served)


def test_pan_and_scan_is_refused(llm):
    """Pan and scan's crops would be extra images inside one vLLM item: refused with the reason (engine-wide);
    a request's own do_pan_and_scan is refused before that as a processor setting the operator did not allow
    (docs/serving-safety.md)."""
    from vllm import SamplingParams

    wide = Image.fromarray((np.random.RandomState(1).rand(32, 96, 3) * 255).astype("uint8"))
    req = {"prompt": PROMPTS[0], "multi_modal_data": {"image": wide},
           "mm_processor_kwargs": {**vp.request_kwargs("divprune", keep=0.5), "do_pan_and_scan": True,
                                   "pan_and_scan_min_crop_size": 16}}
    with pytest.raises(ValueError, match="mm_processor_kwargs.do_pan_and_scan: not accepted"):
        llm.generate(req, SamplingParams(max_tokens=1), use_tqdm=False)
    assert "do_pan_and_scan false" in PAN_AND_SCAN_REFUSAL


def test_the_dry_run_sees_the_real_image(llm, monkeypatch):
    """The processor dry-runs each image on its own soft tokens, on their grid, at the engine's width and dtype
    (docs/serving-safety.md), and its slots are the prompt's."""
    _, shape, _ = check_dry_run_sees_the_item(llm, request(PROMPTS[0], _images()[0]),
                                              {"method": "divprune", "keep": 0.5, "seed": 11}, monkeypatch)
    assert shape[1] is not None  # the encoder's square grid


def test_edge_specs_keep_the_engine(llm):
    """Float knobs and budgets at the edges: each refused with a 400 or answered; the engine answers on."""
    check_edges_keep_the_engine(llm, request(PROMPTS[0], _images()[0]))
