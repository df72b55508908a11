"""vlm_prune inside vLLM on LLaVA-NeXT-Video (issue 29): its videos (CLIP frames pooled by 2, no newline
tokens), the vision methods per frame and the frames methods, against the Hugging Face model wrapped with
vlm_prune.wrap(). One engine on a tiny checkpoint (vlm_prune.vllm.tiny.write_llava_next_video), shared by
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
from vlm_prune.registry import make_method  # noqa: E402
from vlm_prune.vllm.tiny import LlavaNextVideoShape, video_token_id, write_llava_next_video  # noqa: E402

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
    """The tiny checkpoint in the hub's naming (``vision_tower.vision_model.*``), which vLLM's own class loads too."""
    from safetensors.torch import load_file, save_file

    folder = write_llava_next_video(tmp_path_factory.mktemp("llava_next_video") / "tiny", LlavaNextVideoShape())
    weights = load_file(folder / "model.safetensors")
    prefix = "vision_tower."
    save_file({prefix + "vision_model." + k[len(prefix):] if k.startswith(prefix) and "vision_model." not in k else k: v
               for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaNextVideoForConditionalGeneration

    torch.set_num_threads(1)
    model = LlavaNextVideoForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model, AutoProcessor.from_pretrained(checkpoint)


def _method(name: str, knobs: dict):
    return make_method(name, **knobs) if knobs else name


def requests(cases, prompts=PROMPTS) -> list[dict]:
    out = []
    for (prompt, frames), case in zip(prompts, cases):
        req = {"prompt": prompt, "multi_modal_data": {"video": _video(frames)}}
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
    return tokens, logprobs, [list(o.prompt_token_ids) for o in outs]


def run_hf(hf, case, prompts=PROMPTS):
    """Greedy tokens, their log-probabilities, the kept video rows (renumbered where the method renumbers) and
    the video slots wrap() keeps, per prompt."""
    model, proc = hf
    if case is not None:
        name, knobs, budget = case
        vlm_prune.wrap(model, _method(name, knobs), processor=proc, **budget)
    try:
        tokens, logprobs, kept, slots = [], [], [], []
        for prompt, frames in prompts:
            inputs = proc(text=prompt, videos=[_video(frames)], return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            new = out.sequences[0, inputs["input_ids"].shape[1]:]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            ids = inputs["input_ids"][0]
            if case is not None:
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0]
                renumber = getattr(model.vlm_prune.methods.get("vision"), "renumber_positions", False)
                kept.append([j if renumber else r for j, r in enumerate(rows) if ids[r] == model.config.video_token_id])
                slots.append(sum(1 for r in rows if ids[r] == model.config.video_token_id))
        return tokens, logprobs, kept, slots
    finally:
        if case is not None:
            vlm_prune.unwrap(model)


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
    ({"method": "quota", "keep": 0.5}, "quota is not wired into vLLM for LLaVA-NeXT-Video"),
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


def plain_vllm_main(model: str, out: str) -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`: vLLM's own LLaVA-NeXT-Video class."""
    import vllm

    llm = vllm.LLM(model=model, **ENGINE_ARGS)
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    with open(out, "w") as f:
        json.dump({"class": served, "result": list(run_vllm(llm, requests([None, None])))}, f)
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(llm, checkpoint, tmp_path):
    """Nothing pruned, the plugin is vLLM's own LLaVA-NeXT-Video bit for bit: prompt tokens, greedy tokens,
    log-probabilities."""
    import subprocess
    import sys

    from test_vllm_engine import Child

    result = tmp_path / "result.json"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_vllm_llava_next_video as t; "
            "t.plain_vllm_main(sys.argv[2], sys.argv[3])")
    child = Child([sys.executable, "-c", code, os.path.dirname(__file__), str(checkpoint), str(result)],
                  tmp_path / "engine.log")
    try:
        child.proc.wait(500)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the engine did not answer in 500 s:\n{child.log_tail()}") from None
    finally:
        child.stop()
    assert child.proc.returncode == 0, f"the engine failed ({child.proc.returncode}):\n{child.log_tail()}"
    plain = json.loads(result.read_text())
    assert plain["class"] == "LlavaNextVideoForConditionalGeneration"
    tokens, logprobs, prompts = run_vllm(llm, requests([None, None]))
    assert plain["result"][0] == tokens and plain["result"][2] == prompts
    np.testing.assert_array_equal(plain["result"][1], logprobs)
