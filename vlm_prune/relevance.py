"""Instruction relevance of visual tokens and frames: one sign convention for every method.

CDPruner (token level) and KeyScore (frame level) both ask how relevant a visual embedding x
is to the instruction, from the cosine between x and the instruction's text embeddings
t_1..t_T. Which sign means "relevant" depends on the embedding space, not on the method:

- In-model embeddings (the default of both methods): visual features after the projector
  against the language model's input embeddings of the question words, or CLIP patch tokens
  against CLIP text embeddings. Nothing trains these to point along the words they show, and
  the official CDPruner code ranks by the NEGATED cosine (Theia-4869/CDPruner@ed9c12d,
  llava/model/llava_arch.py ``encode_images``: ``relevance = (-relevance).mean(dim=-1)``).
  Measured on the project's synthetic models (BENCHMARKS.md, "Instruction relevance sign"),
  the negated cosine is the one that finds the answer: CDPruner keeps 97.3% at 11% of the
  tokens negated vs 70.3% with the plain cosine, and KeyScore's relevance term recalls the
  answer frames far above chance negated and at or below chance plain. So
  ``relevance = -cos`` (:data:`IN_MODEL_NEGATED`).
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
