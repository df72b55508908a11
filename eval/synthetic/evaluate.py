"""Encoding samples with the processor and scoring greedy answers."""
from __future__ import annotations

from collections import defaultdict

import torch
from transformers import BatchFeature, PreTrainedModel, ProcessorMixin

from vlm_prune.eval.synthetic.processing import prompt
from vlm_prune.eval.synthetic.scenes import Sample
from vlm_prune.video import processor_video_kwargs


def encode(processor: ProcessorMixin, samples: list[Sample], with_answers: bool = False) -> BatchFeature:
    """Chat-template prompts (left padded) and pixels of ``samples``; optionally with "answer </s>" appended."""
    media = "video" if samples[0].frames is not None else "image"
    eos = processor.tokenizer.eos_token
    texts = [prompt(processor, s.question, media) + (f" {s.answer} {eos}" if with_answers else "") for s in samples]
    if media == "image":
        # one list per sample: Gemma 3's and SmolVLM's processors read a flat list as one sample's images
        return processor(images=[[s.image] for s in samples], text=texts, padding=True, return_tensors="pt")
    return processor(videos=[s.frames for s in samples], text=texts, padding=True, return_tensors="pt",
                     **processor_video_kwargs(processor))


@torch.no_grad()
def predict(model: PreTrainedModel, processor: ProcessorMixin, samples: list[Sample], batch_size: int = 16, max_new_tokens: int = 3) -> list[str]:
    """First word of each greedy answer (lower case; "" when the model answers nothing)."""
    words = []
    for i in range(0, len(samples), batch_size):
        inputs = encode(processor, samples[i : i + batch_size]).to(model.device)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        texts = processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        words += [(t.split() or [""])[0].lower() for t in texts]
    return words


def evaluate(model: PreTrainedModel, processor: ProcessorMixin, samples: list[Sample], batch_size: int = 16) -> float:
    """Accuracy of the first generated word against each sample's answer (case-insensitive)."""
    preds = predict(model, processor, samples, batch_size)
    return sum(p == s.answer.lower() for p, s in zip(preds, samples)) / len(samples)


def accuracy_by_qtype(model: PreTrainedModel, processor: ProcessorMixin, samples: list[Sample], batch_size: int = 16) -> dict[str, float]:
    """Accuracy per question type, plus "all"."""
    preds = predict(model, processor, samples, batch_size)
    hits: dict[str, list[bool]] = defaultdict(list)
    for p, s in zip(preds, samples):
        hits[s.qtype].append(p == s.answer.lower())
        hits["all"].append(p == s.answer.lower())
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}
