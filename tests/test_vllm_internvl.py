"""vlm_prune inside vLLM on InternVL (issue 29): one vLLM engine on a tiny random Hugging Face-format
InternVL checkpoint (``vlm_prune.vllm.tiny.write_internvl``: 32 px tiles pixel-shuffled to 4 x 4
tokens, images cut into tiles plus a thumbnail), served by vLLM's ``InternS1ForConditionalGeneration``
under the plugin; each request with its own method and budget. The answers, the prompt the language
model sees and the positions of the kept tokens must equal ``wrap()``'s on the Hugging Face model,
the budget counting over all of an image's tiles.

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

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
from vllm_safety_checks import check_dry_run_sees_the_item, check_edges_keep_the_engine  # noqa: E402
from vlm_prune.vllm.tiny import InternVLShape, internvl_token_ids, write_internvl  # noqa: E402

pytestmark = pytest.mark.timeout(900)
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "seed": 0,
               "limit_mm_per_prompt": {"image": 2, "video": 1}}
STEPS = 6
IMAGE = "<IMG_CONTEXT>"
VIDEO_ID = internvl_token_ids(InternVLShape())["<video>"]
#: (prompt, image sizes as (width, height), video frames): a one-tile image (its 4 x 4 grid), a 2-tile image
#: plus its thumbnail (48 tokens, no grid), two images in one prompt (ranks, one question for both), an
#: image then a 3-frame video (each frame its own run and item, as wrap() sees them), and a video then
#: an image (the image is wrap()'s fourth item: its generator)
PROMPTS = [(f"<s> user : {IMAGE} w5 w6 w7 w8 assistant :", [(32, 32)], 0),
           (f"<s> user : w9 {IMAGE} w10 w11 w12 w13 w14 assistant :", [(64, 32)], 0),
           (f"<s> user : {IMAGE} w15 {IMAGE} w16 w17 assistant :", [(32, 32), (32, 64)], 0),
           (f"<s> user : {IMAGE} w18 <video> w19 w20 assistant :", [(32, 32)], 3),
           (f"<s> user : <video> w21 {IMAGE} w22 assistant :", [(32, 32)], 3)]
CASES = [("random", {"keep": 0.5}), ("random", {"budget": 3}), ("pool", {"keep": 0.25}),
         ("pool", {"budget": 5}),  # 5 of a 4 x 4 grid (row bands), 5 of 48 tokens without a grid (1-D)
         ("divprune", {"keep": 0.5}), ("divprune", {"budget": 7}), ("cdpruner", {"keep": 0.5}),
         ("cdpruner", {"budget": 6}), ("pool", {"budget": 20})]  # 20: one-tile images and frames keep all their 16


def _media() -> list[dict]:
    """Per prompt: {"image": [PIL images], "video": frames [T, 32, 32, 3] uint8 (where it has one)}."""
    rng = np.random.RandomState(0)
    out = []
    for _, sizes, frames in PROMPTS:
        media = {"image": [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for w, h in sizes]}
        if frames:
            media["video"] = (rng.rand(frames, 32, 32, 3) * 255).astype("uint8")
        out.append(media)
    return out


def _case_id(method, budget) -> str:
    return f"{method}-{'-'.join(f'{k}{v}' for k, v in budget.items())}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_internvl(tmp_path_factory.mktemp("internvl") / "tiny", InternVLShape(), seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def request(i: int, method=None, **budget) -> dict:
    req = {"prompt": PROMPTS[i][0], "multi_modal_data": _media()[i]}
    if method is not None:
        req["mm_processor_kwargs"] = vp.request_kwargs(method, **budget)
    return req


def run_vllm(llm, requests: list[dict]) -> tuple[list, list, list]:
    """Prompt token ids, greedy tokens and their log-probabilities of each request."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    outs = llm.generate(requests, params, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in outs]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return prompts, tokens, logprobs


def run_hf(hf, method=None, **budget) -> tuple[list, list, list, list]:
    """Per prompt: the ids the language model sees (the dropped image rows removed; a video's frame tokens
    read ``<video>``, as vLLM writes them, transformers writing ``<IMG_CONTEXT>``), greedy tokens, their
    log-probabilities and the positions of the kept image and frame rows of the wrapped HF model."""
    model, proc = hf
    if method is not None:
        vlm_prune.wrap(model, method, processor=proc, **budget)
    try:
        prompts, tokens, logprobs, kept = [], [], [], []
        for (prompt, _, _), media in zip(PROMPTS, _media()):
            videos = [media["video"]] if "video" in media else None
            inputs = proc(images=media["image"], text=prompt, videos=videos, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            ids = inputs["input_ids"][0]
            new = out.sequences[0, ids.numel():]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            image = ids == model.config.image_token_id
            rows = (list(range(ids.numel())) if method is None
                    else [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0])
            seen = [int(ids[r]) for r in rows]
            if "video" in media:  # the rows of the runs behind "Frame i:" (unknown words: <pad>) are frames
                frame = _frame_rows(ids.tolist(), model.config.image_token_id)
                seen = [VIDEO_ID if r in frame else t for r, t in zip(rows, seen)]
            prompts.append(seen)
            # a method whose official code feeds the shorter sequence (DivPrune, CDPruner: renumber_positions)
            # gives the kept rows positions 0, 1, ... in order
            vision = model.vlm_prune.methods.get("vision") if method is not None else None
            renumber = getattr(vision, "renumber_positions", False)
            kept.append([j if renumber else r for j, r in enumerate(rows) if image[r]])
        return prompts, tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def _frame_rows(ids: list[int], image_id: int) -> set[int]:
    """Rows of the image runs that follow a ``Frame i:`` word (the tiny vocabulary has no such word: <pad>)
    and ``<img>``."""
    out, r = set(), 0
    while r < len(ids):
        if ids[r] == 0 and r + 2 < len(ids) and ids[r + 2] == image_id:
            r += 2
            while r < len(ids) and ids[r] == image_id:
                out.add(r)
                r += 1
        r += 1
    return out


def image_positions(llm) -> list[int]:
    """Positions of the image rows of the engine's latest prefill."""
    return llm.apply_model(lambda m: m.last_image_positions)[0]


def test_keep_all_equals_unwrapped_hf(llm, hf):
    prompts, tokens, logprobs = run_vllm(llm, [request(i) for i in range(len(PROMPTS))])
    ref_prompts, ref_tokens, ref_logprobs, _ = run_hf(hf)
    assert prompts == ref_prompts
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(llm, hf, method, budget):
    """Same prompt the language model sees (``<img>``, the kept count of ``<IMG_CONTEXT>``, ``</img>``),
    same greedy tokens and log-probabilities as wrap(same method, same budget), and the kept tokens at
    wrap()'s positions (their original ones; renumbered for DivPrune / CDPruner, whose official code
    feeds the shorter sequence)."""
    from vllm import SamplingParams

    ref_prompts, ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, **budget)
    prompts, tokens, logprobs = run_vllm(llm, [request(i, method, **budget) for i in range(len(PROMPTS))])
    assert prompts == ref_prompts
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i in range(len(PROMPTS)):
        llm.generate(request(i, method, **budget), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def test_budget_counts_over_all_tiles(llm):
    """budget=5 on the 3-tile image (2 tiles + thumbnail, 48 tokens): 5 slots for the whole image, not
    5 per tile (wrap()'s meaning: visual tokens per image reaching the language model)."""
    from vlm_prune.vllm.tiny import internvl_token_ids

    prompts, _, _ = run_vllm(llm, [request(1, "pool", budget=5), request(1, "divprune", keep=0.25)])
    context = internvl_token_ids(InternVLShape())["<IMG_CONTEXT>"]
    assert [p.count(context) for p in prompts] == [5, 12]


def test_mixed_batch_equals_each_alone(llm):
    """Requests with different methods and budgets in one batch (one engine step) answer as each alone."""
    check_mixed(llm, [request(0, "divprune", keep=0.5), request(1, "pool", budget=5), request(2, "cdpruner", budget=6),
                      request(1), request(2, "random", keep=0.25), request(3, "random", budget=3), request(4, "pool",
                                                                                                        keep=0.25)])


def check_mixed(llm, mixed: list[dict]) -> None:
    """The requests in one batch give each request's prompt, tokens and log-probabilities alone, bit for bit."""
    together = run_vllm(llm, mixed)
    alone = [run_vllm(llm, [r]) for r in mixed]
    for j in range(len(mixed)):
        assert together[0][j] == alone[j][0][0] and together[1][j] == alone[j][1][0]
        np.testing.assert_array_equal(together[2][j], alone[j][2][0])


def test_refusals_per_request(llm):
    """Methods wrap() refuses on InternVL are refused per request with the reason (the engine serves on);
    in-LLM methods and frames methods with vLLM's."""
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} ranks an image's tokens by the vision tower's feature-layer "
                                             "attention.*InternVL"):
            run_vllm(llm, [request(0, name, keep=0.5)])
    with pytest.raises(ValueError, match="frames method 'uniform' chooses video frames"):
        run_vllm(llm, [request(0, "uniform", keep=0.5)])
    with pytest.raises(ValueError, match="prunes inside the language model"):
        fastv = json.dumps({"method": "fastv", "keep": 0.5})
        run_vllm(llm, [{**request(0), "mm_processor_kwargs": {"vlm_prune": fastv}}])
    _, tokens, _ = run_vllm(llm, [request(0, "divprune", keep=0.5)])
    assert len(tokens[0]) == STEPS


def test_video_frames_are_items(llm):
    """A 3-frame video keeps n_keep(16) tokens per frame (wrap()'s items are its frames' runs), between
    each frame's <img> and </img>."""
    prompts, _, _ = run_vllm(llm, [request(3, "pool", budget=5), request(3, "divprune", keep=0.25), request(3)])
    assert [p.count(VIDEO_ID) for p in prompts] == [3 * 5, 3 * 4, 3 * 16]


def plain_vllm_main(model: str, out: str) -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`: vLLM's own class on ``model``."""
    plain_main(model, out, ENGINE_ARGS, [request(i) for i in range(len(PROMPTS))])


def plain_main(model: str, out: str, engine_args: dict, requests: list[dict]) -> None:
    """vLLM's own engine on ``model``: the class that served and :func:`run_vllm` of ``requests``, to ``out``."""
    import vllm

    llm = vllm.LLM(model=model, **engine_args)
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    with open(out, "w") as f:
        json.dump({"class": served, "result": run_vllm(llm, requests)}, f)
    llm.llm_engine.engine_core.shutdown()


def check_plain_vllm(module: str, folder, llm, tmp_path, served: str, requests: list[dict]) -> None:
    """The plugin's engine ``llm`` (nothing pruned) equals vLLM's own class ``served`` on ``folder`` bit for
    bit (prompt tokens, greedy tokens, log-probabilities of ``requests``); vLLM's engine runs
    ``module.plain_vllm_main`` in a child process (a second engine in this one would share its state)."""
    import subprocess
    import sys

    from test_vllm_engine import Child

    out = tmp_path / "result.json"
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; t.plain_vllm_main(*sys.argv[2:])"
    child = Child([sys.executable, "-c", code, os.path.dirname(__file__), str(folder), str(out)], tmp_path / "log")
    try:
        child.proc.wait(500)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the engine did not answer in 500 s:\n{child.log_tail()}") from None
    finally:
        child.stop()
    assert child.proc.returncode == 0, f"the engine failed ({child.proc.returncode}):\n{child.log_tail()}"
    plain = json.loads(out.read_text())
    assert plain["class"] == served
    prompts, tokens, logprobs = plain["result"]
    ref_prompts, ref_tokens, ref_logprobs = run_vllm(llm, requests)
    assert prompts == ref_prompts
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logprobs, ref_logprobs)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(checkpoint, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own InternVL class (InternS1ForConditionalGeneration), bit
    for bit: prompt tokens, greedy tokens, log-probabilities (the language model on one position row with
    vLLM's own rotary; the offset channels add nothing)."""
    check_plain_vllm("test_vllm_internvl", checkpoint, llm, tmp_path, "InternS1ForConditionalGeneration",
                     [request(i) for i in range(len(PROMPTS))])


def test_the_dry_run_sees_the_real_items(llm, monkeypatch):
    """The processor dry-runs an image on all its tiles' tokens (no grid, as the encoder sees several tiles) and
    a video's frames each on its own tile's grid, at the engine's width and dtype (docs/serving-safety.md)."""
    _, shape, _ = check_dry_run_sees_the_item(llm, request(1), {"method": "divprune", "keep": 0.5, "seed": 11},
                                              monkeypatch)
    assert shape[1] is None
    frames = _media()[3]["video"]
    video = {"prompt": "<s> user : <video> w21 assistant :", "multi_modal_data": {"video": frames}}
    _, shape, _ = check_dry_run_sees_the_item(llm, video, {"method": "cdpruner", "keep": 0.5, "seed": 11},
                                              monkeypatch, runs=len(frames))
    assert shape[1] is not None


def test_edge_specs_keep_the_engine(llm):
    """Float knobs and budgets at the edges: each refused with a 400 or answered; the engine answers on."""
    check_edges_keep_the_engine(llm, request(1))
