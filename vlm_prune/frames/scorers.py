"""Frame scorers for QuoTA beyond the wrapped model itself.

QuoTA (arXiv 2503.08689) asks a VLM, one frame at a time, a yes/no question about the frame
and reads P("A") of its answer; the official code uses the same VLM it prunes, but any VLM
can score. :func:`vlm_scorer` turns another Hugging Face VLM and its processor into the
``scorer`` callable ``QuoTA(scorer=...)`` takes: (pixels [T, C, H, W], prompt) -> p [T].
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.frames.keyscore import pixels_to_rgb


def letter_id(tokenizer: Any, letter: str = "A") -> int:
    """The tokenizer's id of an answer letter, never hard-coded; a clear error when it has none."""
    ids = tokenizer.encode(letter, add_special_tokens=False)
    if not ids or (len(ids) == 1 and ids[0] == getattr(tokenizer, "unk_token_id", None)):
        raise ValueError(f"the scorer's tokenizer has no token for the answer letter {letter!r}")
    return ids[-1]


def vlm_scorer(model: Any, processor: Any, batch_size: int = 8, letter: str = "A") -> Callable[[torch.Tensor, str], torch.Tensor]:
    """Another VLM (e.g. a small LLaVA-OneVision or Qwen2-VL) as QuoTA's frame scorer.

    Each frame becomes an image turn "<image> {prompt}" in the scorer's own chat template; the
    score is softmax(next-token logits)[id of ``letter``] at the last prompt token, batched by
    ``batch_size`` frames. Frames reach it as the wrapped model's processor prepared them and are
    rescaled to 0..255 per frame first (the two processors' normalisations differ).
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    target = letter_id(tokenizer, letter)
    device = next(model.parameters()).device

    def score(pixels: torch.Tensor, prompt: str) -> torch.Tensor:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True)
        frames = pixels_to_rgb(pixels)
        out = []
        for start in range(0, len(frames), batch_size):
            chunk = list(frames[start : start + batch_size])
            inputs = processor(images=chunk, text=[text] * len(chunk), return_tensors="pt", padding=True).to(device)
            with torch.no_grad():
                logits = model(**inputs).logits
            last = inputs["attention_mask"].cumsum(1).argmax(1)  # last real token, either padding side
            rows = logits[torch.arange(len(chunk), device=logits.device), last]
            out.append(torch.softmax(rows.float(), dim=-1)[:, target].cpu())
        return torch.cat(out)

    return score
