"""QuoTA (arXiv 2503.08689) against a running OpenAI-compatible vLLM server (``vlm-prune serve``).

The same two passes as :func:`vlm_prune.vllm.frames.quota_request` on an offline ``vllm.LLM``, sent
over HTTP; the requests are built by the same code (:func:`~vlm_prune.vllm.frames.quota_kwargs`):

- the decoupling answer (greedy, text only): ``/v1/completions`` with the prompt as token ids;
- one scoring request per frame (Qwen: per temporal slice): ``/v1/chat/completions`` with the frame as a
  one-frame video, the frame prompt as the user turn and the answer word as an assistant turn that the
  template continues (``continue_final_message``), ``prompt_logprobs=0``: the answer token's
  log-probability is the prompt's last. The prompt's token ids the server used are checked against the
  offline prompt (ids + answer token), so a template that tokenizes the continuation differently fails
  loudly instead of scoring another prompt;
- pass 2: the caller's chat body with the scores in ``mm_processor_kwargs``.

The server must accept per-request ``mm_processor_kwargs``: start it with
``vlm-prune serve ... --vllm "--trust-request-mm-kwargs"``. The video travels as :func:`video_url`
(vLLM's ``data:video/jpeg`` frame list, here with lossless PNG frames, which vLLM's loader opens by
content), so the server sees the client's pixels exactly.
"""
from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from vlm_prune.vllm.frames import load_processor, question_text, quota_kwargs

#: vLLM's video-as-frames data URL (its loader opens each comma-separated frame with PIL, any format)
VIDEO_PREFIX = "data:video/jpeg;base64,"


def video_url(frames: Any) -> str:
    """A video's frames ([T, H, W, 3] uint8 array or list of PIL images) as a data URL vLLM's server
    reads frame for frame (PNG, lossless): the ``url`` of a ``{"type": "video_url"}`` content part."""
    from PIL import Image

    parts = []
    for frame in frames:
        buf = io.BytesIO()
        (frame if isinstance(frame, Image.Image) else Image.fromarray(np.asarray(frame))).save(buf, format="PNG")
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return VIDEO_PREFIX + ",".join(parts)


def _video_parts(body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The body's one video (its base64 frames) and the messages with media parts as the processor's
    chat template names them ({"type": "video"} / {"type": "image"})."""
    videos, messages = [], []
    for msg in body.get("messages") or []:
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "video_url":
                    videos.append(part["video_url"]["url"])
                    parts.append({"type": "video"})
                elif kind == "image_url":
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            msg = {**msg, "content": parts}
        messages.append(msg)
    if len(videos) != 1 or not videos[0].startswith(VIDEO_PREFIX):
        raise ValueError("QuotaClient.quota_request needs a /v1/chat/completions body with exactly one video part "
                         '{"type": "video_url", "video_url": {"url": vlm_prune.vllm.video_url(frames)}} '
                         f"(frames the client can split); got {len(videos)} video part(s)")
    return videos[0][len(VIDEO_PREFIX):].split(","), messages


def _decode(frames_b64: list[str]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB")) for f in frames_b64])


class HttpEngine:
    """QuoTA's pass 1 through an OpenAI-compatible vLLM server, for one request's video (base64 frames):
    the HTTP twin of :class:`vlm_prune.vllm.frames.OfflineEngine`."""

    def __init__(self, client: QuotaClient, frames_b64: list[str]):
        self.client, self.frames_b64 = client, frames_b64
        self.hf_config, self.model_path, self.max_model_len = client.hf_config, client.model, client.max_model_len

    def generate(self, ids: list[int], limit: int) -> list[int]:
        reply = self.client.post("/completions", {"model": self.client.model, "prompt": ids, "max_tokens": limit,
                                                  "temperature": 0.0, "return_token_ids": True})
        return list(reply["choices"][0]["token_ids"])

    def answer_logprobs(self, prompt: str, ids: list[int], answers: list[tuple[str, int]], units: list[list[int]],
                        kwargs: dict[str, Any]) -> list[float]:
        """As :meth:`vlm_prune.vllm.frames.OfflineEngine.answer_logprobs`, one chat request per unit and answer:
        the unit's frames and ``prompt`` as the user turn, the answer word as the assistant turn the template
        continues; the prompt the server built is checked against ``ids`` + the answer's token."""
        media = self.client.video_token_id
        cut = ids.index(media)

        def one(item: tuple[list[int], tuple[str, int]]) -> float:
            unit, (word, target) = item
            url = VIDEO_PREFIX + ",".join(self.frames_b64[i] for i in unit)
            body = {"model": self.client.model, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                    "return_token_ids": True, "add_generation_prompt": False, "continue_final_message": True,
                    "mm_processor_kwargs": kwargs,
                    "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                              {"type": "text", "text": prompt}]},
                                 {"role": "assistant", "content": word}]}
            reply = self.client.post("/chat/completions", body)
            got = reply["prompt_token_ids"]
            first, last = got.index(media), len(got) - 1 - got[::-1].index(media)
            want_after = ids[cut + 1:] + [target]
            if got[:first] != ids[:cut] or got[last + 1:] != want_after:
                raise RuntimeError("the server's scoring prompt is not QuoTA's frame prompt followed by the answer "
                                   f"token: around the video it used {got[:first]} ... {got[last + 1:]}, expected "
                                   f"{ids[:cut]} ... {want_after} (the served chat template renders the assistant "
                                   f"turn {word!r} after the prompt differently from the processor's generation prompt)")
            return float(reply["prompt_logprobs"][-1][str(target)]["logprob"])

        items = [(unit, answer) for unit in units for answer in answers]
        with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:  # concurrent: the server batches them
            return list(pool.map(one, items))


class QuotaClient:
    """QuoTA requests against ``vlm-prune serve`` (vLLM's OpenAI-compatible server, started with
    ``--vllm "--trust-request-mm-kwargs"``): ``client.quota_request(body, QuoTA(...), keep=0.5)`` runs pass 1
    over HTTP and returns the /v1/chat/completions body of pass 2 (``client.post("/chat/completions", it)``).

    ``base_url``: the server's OpenAI root (``http://host:port/v1``); ``model``: the served model's name,
    a local folder of the checkpoint unless ``processor`` / ``config`` are given (the client builds the
    prompts with the checkpoint's chat template and tokenizer, as the offline path does)."""

    def __init__(self, base_url: str, model: str, *, processor: Any = None, config: Any = None,
                 timeout: float = 600.0):
        from transformers import AutoConfig

        self.base_url, self.model, self.timeout = base_url.rstrip("/"), model, timeout
        self.processor = processor if processor is not None else load_processor(model)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.hf_config = config if config is not None else AutoConfig.from_pretrained(model)
        served = {m["id"]: m for m in self.get("/models")["data"]}
        if model not in served:
            raise ValueError(f"the server at {self.base_url} serves {sorted(served)}, not {model!r}")
        self.max_model_len = int(served[model]["max_model_len"])
        cfg = self.hf_config
        ids = [getattr(cfg, k, None) for k in ("video_token_index", "video_token_id")]
        if all(i is None for i in ids):
            raise ValueError(f"{model}'s config names no video token: QuoTA serves video models only")
        self.video_token_id = next(i for i in ids if i is not None)

    def get(self, path: str) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.base_url + path, timeout=self.timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            hint = (" (start the server with --vllm \"--trust-request-mm-kwargs\")"
                    if "mm_processor_kwargs" in detail else "")
            raise RuntimeError(f"{self.base_url + path} answered {err.code}: {detail}{hint}") from None

    def quota_request(self, body: dict[str, Any], method: Any = "quota", *, keep: float | None = None,
                      budget: int | None = None, seed: int = 0) -> dict[str, Any]:
        """Pass 1 over HTTP; returns ``body`` (a /v1/chat/completions request with one video part,
        :func:`video_url`) with the scores in its ``mm_processor_kwargs``, the request of pass 2."""
        frames_b64, messages = _video_parts(body)
        text = self.processor.apply_chat_template(messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                                  tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        question = question_text({"prompt_token_ids": ids}, self.processor, self.hf_config)
        engine = HttpEngine(self, frames_b64)
        kwargs = quota_kwargs(engine, _decode(frames_b64), question, method, keep=keep, budget=budget, seed=seed,
                              processor=self.processor)
        extra = dict(body.get("mm_processor_kwargs") or {})
        return {**body, "mm_processor_kwargs": {**extra, **kwargs}}
