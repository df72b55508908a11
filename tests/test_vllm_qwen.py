"""vlm_prune inside vLLM on Qwen2-VL and Qwen2.5-VL (issue 19): one vLLM engine per architecture on a
tiny random checkpoint, shared by the tests of that architecture; each request picks its method and
budget (``mm_processor_kwargs``). Kept tokens must sit at their original M-RoPE (t, h, w) positions.

Needs vLLM: CI runs this module in the vLLM environment (.ci/run); elsewhere it is skipped.
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
from vlm_prune.vllm.tiny import QwenShape, write_qwen2_vl  # noqa: E402

pytestmark = pytest.mark.timeout(900)
STEPS = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
#: two prompts per kind, the media at different offsets. Images: 32 x 32 px (4 x 4 merged tokens) and
#: 48 x 32 px (4 rows x 6 columns). Videos: 48 x 32 px (FRAMES), the first
#: prompt with an image before its video (ranks per modality, two encoder calls, one question)
PROMPTS = {
    "image": [f"<s> user : {IMAGE} w5 w6 w7 w8 assistant :", f"<s> user : w9 w10 {IMAGE} w11 w12 w13 assistant :"],
    "video": [f"<s> user : {IMAGE} w5 {VIDEO} w6 w7 assistant :", f"<s> user : w9 w10 w11 {VIDEO} w12 assistant :"],
}
SIZES = [(32, 32), (48, 32)]  # (width, height)
#: frames per video: 8 (4 slices) on Qwen2-VL; 4 (2 slices) on Qwen2.5-VL, whose scaled temporal positions
#: (0, 2, 4, 6) would pass max(h, w) = 6 at 4 slices, where transformers 5's get_rope_index starts the text
#: after the video earlier than vLLM's own Qwen classes (and the plugin) do (docs/design/vllm-plugin.md, "Tests")
FRAMES = {False: 8, True: 4}


def meta(frames: int) -> dict:
    """The metadata vLLM's Qwen processors take with a video: 2 fps, no resampling (HF gets the same)."""
    return {"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames)), "duration": frames / 2,
            "video_backend": "opencv", "do_sample_frames": False}
CASES = [("image", "random", {"keep": 0.5}), ("image", "random", {"budget": 3}), ("image", "pool", {"keep": 0.25}),
         ("image", "pool", {"budget": 5}),  # 5 cells, not a product grid
         ("image", "divprune", {"keep": 0.5}), ("image", "divprune", {"budget": 5}), ("image", "cdpruner", {"keep": 0.5}),
         ("image", "cdpruner", {"budget": 6}), ("video", "random", {"keep": 0.5}), ("video", "pool", {"keep": 0.25}),
         ("video", "divprune", {"budget": 5}), ("video", "cdpruner", {"keep": 0.5}),
         # frames methods: whole slices of the video (below one slice, part of one), the image left alone
         ("video", "uniform", {"keep": 0.5}), ("video", "uniform", {"budget": 10}), ("video", "keyscore", {"keep": 0.5}),
         ("video", "keyscore", {"budget": 48}),
         # issue 31: VidCom2 (the budget's tokens spread over the slices by their uniqueness, each at its slot)
         ("video", "vidcom2", {"keep": 0.5}), ("video", "vidcom2", {"budget": 30}), ("video", "dycoke", {"keep": 0.5}),
         # FastVID / HoliTom: the tower's last block tapped on the side (each slice's salience), merged tokens at slots
         ("video", "fastvid", {"keep": 0.5}), ("video", "fastvid", {"budget": 20}), ("video", "holitom", {"keep": 0.5}),
         ("video", "fastvid_qwen", {"keep": 0.27})]
#: keyscore's in-model default ranks STACFP's proposals (OpenCV, scikit-learn); "all" slices without them
KEYSCORE = {} if all(importlib.util.find_spec(m) is not None for m in ("cv2", "sklearn")) else {"proposals": "all"}
#: Qwen2.5-VL shares every line of the plugin with Qwen2-VL; its engine checks keep-all and one method
#: of each kind (selection, replacement) against its own tower (window attention) and processor class,
#: and a video, whose temporal positions step by second_per_grid_ts * tokens_per_second on 2.5; FastVID and
#: HoliTom read the tower's last block, whose rows 2.5's attention windows reorder
CASES_25 = [("image", "divprune", {"keep": 0.5}), ("image", "pool", {"keep": 0.25}), ("video", "divprune", {"budget": 5}),
            ("video", "vidcom2", {"keep": 0.5}), ("video", "fastvid", {"keep": 0.5}), ("video", "holitom", {"keep": 0.5}),
            ("video", "fastvid_qwen", {"keep": 0.27})]


def _media(kind: str, frames: int = 8, prompts: dict | None = None) -> list[dict]:
    """Per prompt of ``kind``: {"image": PIL image} and / or {"video": frames [4, H, W, 3] uint8}; the first
    video prompt's image only where ``prompts`` (another family's) do not say ``"image_in_video": False``."""
    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8")) for w, h in SIZES]
    if kind == "image":
        return [{"image": im} for im in images]
    video = (rng.rand(frames, 32, 48, 3) * 255).astype("uint8")
    first = {"image": images[0], "video": video} if (prompts or {}).get("image_in_video", True) else {"video": video}
    return [first, {"video": video[::-1].copy()}]


def _method(name):
    """The method as both sides get it (keyscore as an object with its proposals knob; fastvid_qwen: FastVID
    with the official Qwen2.5-VL setting; objects as given)."""
    if name == "fastvid_qwen":
        from vlm_prune.frames.fastvid import FastVID

        return FastVID(tau=0.84, ignore=0.95)
    if name == "keyscore" and KEYSCORE:
        from vlm_prune.frames import KeyScore

        return KeyScore(**KEYSCORE)
    if name == "holitom":  # its outer stage (vLLM refuses the default inner-LLM merge on every model)
        from vlm_prune.frames.holitom import HoliTom

        return HoliTom(inner=False)
    return name


def _case_id(kind: str, method: str, budget: dict) -> str:
    return f"{kind}-{method}-{'-'.join(f'{k}{v}' for k, v in budget.items())}"


@pytest.fixture(scope="module", params=[False, True], ids=["qwen2-vl", "qwen2.5-vl"])
def arch(request, tmp_path_factory):
    """(checkpoint folder, v25) of one architecture; its engine and HF model live while its tests run."""
    v25 = request.param
    return write_qwen2_vl(tmp_path_factory.mktemp("qwen") / "tiny", QwenShape(v25=v25), seed=0), v25


ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "seed": 0,
               "limit_mm_per_prompt": {"image": 1, "video": 1}}


@pytest.fixture(scope="module")
def llm(arch):
    engine = vp.LLM(str(arch[0]), "random", keep=1.0, **ENGINE_ARGS)
    yield engine
    del engine


def load_hf(folder) -> tuple:
    """(model, processor) of a checkpoint folder: float32, SDPA, eval."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(arch):
    return load_hf(arch[0])


def run_vllm(llm, kind: str, method, frames: int = 8, prompts: dict | None = None, **budget):
    """Greedy tokens and their log-probabilities of the two prompts of ``kind`` (``prompts``: another
    family's two prompts per kind; default :data:`PROMPTS`) in one batch."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    requests = [vllm_request(prompt, media, method, llm=llm, **budget)
                for prompt, media in zip((prompts or PROMPTS)[kind], _media(kind, frames, prompts))]
    outs = llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def vllm_request(prompt: str, media: dict, method, llm=None, **budget) -> dict:
    """One request; QuoTA (an object) through its pass 1 in ``llm`` (vp.quota_request)."""
    data = dict(media)
    if "video" in data:
        data["video"] = (data["video"], meta(len(data["video"])))
    req = {"prompt": prompt, "multi_modal_data": data}
    if getattr(method, "name", None) == "quota":
        return vp.quota_request(llm, req, method, **budget)
    if method is not None:
        req["mm_processor_kwargs"] = vp.request_kwargs(_method(method), **budget)
    return req


def run_hf(hf, kind: str, method, frames: int = 8, stats: list | None = None, prompts: dict | None = None, **budget):
    """Greedy tokens, their log-probabilities and the (t, h, w) positions of the kept visual rows
    of the wrapped HF model (its M-RoPE positions of the unpruned prompt at ``last_rows``, with the
    engine's position rewrites of resized frame maps applied: QuoTA). ``stats``: each prompt's
    ``last_stats`` video record is appended there."""
    from transformers.video_utils import VideoMetadata

    from vlm_prune import engine

    model, proc = hf
    rewrites: list = []
    apply = engine.PositionRewrite.apply

    def recording_apply(self, pos):
        rewrites.append(self)
        apply(self, pos)
    if method is not None:
        vlm_prune.wrap(model, _method(method), processor=proc, **budget)
    try:
        tokens, logprobs, kept = [], [], []
        for prompt, media in zip((prompts or PROMPTS)[kind], _media(kind, frames, prompts)):
            extra = {}
            if "video" in media:
                info = VideoMetadata(**{k: v for k, v in meta(len(media["video"])).items() if k != "do_sample_frames"})
                extra = {"videos": [media["video"]], "video_metadata": [info], "do_sample_frames": False}
            inputs = proc(images=media.get("image"), text=prompt, return_tensors="pt", **extra)
            rewrites.clear()
            engine.PositionRewrite.apply = recording_apply
            try:
                with torch.no_grad():
                    out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                         return_dict_in_generate=True, min_new_tokens=STEPS)
            finally:
                engine.PositionRewrite.apply = apply
            if stats is not None:
                stats.append(model.vlm_prune.last_stats["stages"][0]["videos"][0])
            new = out.sequences[0, inputs["input_ids"].shape[1]:]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            if method is not None:
                ids = inputs["input_ids"][0]
                visual = (model.config.image_token_id, model.config.video_token_id)
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0 and int(ids[r]) in visual]
                grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
                pos, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                    attention_mask=inputs["attention_mask"], **grids)
                for rewrite in rewrites:
                    apply(rewrite, pos)
                kept.append(pos[:, 0, rows].tolist())
        return tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def image_positions(llm) -> list[list[int]]:
    """[3][k] (t, h, w) positions of the visual rows (in prompt order) of the engine's latest prefill."""
    return llm.apply_model(lambda m: m.last_image_positions)[0]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_keep_all_equals_unwrapped_hf(arch, llm, hf, kind):
    tokens, logprobs = run_vllm(llm, kind, None, FRAMES[arch[1]])
    ref_tokens, ref_logprobs, _ = run_hf(hf, kind, None, FRAMES[arch[1]])
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


def plain_vllm_main(model: str, out: str, prompts: str = "null", dtype: str = "float32") -> None:
    """The child of :func:`test_keep_all_equals_plain_vllm`: vLLM's own class on ``model`` (``prompts``:
    JSON of another family's prompts, or null)."""
    import json

    import vllm

    llm = vllm.LLM(model=model, **dict(ENGINE_ARGS, dtype=dtype))
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    prompts = json.loads(prompts)
    with open(out, "w") as f:
        json.dump({"class": served, **{kind: run_vllm(llm, kind, None, prompts=prompts) for kind in PROMPTS}}, f)
    llm.llm_engine.engine_core.shutdown()


def check_plain_vllm(folder, llm, tmp_path, served: str, prompts: dict | None = None, dtype: str = "float32") -> None:
    """The plugin's engine ``llm`` (nothing pruned) gives vLLM's own class ``served`` on ``folder`` bit for
    bit on the image and the video prompts; vLLM's engine runs in a child process (a second engine in
    this one would share its global state)."""
    import subprocess
    import sys

    from test_vllm_engine import Child

    out = tmp_path / "result.json"
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_vllm_qwen as t; t.plain_vllm_main(*sys.argv[2:])"
    child = Child([sys.executable, "-c", code, os.path.dirname(__file__), str(folder), str(out), json.dumps(prompts), dtype],
                  tmp_path / "log")
    try:
        child.proc.wait(500)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the engine did not answer in 500 s:\n{child.log_tail()}") from None
    finally:
        child.stop()
    assert child.proc.returncode == 0, f"the engine failed ({child.proc.returncode}):\n{child.log_tail()}"
    plain = json.loads(out.read_text())
    assert plain["class"] == served
    for kind in PROMPTS:
        tokens, logprobs = plain[kind]
        ref_tokens, ref_logprobs = run_vllm(llm, kind, None, prompts=prompts)
        assert tokens == ref_tokens
        np.testing.assert_array_equal(logprobs, ref_logprobs)


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(arch, llm, tmp_path):
    """The plugin with nothing pruned is vLLM's own Qwen2-VL, bit for bit, on the image and the video
    prompts (its position layout, the offset channels stripped)."""
    if arch[1]:
        pytest.skip("one architecture: Qwen2.5-VL runs the same plugin code (its keep-all equals HF above)")
    check_plain_vllm(arch[0], llm, tmp_path, "Qwen2VLForConditionalGeneration")


@pytest.mark.parametrize("kind,method,budget", CASES, ids=[_case_id(*c) for c in CASES])
def test_method_equals_wrapped_hf(arch, llm, hf, kind, method, budget):
    """Same greedy tokens and log-probabilities as wrap(same method, same budget), and the same kept
    tokens at the same (t, h, w) positions (the original ones)."""
    if arch[1] and (kind, method, budget) not in CASES_25:
        pytest.skip("CASES_25 covers Qwen2.5-VL: the plugin runs the same code on both (see CASES_25)")
    frames = FRAMES[arch[1]]
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, kind, method, frames, **budget)
    tokens, logprobs = run_vllm(llm, kind, method, frames, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    from vllm import SamplingParams

    for i, (prompt, media) in enumerate(zip(PROMPTS[kind], _media(kind, frames))):
        llm.generate(vllm_request(prompt, media, method, **budget), SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def test_visionzip_and_bare_quota_are_refused_per_request(llm):
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} needs the vision tower's attention"):
            run_vllm(llm, "image", name, keep=0.5)
    with pytest.raises(ValueError, match="through vlm_prune.vllm.quota_request"):  # no scores: no pass 1
        run_vllm(llm, "video", "quota", keep=0.5)


#: QuoTA's frame question in the tiny vocabulary (no "A"): P(w40) / (P(w40) + P(w41)); no decoupling (the
#: random model's answer would run to the model's 1024 positions, past the engine's max_model_len)
QUOTA_CASES = [({}, {"keep": 0.5}), ({"score_grid": (2, 3)}, {"budget": 30}), ({"variant": "v2"}, {"keep": 0.3})]


@pytest.mark.parametrize("knobs,budget", QUOTA_CASES, ids=["v1-keep0.5", "v1-grid2x3-budget30", "v2-keep0.3"])
def test_quota_two_pass_equals_wrapped_hf(arch, llm, hf, knobs, budget):
    """QuoTA per temporal slice through vp.quota_request: pass 1 scores each slice (its two frames as a
    one-slice video, the merged map fitted into score_grid at that grid's M-RoPE positions), pass 2 serves
    the plan (each slice's map resized to its share): the same slice scores, tokens, log-probabilities and
    kept rows at the same rewritten (t, h, w) positions as wrap(model, QuoTA(...)) scoring with the model."""
    from vllm import SamplingParams

    from vlm_prune.frames import QuoTA
    from vlm_prune.frames.quota import FramePrompts

    if arch[1] and budget != {"keep": 0.5}:
        pytest.skip("Qwen2.5-VL: one case (its slices' temporal positions scale by second_per_grid_ts)")
    method = QuoTA(decouple=False, prompts=FramePrompts(query="{query}", answer="w40", versus="w41"), **knobs)
    frames = FRAMES[arch[1]]
    stats: list = []
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, "video", method, frames, stats=stats, **budget)
    assert any(len(set(s["tokens_per_frame"])) > 1 for s in stats)  # the scores made a difference
    tokens, logprobs = run_vllm(llm, "video", method, frames, **budget)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i, (prompt, media) in enumerate(zip(PROMPTS["video"], _media("video", frames))):
        req = vllm_request(prompt, media, method, llm=llm, **budget)
        scores = json.loads(req["mm_processor_kwargs"]["vlm_prune"])["quota"]["scores"]
        np.testing.assert_allclose(scores, stats[i]["frame_scores"], rtol=1e-4)
        llm.generate(req, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]


def check_batch_equals_alone(llm, requests: list[dict]) -> None:
    """``requests`` (each with its own method and budget, or none) in one batch: every answer (prompt ids, so
    its slot count, greedy tokens, log-probabilities) is what the request gets alone; no two prompts alike."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)

    def answer(out):
        ids = list(out.outputs[0].token_ids)
        return out.prompt_token_ids, ids, [step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids)]

    together = [answer(o) for o in llm.generate(requests, params, use_tqdm=False)]
    assert len({tuple(p) for p, _, _ in together}) == len(requests)
    for req, (prompt, tokens, logprobs) in zip(requests, together):
        alone_prompt, alone_tokens, alone_logprobs = answer(llm.generate(req, params, use_tqdm=False)[0])
        assert prompt == alone_prompt
        assert tokens == alone_tokens
        np.testing.assert_allclose(logprobs, alone_logprobs, atol=1e-5)


def check_positions(llm, kind: str, method, frames: int, ref_kept: list, prompts: dict | None = None, **budget) -> None:
    """Each prompt of ``kind`` alone: the engine's visual rows sit at ``ref_kept``'s (t, h, w) positions (run_hf's)."""
    from vllm import SamplingParams

    for i, (prompt, media) in enumerate(zip((prompts or PROMPTS)[kind], _media(kind, frames, prompts))):
        llm.generate(vllm_request(prompt, media, method, **budget), SamplingParams(temperature=0.0, max_tokens=1),
                     use_tqdm=False)
        assert image_positions(llm) == ref_kept[i]
