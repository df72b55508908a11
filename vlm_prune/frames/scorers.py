"""Frame scorers for QuoTA beyond the wrapped model itself.

QuoTA (arXiv 2503.08689) asks a VLM, one frame at a time, a yes/no question about the frame
and reads P("A") of its answer. The official code (MAC-AutoML/QuoTA, ``tools/qwen2vl_batch.py``)
uses a SEPARATE Qwen2-VL-2B-Instruct that sees each raw frame as an image, 64 frames per batch.
:func:`vlm_scorer` turns such a model and its processor into the ``scorer`` callable
``QuoTA(scorer=...)`` takes: (pixels [T, C, H, W], prompt) -> p [T]::

    scorer = vlm_scorer(Qwen2VLForConditionalGeneration.from_pretrained("Qwen/Qwen2-VL-2B-Instruct"),
                        AutoProcessor.from_pretrained("Qwen/Qwen2-VL-2B-Instruct"))
    vlm_prune.wrap(model, frames=QuoTA(scorer=scorer), tokens="pact", keep=0.3, processor=processor)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.frames.keyscore import pixels_to_rgb


def vocab_id(tokenizer: Any, word: str) -> int:
    """The tokenizer's id of an answer token, never hard-coded; a clear error when it has none."""
    ids = tokenizer.encode(word, add_special_tokens=False)
    if not ids or (len(ids) == 1 and ids[0] == getattr(tokenizer, "unk_token_id", None)):
        raise ValueError(f"the tokenizer has no token for the answer {word!r}")
    return ids[-1]


def vlm_scorer(model: Any, processor: Any, batch_size: int = 64, letter: str = "A") -> Callable[[torch.Tensor, str], torch.Tensor]:
    """Another VLM (officially Qwen2-VL-2B-Instruct) as QuoTA's frame scorer.

    Each frame becomes an image turn "<image> {prompt}" in the scorer's own chat template; the
    score is softmax(next-token logits)[id of ``letter``] at the last prompt token (logits of
    that position only), ``batch_size`` frames per forward (official: 64). Frames reach it as the
    wrapped model's processor prepared them, rescaled to 0..255 per frame (min-max; the official
    gives the raw decoded frames, which the wrapped model's inputs no longer hold).
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    target = vocab_id(tokenizer, letter)
    device = next(model.parameters()).device

    def score(pixels: torch.Tensor, prompt: str) -> torch.Tensor:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True)
        frames = pixels_to_rgb(pixels)
        out = []
        for start in range(0, len(frames), batch_size):
            chunk = list(frames[start : start + batch_size])
            inputs = processor(images=chunk, text=[text] * len(chunk), return_tensors="pt", padding=True).to(device)
            if tokenizer.padding_side != "left" and bool((inputs["attention_mask"][:, -1] == 0).any()):
                raise ValueError("vlm_scorer needs a left-padding processor (processor.tokenizer.padding_side = 'left')")
            with torch.no_grad():
                logits = model(**inputs, logits_to_keep=1).logits[:, -1]
            out.append(torch.softmax(logits.float(), dim=-1)[:, target].cpu())
        return torch.cat(out)

    return score
