"""Blind token / frame dropping without the library, to check that the benchmark discriminates.

Dropped visual tokens are hidden through the attention mask while every token keeps its
original position id, which is the same as removing them from the sequence (the library's
physical-removal invariant). This is an independent reference for ``vlm_prune.wrap``.

    python -m vlm_prune.eval.synthetic.ablation      # the shipped models on 256 test samples each
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
from transformers import PreTrainedModel, ProcessorMixin

from vlm_prune.eval.synthetic.evaluate import encode
from vlm_prune.eval.synthetic.scenes import NUM_FRAMES, Sample, make_dataset

Selector = Callable[[int, torch.Generator], list[int]]


def random_tokens(keep: float) -> Selector:
    """Keep a random ``keep`` fraction (at least one) of a row's visual tokens."""
    def select(n: int, gen: torch.Generator) -> list[int]:
        k = max(1, round(keep * n))
        return sorted(torch.randperm(n, generator=gen)[:k].tolist())
    return select


def frames(indices: list[int], num_frames: int = NUM_FRAMES) -> Selector:
    """Keep the tokens of frames ``indices`` of a OneVision video (and its trailing newline token)."""
    def select(n: int, gen: torch.Generator) -> list[int]:
        per_frame = (n - 1) // num_frames
        return [f * per_frame + j for f in indices for j in range(per_frame)] + [n - 1]
    return select


@torch.no_grad()
def masked_accuracy(model: PreTrainedModel, processor: ProcessorMixin, samples: list[Sample], select: Selector, batch_size: int = 16, seed: int = 0) -> float:
    """Greedy first-word accuracy when only the visual tokens chosen by ``select`` are visible."""
    gen = torch.Generator().manual_seed(seed)
    token_ids = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<video>")]
    hits = 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        inputs = encode(processor, chunk)
        mask = inputs["attention_mask"].clone()
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        visual = torch.isin(inputs["input_ids"], torch.tensor(token_ids))
        for row in range(len(chunk)):
            where = visual[row].nonzero().squeeze(1)
            hidden = torch.ones(len(where), dtype=torch.bool)
            hidden[select(len(where), gen)] = False
            mask[row, where[hidden]] = 0
        inputs["attention_mask"] = mask
        out = model.generate(**inputs, position_ids=position_ids, max_new_tokens=3, do_sample=False)
        texts = processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum((t.split() or [""])[0].lower() == s.answer.lower() for t, s in zip(texts, chunk))
    return hits / len(samples)


BLIND = {
    "image": {f"random keep {k}": random_tokens(k) for k in (0.5, 0.25, 0.11)},
    "video": {"uniform frames [0, 5, 10, 15]": frames([0, 5, 10, 15]),
              "every other frame": frames(list(range(0, NUM_FRAMES, 2)))},
}


def main(argv: list[str] | None = None) -> None:
    """Print each shipped model's test accuracy unpruned and under blind dropping."""
    from vlm_prune.eval.synthetic.evaluate import accuracy_by_qtype
    from vlm_prune.eval.synthetic.models import load

    p = argparse.ArgumentParser(description="Blind token / frame dropping on the shipped synthetic models")
    p.add_argument("--samples", type=int, default=256, help="test samples per model (default 256)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for kind, selectors in BLIND.items():
        model, processor = load(kind)
        samples = make_dataset(kind, "test", args.samples)
        print(f"{kind}: unpruned {accuracy_by_qtype(model, processor, samples, 32)}")
        for name, select in selectors.items():
            print(f"{kind}: {name} -> {masked_accuracy(model, processor, samples, select, batch_size=32):.3f}")


if __name__ == "__main__":
    main()
