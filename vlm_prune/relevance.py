"""Instruction relevance of visual tokens and frames: one sign convention for every method.

CDPruner (token level) and KeyScore (frame level) both ask how relevant a visual embedding x
is to the instruction, from the cosine between x and the instruction's text embeddings
t_1..t_T. Which sign means "relevant" depends on the embedding space, not on the method:

- In-model embeddings (the default of both methods): visual features after the projector
  against the language model's input embeddings of the question words, or CLIP patch tokens
  against CLIP text embeddings. Nothing trains these to point along the words they show, and
  the official CDPruner code ranks by the NEGATED cosine (Theia-4869/CDPruner@ed9c12d,
  llava/model/llava_arch.py ``encode_images``: ``relevance = (-relevance).mean(dim=-1)``).
  Measured on the shipped synthetic task-family models (``scripts/relevance_sign.py``, run
  before the results page was generated from result files, so in the history of BENCHMARKS.md: every bench seed, paired 95% intervals over the same samples): on the video
  models the negated cosine is the one that finds the answer - CDPruner keeps 61.3% at 25% of
  the tokens negated vs 33.0% with the plain cosine (+28.3 +- 5.4 points), KeyScore's relevance
  term recalls 82% of the answer frames negated vs 10% plain (chance 16%); on the image models
  the sign makes no resolved difference (CDPruner -4.2 to +3.5 points at 25 / 11 / 5%, every
  interval across zero). So ``relevance = -cos`` (:data:`IN_MODEL_NEGATED`), as the official code.
- A contrastively trained image-text encoder's pooled embeddings (CLIP / SigLIP
  ``get_image_features`` / ``get_text_features``, KeyScore's ``encoder=``): trained so that
  matching pairs have a high cosine, so ``relevance = +cos`` (the KeyScore paper's S_sem).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: in-model embeddings rank by the negated cosine (see the module docstring)
IN_MODEL_NEGATED = True


def query_cosine(features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """mean_t cos(features_i, text_t) for features [N, D] and text [T, D] (or [D]); [N] float32.

    Equal to cos(features_i, c) * ||c|| with c the mean of the unit text vectors, so every
    method ranks by the same cosine to the instruction's mean direction."""
    t = text.float().reshape(-1, text.shape[-1])
    return (F.normalize(features.float(), dim=-1) @ F.normalize(t, dim=-1).t()).mean(dim=-1)


def instruction_relevance(features: torch.Tensor, text: torch.Tensor, negate: bool = IN_MODEL_NEGATED) -> torch.Tensor:
    """Relevance [N] of each row of features [N, D] to the instruction text [T, D]: the
    :func:`query_cosine`, negated when ``negate`` (in-model embeddings, the default)."""
    cos = query_cosine(features, text)
    return -cos if negate else cos
