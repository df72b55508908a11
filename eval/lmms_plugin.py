"""lmms-eval model plugin: any supported HF VLM, pruned by vlm-prune, on lmms-eval's tasks.

    pip install 'vlm-prune[lmms]'
    torchrun --nproc_per_node 8 -m lmms_eval --model vlm_prune --tasks videomme --batch_size 1 \
        --model_args pretrained=llava-hf/llava-onevision-qwen2-7b-ov-hf,method=quota+pact,keep=0.25,max_frames=32

One process per GPU (``torchrun`` or ``accelerate launch --num_processes N``; on a machine
without GPUs only torchrun starts N processes, ``accelerate launch --cpu`` starts one). Each
process holds the whole model on its GPU (``cuda:LOCAL_RANK``) and answers its share of the
requests; the plugin creates the ``Accelerator`` lmms-eval's multi-process evaluator gathers
with, and exposes ``device``, ``rank``, ``world_size`` and ``accelerator`` as it expects.

lmms-eval finds the model through the ``lmms_eval.models`` entry point, which points at
:func:`lmms_manifest`. ``--model_args``: ``pretrained`` (hub id or folder), ``method``
("none" by default; "+" joins stages), ``keep`` or ``budget``, ``max_frames`` (32),
``dtype`` ("auto": bfloat16 on CUDA), ``device_map``, ``max_new_tokens`` (16), ``seed`` (0).
The plugin answers ``generate_until`` requests; log-likelihood requests are not supported.
A document whose video or image cannot be read (undecodable, truncated to nothing, too slow to decode)
is a failed document: logged, answered with an empty string (scored wrong by the task), counted in
``failed_documents`` and in a summary line at the end of each ``generate_until``, and the run goes on.
"""
from __future__ import annotations

import logging
from typing import Any

from vlm_prune.eval import sharding

log = logging.getLogger("vlm_prune.lmms")

try:
    from lmms_eval.api.model import lmms as _Base
except ImportError:  # lmms-eval is optional; the class stays importable without it
    _Base = object


def lmms_manifest() -> Any:
    """The entry-point payload lmms-eval (>= 0.7) registers: model id "vlm_prune"."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="vlm_prune", simple_class_path=f"{__name__}.VLMPruneLMM")


def _optional_float(value: Any) -> float | None:
    return None if value in (None, "", "None") else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value in (None, "", "None") else int(value)


class VLMPruneLMM(_Base):
    """An lmms-eval "simple" model: a HF VLM, optionally wrapped with vlm-prune methods."""

    is_simple = True
    RECENT_VIDEOS = 4  # decoded videos kept for the next questions about them

    def __init__(
        self,
        pretrained: str,
        method: str = "none",
        keep: float | str | None = None,
        budget: int | str | None = None,
        max_frames: int | str = 32,
        dtype: str = "auto",
        device_map: str | None = None,
        max_new_tokens: int | str = 16,
        seed: int | str = 0,
        batch_size: int | str = 1,
        model: Any = None,
        processor: Any = None,
        **unused: Any,
    ) -> None:
        if _Base is not object:
            super().__init__()
        import vlm_prune
        from vlm_prune.eval.runner import EvalConfig, Predictor, load_model

        if int(batch_size) != 1:
            raise ValueError(f"vlm_prune runs batch_size 1 (one question per forward), got {batch_size}")
        dist = sharding.current()
        sharding.exit_with_launcher(dist)  # a rank whose torchrun / accelerate died ends too
        self._rank, self._world_size = dist.rank, dist.world_size
        if dist.world_size > 1:  # lmms-eval's evaluator gathers request counts through it
            from accelerate import Accelerator

            self.accelerator = Accelerator()
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
        if model is None:
            cfg = EvalConfig(model=pretrained, data="", dataset="", out="", dtype=dtype, device_map=device_map)
            model, processor = load_model(cfg, dist)
        if method != "none":
            vlm_prune.wrap(model, method.split("+"), keep=_optional_float(keep), budget=_optional_int(budget),
                           processor=processor, seed=int(seed))
        self.model = model
        self.max_frames = int(max_frames)
        self.predictor = Predictor(model, processor, int(max_new_tokens))
        self._device = self.predictor.device
        self.batch_size_per_gpu = 1
        self._recent: dict[str, Any] = {}  # path -> frames of the last few videos, oldest first
        #: documents whose media could not be read: {"task", "split", "doc_id", "error"} each
        self.failed_documents: list[dict[str, Any]] = []
        self.task_dict: dict[str, Any] = getattr(self, "task_dict", {})

    @property
    def device(self) -> Any:
        """The device of the model's first parameters (cuda:LOCAL_RANK per process, or cpu)."""
        return self._device

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    def _visuals(self, visuals: list[Any]) -> tuple[list[Any], str | None, Any]:
        """(frames or images, "video" / "image" / None, the video frames' times in seconds or None)."""
        from vlm_prune.video import read_frames

        if not visuals:
            return [], None, None
        if isinstance(visuals[0], str):
            if len(visuals) != 1:
                raise ValueError(f"vlm_prune answers about one video per question, got {len(visuals)} paths")
            if visuals[0] not in self._recent:  # Video-MME asks 3 questions about each video
                self._recent[visuals[0]] = read_frames(visuals[0], num_frames=self.max_frames)
                while len(self._recent) > self.RECENT_VIDEOS:
                    self._recent.pop(next(iter(self._recent)))
            frames, times = self._recent[visuals[0]]
            return [frames], "video", times
        return [v.convert("RGB") for v in visuals], "image", None

    def generate_until(self, requests: list[Any]) -> list[str]:
        """Greedy answers; each request's args are (context, gen_kwargs, doc_to_visual, doc_id, task, split)."""
        from tqdm.auto import tqdm

        from vlm_prune.video import VideoError

        answers = []
        failed_before = len(self.failed_documents)
        for req in tqdm(requests, desc="vlm_prune", disable=self._rank != 0):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            raw = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual is not None else []
            flat = [v for item in (raw or []) for v in (item if isinstance(item, list) else [item])]
            try:
                visuals, media_type, times = self._visuals(flat)
            except (VideoError, OSError) as err:  # one unreadable file must not end the run
                error = f"{type(err).__name__}: {err}"
                self.failed_documents.append({"task": task, "split": split, "doc_id": doc_id, "error": error[:2000]})
                log.warning("vlm_prune: %s/%s document %s failed (its media cannot be read), answered with an empty "
                            "string: %s", task, split, doc_id, error[:500])
                answers.append("")
                continue
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            gen = self.predictor.generate(context, visuals, media_type,
                                          max_new_tokens=gen_kwargs.get("max_new_tokens"), stop=until, times=times)
            answers.append(gen.text)
        failed = self.failed_documents[failed_before:]
        if failed:
            log.warning("vlm_prune: rank %d: %d of %d documents failed (media unreadable, answered empty): %s",
                        self._rank, len(failed), len(requests), ", ".join(f"{f['task']}/{f['doc_id']}" for f in failed[:10]))
        return answers

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the vlm_prune lmms-eval model answers generate_until tasks only")

    def generate_until_multi_round(self, requests: list[Any]) -> list[str]:
        raise NotImplementedError("the vlm_prune lmms-eval model answers single-round generate_until tasks only")
