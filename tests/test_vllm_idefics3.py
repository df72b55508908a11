"""vlm_prune inside vLLM on Idefics3 and SmolVLM (issue 29): one vLLM engine per architecture on a tiny
random checkpoint (``vlm_prune.vllm.tiny.write_idefics3``: 32 px tiles pixel-shuffled to 4 x 4 tokens,
images resized to 64 px and split into 1 x 2 or 2 x 2 tiles plus a global tile, each tile its own run of
``<image>`` behind its text markers), each request with its own method and budget. The answers, the rows
the language model sees (in wrap()'s order: each kept token behind its own tile's marker) and their
positions must equal ``wrap()``'s on the Hugging Face model, the budget counting over all of an image's
tiles.

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped. vLLM's SmolVLM
class needs the num2words package (SmolVLMProcessor); without it the SmolVLM engine's tests are skipped.
"""
from __future__ import annotations

import importlib.util
import json
import os

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
from test_vllm_qwen import load_hf  # noqa: E402  (float32, SDPA, eval; and its processor)
from vlm_prune.vllm.tiny import Idefics3Shape, idefics3_token_ids, write_idefics3  # noqa: E402
from test_vllm_internvl import check_mixed, check_plain_vllm, plain_main, run_vllm  # noqa: E402  (the same helpers)
from vllm_safety_checks import check_dry_run_sees_the_item, check_edges_keep_the_engine  # noqa: E402

pytestmark = pytest.mark.timeout(900)
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"image": 2}}
STEPS = 6
IDS = idefics3_token_ids(Idefics3Shape())
IMAGE, GLOBAL = IDS["<image>"], IDS["<global-img>"]
#: (prompt, image sizes (width, height), processor kwargs): a 64 x 32 image split into 1 x 2 tiles + its
#: global tile (48 tokens, no grid); an image the processor does not split (its global tile: a 4 x 4
#: grid); two images in one prompt (2 x 2 tiles + global, 80 tokens; 1 x 2 + global), ranks and one question
PROMPTS = [("<s> user : <image> w5 w6 w7 w8 assistant :", [(64, 32)], {}),
           ("<s> user : w9 <image> w10 w11 w12 w13 w14 assistant :", [(48, 40)], {"do_image_splitting": False}),
           ("<s> user : <image> w15 <image> w16 w17 assistant :", [(64, 64), (32, 64)], {})]
CASES = [("random", {"keep": 0.5}), ("random", {"budget": 3}), ("pool", {"keep": 0.25}),
         ("pool", {"budget": 5}),  # 5 of a 4 x 4 grid (row bands), 5 of 48 / 80 tokens without a grid (1-D)
         ("divprune", {"keep": 0.5}), ("divprune", {"budget": 7}), ("cdpruner", {"keep": 0.5}),
         ("cdpruner", {"budget": 6}), ("pool", {"budget": 20})]  # 20: the one-tile image keeps all its 16
#: SmolVLM runs the same plugin code (its processor class differs): keep-all and one case of each kind
CASES_SMOLVLM = [("divprune", {"keep": 0.5}), ("pool", {"budget": 5}), ("cdpruner", {"budget": 6})]
HAS_NUM2WORDS = importlib.util.find_spec("num2words") is not None


def _images() -> list[list[Image.Image]]:
    rng = np.random.RandomState(0)
    return [[Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for w, h in sizes]
            for _, sizes, _ in PROMPTS]


def _case_id(method, budget) -> str:
    return f"{method}-{'-'.join(f'{k}{v}' for k, v in budget.items())}"


@pytest.fixture(scope="module", params=[False, True], ids=["idefics3", "smolvlm"])
def arch(request, tmp_path_factory):
    """(checkpoint folder, smolvlm) of one architecture; its engine and HF model live while its tests run."""
    smolvlm = request.param
    if smolvlm and not HAS_NUM2WORDS:
        pytest.skip("vLLM's SmolVLM class builds SmolVLMProcessor, which needs num2words (not installed here; "
                    ".ci/vllm-env installs it)")
    return write_idefics3(tmp_path_factory.mktemp("idefics3") / "tiny", Idefics3Shape(smolvlm=smolvlm), seed=0), smolvlm


@pytest.fixture(scope="module")
def llm(arch):
    engine = vp.LLM(str(arch[0]), "random", keep=1.0, allow_mm_kwargs="do_image_splitting", **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(arch):
    return load_hf(arch[0])


def request(i: int, method=None, **budget) -> dict:
    prompt, _, kwargs = PROMPTS[i]
    req = {"prompt": prompt, "multi_modal_data": {"image": _images()[i]}}
    extra = dict(kwargs)
    if method is not None:
        extra.update(vp.request_kwargs(method, **budget))
    if extra:
        req["mm_processor_kwargs"] = extra
    return req


def image_spans(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first, last, tokens) of each image of a prompt: from its first to its last ``<image>`` (the run
    behind its ``<global-img>`` ends it), and its count of ``<image>``."""
    spans, first, count = [], None, 0
    for r, t in enumerate(ids):
        if t != IMAGE:
            continue
        first = r if first is None else first
        count += 1
        if ids[r - count_run(ids, r)] == GLOBAL and (r + 1 == len(ids) or ids[r + 1] != IMAGE):
            spans.append((first, r, count))
            first, count = None, 0
    return spans


def count_run(ids: list[int], r: int) -> int:
    """Length of the run of ``<image>`` that ends at row ``r`` (so ids[r - length] is its marker)."""
    n = 0
    while r - n >= 0 and ids[r - n] == IMAGE:
        n += 1
    return n


def run_hf(hf, method=None, **budget) -> tuple[list, list, list, list]:
    """Per prompt: the ids the language model sees as vLLM's prompt holds them (the dropped image rows
    removed; a pruned image's markers between its first and last ``<image>`` read ``<image>``, since the
    encoder fills those slots with the markers' embeddings), greedy tokens, their log-probabilities and the
    positions of the rows vLLM fills (kept tokens; a pruned image's in-between markers too)."""
    model, proc = hf
    if method is not None:
        vlm_prune.wrap(model, method, processor=proc, **budget)
    try:
        prompts, tokens, logprobs, kept = [], [], [], []
        for (prompt, _, kwargs), images in zip(PROMPTS, _images()):
            inputs = proc(images=[images], text=prompt, return_tensors="pt", **kwargs)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            ids = inputs["input_ids"][0].tolist()
            new = out.sequences[0, len(ids):]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            rows = (list(range(len(ids))) if method is None
                    else [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0])
            seen, filled = [ids[r] for r in rows], set()
            for first, last, count in image_spans(ids):
                inside = [j for j, r in enumerate(rows) if first <= r <= last]
                if sum(ids[rows[j]] == IMAGE for j in inside) == count:  # kept whole: written as vLLM writes it
                    filled.update(j for j in inside if ids[rows[j]] == IMAGE)
                    continue
                filled.update(inside)
                for j in inside:
                    seen[j] = IMAGE
            prompts.append(seen)
            vision = model.vlm_prune.methods.get("vision") if method is not None else None
            renumber = getattr(vision, "renumber_positions", False)
            kept.append([j if renumber else rows[j] for j in sorted(filled)])
        return prompts, tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def image_positions(llm) -> list[int]:
    """Positions of the rows the encoder filled in the engine's latest prefill."""
    return llm.apply_model(lambda m: m.last_image_positions)[0]


def test_keep_all_equals_unwrapped_hf(llm, hf):
    prompts, tokens, logprobs = run_vllm(llm, [request(i) for i in range(len(PROMPTS))])
    ref_prompts, ref_tokens, ref_logprobs, _ = run_hf(hf)
    assert prompts == ref_prompts
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(arch, llm, hf, method, budget):
    """Same rows in the same order as wrap(same method, same budget) (the prompt, up to the in-between
    markers' ids), same greedy tokens and log-probabilities, and every filled row at wrap()'s position
    (its original one; renumbered for DivPrune / CDPruner, whose official code feeds the shorter sequence)."""
    from vllm import SamplingParams

    if arch[1] and (method, budget) not in CASES_SMOLVLM:
        pytest.skip("CASES_SMOLVLM covers SmolVLM: the plugin runs the same code on both")
    ref_prompts, ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, **budget)
    prompts, tokens, logprobs = run_vllm(llm, [request(i, method, **budget) for i in range(len(PROMPTS))])
    assert prompts == ref_prompts
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i in range(len(PROMPTS)):
        llm.generate(request(i, method, **budget), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def test_budget_counts_over_all_tiles(llm):
    """budget=5 / keep=0.25 on the 1 x 2-split image (3 tiles, 48 tokens): 5 / 12 kept for the whole image,
    not per tile; its 2 in-between markers (<fake_token_around_image><row_1_col_2>) and the 2 before its
    global tile stay, filled by the encoder."""
    prompts, _, _ = run_vllm(llm, [request(0, "pool", budget=5), request(0, "divprune", keep=0.25), request(0)])
    assert [p.count(IMAGE) for p in prompts] == [5 + 4, 12 + 4, 48]
    assert len(prompts[2]) - len(prompts[0]) == 48 - 5


def test_mixed_batch_equals_each_alone(arch, llm):
    """Requests with different methods and budgets in one batch (one engine step) answer as each alone."""
    if arch[1]:
        pytest.skip("Idefics3's engine checks it (the same plugin code)")
    check_mixed(llm, [request(0, "divprune", keep=0.5), request(1, "pool", budget=5), request(2, "cdpruner", budget=6),
                      request(1), request(2, "random", keep=0.25)])


def test_refusals_per_request(llm):
    """Methods wrap() refuses on Idefics3 / SmolVLM are refused per request with the reason (the engine
    serves on); in-LLM methods and frames methods with vLLM's."""
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} ranks an image's tokens by the vision tower's feature-layer "
                                             "attention.*Idefics3 / SmolVLM"):
            run_vllm(llm, [request(0, name, keep=0.5)])
    with pytest.raises(ValueError, match="frames method 'uniform' chooses video frames"):
        run_vllm(llm, [request(0, "uniform", keep=0.5)])
    with pytest.raises(ValueError, match="prunes inside the language model"):
        fastv = json.dumps({"method": "fastv", "keep": 0.5})
        run_vllm(llm, [{**request(0), "mm_processor_kwargs": {"vlm_prune": fastv}}])
    _, tokens, _ = run_vllm(llm, [request(0, "divprune", keep=0.5)])
    assert len(tokens[0]) == STEPS


def plain_vllm_main(model: str, out: str) -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`: vLLM's own class on ``model``."""
    plain_main(model, out, ENGINE_ARGS, [request(i) for i in range(len(PROMPTS))])


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(arch, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Idefics3 class, bit for bit: prompt tokens, greedy
    tokens, log-probabilities (the language model on one position row with vLLM's own rotary; the offset channels
    add nothing)."""
    if arch[1]:
        pytest.skip("one architecture: SmolVLM runs the same plugin code (its keep-all equals HF above)")
    check_plain_vllm("test_vllm_idefics3", arch[0], llm, tmp_path, "Idefics3ForConditionalGeneration",
                     [request(i) for i in range(len(PROMPTS))])


def test_the_dry_run_sees_the_real_image(llm, monkeypatch):
    """The processor dry-runs a split image on all its tiles' tokens (no grid) and an unsplit one on its grid, at
    the engine's width and dtype (docs/serving-safety.md); its slots (less the markers) are the prompt's."""
    spec = {"method": "divprune", "keep": 0.5, "seed": 11}
    assert check_dry_run_sees_the_item(llm, request(0), spec, monkeypatch)[1][1] is None
    assert check_dry_run_sees_the_item(llm, request(1), spec, monkeypatch)[1][1] is not None


def test_edge_specs_keep_the_engine(llm):
    """Float knobs and budgets at the edges: each refused with a 400 or answered; the engine answers on."""
    check_edges_keep_the_engine(llm, request(0))
