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
#: every engine here: float32 (exact comparisons), eager, the smallest KV cache the prompts need
ENGINE_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "seed": 0}
STEPS = 6
PROMPTS = ["<s> user : <image> w5 w6 w7 w8 assistant :", "<s> user : w9 <image> w10 w11 w12 w13 w14 assistant :"]
CASES = [("random", {"keep": 0.5}), ("random", {"budget": 3}), ("pool", {"keep": 0.25}), ("divprune", {"keep": 0.5}),
         ("pool", {"budget": 15}),  # pool keeps exactly 15 (row bands of 4 and 3 cells; 12 before main's pool_cells, a dead engine)
         ("divprune", {"budget": 2}), ("cdpruner", {"keep": 0.5}), ("cdpruner", {"budget": 5}),
         ("visionzip", {"keep": 0.5}), ("visionzip", {"budget": 6}),
         # issue 30: the tower's CLS attention (as VisionZip's), the official shorter sequence by default
         ("fastervlm", {"keep": 0.5}), ("fastervlm", {"budget": 3}), ("vispruner", {"keep": 0.5}),
         ("vispruner", {"budget": 6}),
         # issue 30: HiRED (one partition: the official LLaVA-1.5 version, int(16 * 0.2) = 3 without keep / budget)
         # and PruMerge (the tower's last layer, which vLLM does not build, read from the checkpoint on the side)
         ("hired", {}), ("hired", {"keep": 0.5}), ("hired", {"budget": 5}), ("prumerge", {"keep": 0.5}),
         ("prumerge", {"budget": 4})]


def _images() -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(32, 32, 3) * 255).astype("uint8")) for _ in PROMPTS]


@pytest.fixture(scope="module")
def t5_checkpoint(tmp_path_factory):
    """The tiny checkpoint as transformers 5 saves it (CLIP tower keys without ``vision_model.``)."""
    return write_llava(tmp_path_factory.mktemp("llava") / "tiny", LlavaShape(), seed=0)


@pytest.fixture(scope="module")
def checkpoint(t5_checkpoint):
    """The same weights in the hub's naming (``vision_tower.vision_model.*``), the one vLLM's own LLaVA loads."""
    import shutil

    from vlm_prune.vllm.tiny import hub_naming

    folder = t5_checkpoint.parent / "hub"
    shutil.copytree(t5_checkpoint, folder)
    hub_naming(folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = vp.LLM(str(checkpoint), "random", keep=1.0, **ENGINE_ARGS)
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
                rows = [int(r) for r in model.vlm_prune.last_rows[0] if r >= 0]
                # a method that renumbers (the official shorter sequence: VisionZip, DivPrune, CDPruner)
                # gives the kept rows positions 0, 1, ... in order
                renumber = getattr(model.vlm_prune.methods.get("vision"), "renumber_positions", False)
                kept.append([j if renumber else r for j, r in enumerate(rows) if ids[r] == model.config.image_token_id])
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
    kept tokens at the same positions (the original ones, or renumbered where the method's official
    code feeds the shorter sequence)."""
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


@pytest.mark.parametrize("raw, field, message", [
    ('{"method": "quota", "keep": 0.5}', "vlm_prune.method", "frames method 'quota' chooses video frames"),
    ('{"method": "uniform", "keep": 0.5}', "vlm_prune.method", "frames method 'uniform' chooses video frames"),
    ('{"method": "random", "keep": 0.5, "seed": "abc"}', "vlm_prune.seed", "seed must be a whole number"),
    ("keep=0.5", "vlm_prune", "not JSON text"),
    ('{"method": "prumerge"}', "vlm_prune.method", "prumerge without keep / budget keeps an adaptive count"),
])
def test_offline_requests_are_validated_before_the_engine(llm, raw, field, message):
    """Issue 27: the offline LLM runs the server's validation on each request's spec (the same function);
    the specs that used to kill the engine on LLaVA-1.5 are refused, and the engine serves on - also a
    seed of 10**30, whose generator overflowed before."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2)
    request = {"prompt": PROMPTS[0], "multi_modal_data": {"image": _images()[0]}}
    with pytest.raises(ValueError) as err:
        llm.generate({**request, "mm_processor_kwargs": {"vlm_prune": raw}}, params, use_tqdm=False)
    assert f"mm_processor_kwargs.{field}: " in str(err.value) and message in str(err.value)
    big = llm.generate({**request, "mm_processor_kwargs": vp.request_kwargs("random", keep=0.5, seed=10**30)},
                       params, use_tqdm=False)[0]
    assert len(big.outputs[0].token_ids) == 2


# --- parity with plain vLLM, tensor parallel, the OpenAI server: each starts one more engine, in a
# process of its own (vLLM engines in one process share its distributed state, and stopping one breaks
# the other); the reference is the shared engine above. Their measured cost: docs/design/vllm-plugin.md, "Tests".


class Child:
    """A command in a process group of its own, its output in a log. ``stop()`` sends SIGTERM to the
    command (vLLM's clean shutdown must take its engine core and workers along) and SIGKILLs whatever of
    the group outlives ``grace`` s (``killed`` says whether that was needed). A killed pytest takes the
    command with it (PR_SET_PDEATHSIG)."""

    def __init__(self, argv: list[str], log_path, env: dict[str, str] | None = None):
        import ctypes
        import signal
        import subprocess

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: between fork and exec the child
        # must not import or take locks (this process runs threads)

        def die_with_parent():
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

        self.log_path, self.killed = log_path, False
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the child's life; stop() closes it)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent, env=env)  # noqa: PLW1509 (prctl only)
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return open(self.log_path, "rb").read()[-n:].decode(errors="replace")

    def group_alive(self) -> bool:
        self.proc.poll()  # reap the leader, or the group never looks empty
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def members(self) -> list[int]:
        """Pids of the group's live processes."""
        pids = []
        for stat in os.listdir("/proc"):
            try:
                with open(f"/proc/{stat}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.pgid and fields[0] != "Z":
                pids.append(int(stat))
        return pids

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM to the leader, as a process manager sends it; its children must go with it."""
        import signal
        import time

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        elif self.group_alive():  # the leader died and left children: no clean way out
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.group_alive():
            if time.monotonic() > deadline:
                self.killed = True
                os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait(30)
                break
            time.sleep(0.5)
        self._log.close()


def plain_vllm_in_child(tmp_path, model: str, timeout: float = 500.0, module: str = "test_vllm_engine") -> dict:
    """vLLM's own engine (no plugin model class) on ``model`` in a child process: what test module
    ``module``'s ``plain_vllm_main(model, out)`` writes (here: the class that served and its
    ``run_vllm(engine, None)``)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "result.json"
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; "
            "t.plain_vllm_main(sys.argv[2], sys.argv[3])")
    child = Child([sys.executable, "-c", code, os.path.dirname(__file__), model, str(out)], tmp_path / "engine.log")
    try:
        child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the engine did not answer in {timeout:.0f} s:\n{child.log_tail()}") from None
    finally:
        child.stop()
    assert child.proc.returncode == 0, f"the engine failed ({child.proc.returncode}):\n{child.log_tail()}"
    assert not child.killed, f"the engine's processes outlived its exit:\n{child.log_tail()}"
    return json.loads(out.read_text())


def plain_vllm_main(model: str, out: str) -> None:
    """The child of :func:`plain_vllm_in_child`."""
    import json

    import vllm

    llm = vllm.LLM(model=model, **ENGINE_ARGS)
    served = type(llm.apply_model(lambda m: m)[0]).__name__
    with open(out, "w") as f:
        json.dump({"class": served, "result": run_vllm(llm, None)}, f)
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.timeout(600)
def test_keep_all_equals_plain_vllm(llm, checkpoint, tmp_path):
    """The plugin with nothing pruned is vLLM's own LLaVA bit for bit: the same greedy tokens and
    log-probabilities. The language model gets one of the three (equal) position rows and vLLM's own 1-D rotary
    embeddings (llava.FirstPositionRow, plain_rotary): M-RoPE's PyTorch rotary path on CPU rounds differently
    from the C++ op vLLM's own class runs, which made them differ by up to 8e-7 from 2026-12-03 (vllm-cpu
    0.32.0) until the plugin used it."""
    plain = plain_vllm_in_child(tmp_path, str(checkpoint))
    assert plain["class"] == "LlavaForConditionalGeneration"
    tokens, logprobs = plain["result"]
    ref_tokens, ref_logprobs = run_vllm(llm, None)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logprobs, ref_logprobs)


class Server(Child):
    """``vlm-prune serve ARGV`` on a free local port (vLLM's OpenAI server, run as users run it)."""

    def __init__(self, argv: list[str], log_path, options: str = ""):
        import socket
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "vlm-prune")
        assert os.path.exists(exe), f"{exe} missing: install the package into the vLLM environment (.ci/vllm-env)"
        options = (f"--host 127.0.0.1 --port {self.port} --enforce-eager --dtype float32 --max-model-len 256 "
                   f"--max-num-seqs 4 --seed 0 {options}")
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        super().__init__([exe, "serve", *argv, "--vllm", options], log_path, env=env)

    def wait_ready(self, timeout: float = 600.0) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"the server did not answer /health in {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict) -> dict:
        import json
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{path} answered {err.code}: {err.read().decode(errors='replace')}") from None


@pytest.mark.timeout(900)
def test_openai_server_tp2_equals_offline_tp1(llm, t5_checkpoint, tmp_path):
    """One server, three claims (one engine start instead of three):

    - `vlm-prune serve CKPT --method divprune --budget 4` starts vLLM's OpenAI server and answers
      /v1/chat/completions requests with an image: the engine's method, and a request's own
      (``mm_processor_kwargs``, here keep=1.0, which vLLM accepts with ``--trust-request-mm-kwargs``);
    - at tensor parallel 2 (``--distributed-executor-backend mp``: one process per rank) it gives the
      offline TP 1 engine's greedy tokens on the same chat, and its log-probabilities within 1e-5 (TP
      splits the matmuls' sums, so not bit for bit), with the same prompt tokens (4 image slots);
    - it loads transformers 5's naming of the weights the offline engine loads in the hub's naming,
      and SIGTERM ends it with all its processes (front end, engine core, both ranks).
    """
    import base64
    import io

    from vllm import SamplingParams

    from vlm_prune.vllm.tiny import image_token_id

    buf = io.BytesIO()
    _images()[0].save(buf, format="PNG")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
        {"type": "text", "text": "w5 w6 w7 w8"}]}]
    body = {"model": str(t5_checkpoint), "messages": messages, "max_tokens": STEPS, "min_tokens": STEPS,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}
    server = Server([str(t5_checkpoint), "--method", "divprune", "--budget", "4"], tmp_path / "server.log",
                    "--tensor-parallel-size 2 --distributed-executor-backend mp --trust-request-mm-kwargs")
    try:
        server.wait_ready()
        assert len(server.members()) >= 4, "front end, engine core and two ranks"
        replies = [server.post("/v1/chat/completions", body),
                   server.post("/v1/chat/completions", {**body, "mm_processor_kwargs": vp.request_kwargs("random", keep=1.0)})]
    finally:
        server.stop()
    assert not server.group_alive()
    assert not server.killed, f"SIGTERM to the server left processes of it running for 60 s:\n{server.log_tail()}"

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, min_tokens=STEPS, logprobs=0)
    for reply, (method, budget, slots) in zip(replies, [("divprune", {"budget": 4}, 4), ("random", {"keep": 1.0}, 16)]):
        out = llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs=vp.request_kwargs(method, **budget))[0]
        choice = reply["choices"][0]
        assert reply["prompt_token_ids"] == list(out.prompt_token_ids)
        assert reply["prompt_token_ids"].count(image_token_id(LlavaShape())) == slots
        assert choice["token_ids"] == list(out.outputs[0].token_ids)
        np.testing.assert_allclose([c["logprob"] for c in choice["logprobs"]["content"]],
                                   [step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
                                   rtol=0, atol=1e-5)
