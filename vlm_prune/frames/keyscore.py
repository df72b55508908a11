"""KeyScore: caption-aware keyframe scoring (KeyScore paper, arXiv 2510.06509; no official code).

For candidate frames f_1..f_P (in time order) and a caption / query c, with E an image-text
encoder whose embeddings are L2-normalised:
  S_sem(i)  = cos(E(f_i), E(c))
  S_temp(i) = 1 - max cos(E(f_i), E(f_j)) over its temporal neighbours j = i - 1, i + 1
  S_drop(i) = cos(mean_j E(f_j), E(c)) - cos(mean_{j != i} E(f_j), E(c))
Each is min-max normalised over the candidates (a constant component becomes 0) and
KeyScore = a S_sem + b S_temp + c S_drop with a = b = c = 1/3.

Relevance sign (vlm_prune.relevance, one convention with CDPruner): cos above is the paper's,
right for a contrastively trained encoder (CLIP / SigLIP, ``encoder=``). With the default
in-model embeddings (projected frame tokens against the question's input embeddings) relevance
is the NEGATED cosine, in S_sem and in S_drop alike: measured on the synthetic video model, the
plain cosine ranks the answer frames last (``scripts/relevance_sign.py``; its run predates the committed result files, so its figures
live in the history of BENCHMARKS.md).

Unverified choices (configurable where it matters): the S_temp neighbourhood (the adjacent
candidates), L2-normalising embeddings before the means, several captions averaged into one
text embedding (each normalised first), and with a single candidate S_temp = S_drop = 0.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vlm_prune.frames.stacfp import require_stacfp_packages, stacfp_proposals
from vlm_prune.frames.uniform import frames_plan, partial_frame_plan
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan
from vlm_prune.registry import register
from vlm_prune.relevance import IN_MODEL_NEGATED

#: (frames uint8 [T, H, W, 3] RGB, texts) -> (frame embeddings [T, D], text embeddings [n, D])
Encoder = Callable[[np.ndarray, Sequence[str]], tuple[torch.Tensor, torch.Tensor]]
DEFAULT_WEIGHTS = (1 / 3, 1 / 3, 1 / 3)


@dataclass
class KeyScores:
    """Per-candidate components (each min-max normalised) and their weighted sum."""

    sem: torch.Tensor
    temp: torch.Tensor
    drop: torch.Tensor
    score: torch.Tensor


def minmax(x: torch.Tensor) -> torch.Tensor:
    """(x - min) / (max - min); zeros when x is constant."""
    span = x.max() - x.min() if x.numel() else x.new_zeros(())
    if x.numel() == 0 or float(span) <= 1e-12:
        return torch.zeros_like(x)
    return (x - x.min()) / span


def text_embedding(text_emb: torch.Tensor) -> torch.Tensor:
    """One unit text vector from [D] or [n, D] embeddings (normalise each, average, normalise)."""
    t = F.normalize(text_emb.detach().float().cpu().reshape(-1, text_emb.shape[-1]), dim=-1).mean(0)
    return F.normalize(t, dim=0)


def keyscore(
    frame_emb: torch.Tensor,
    text_emb: torch.Tensor | None,
    weights: tuple[float, float, float] = DEFAULT_WEIGHTS,
    negate: bool = False,
) -> KeyScores:
    """KeyScore of P candidate frames [P, D] (in time order) against a caption embedding.

    text_emb None (no caption): S_sem = S_drop = 0, so only S_temp ranks the frames.
    ``negate``: relevance is -cos instead of cos (in-model embeddings, see the module docstring).
    Computed in float32 on the CPU (P x D is small); returns CPU tensors.
    """
    f = F.normalize(frame_emb.detach().float().cpu(), dim=-1)
    p = f.shape[0]
    sim = f @ f.t()
    neighbour = torch.full((p,), -float("inf"))
    if p > 1:
        neighbour[1:] = torch.maximum(neighbour[1:], sim.diagonal(-1))
        neighbour[:-1] = torch.maximum(neighbour[:-1], sim.diagonal(1))
        temp = 1 - neighbour
    else:
        temp = torch.zeros(p)
    if text_emb is None:
        sem = drop = torch.zeros(p)
    else:
        c = text_embedding(text_emb)
        sign = -1.0 if negate else 1.0
        sem = sign * (f @ c)
        if p > 1:
            total = f.sum(0)
            rest = (total[None, :] - f) / (p - 1)
            drop = sign * (F.cosine_similarity(total[None, :] / p, c[None, :]) - F.cosine_similarity(rest, c[None, :]))
        else:
            drop = torch.zeros(p)
    sem, temp, drop = minmax(sem), minmax(temp), minmax(drop)
    a, b, w_c = weights
    return KeyScores(sem, temp, drop, a * sem + b * temp + w_c * drop)


def top_k_in_order(scores: torch.Tensor | np.ndarray, k: int) -> list[int]:
    """Positions of the k highest scores (ties: earlier first), returned ascending."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return sorted(order[:k])


# ---- encoders -------------------------------------------------------------------------------
class HFImageTextEncoder:
    """A transformers CLIP / SigLIP model and its processor as a KeyScore encoder.

    Frames go through ``processor(images=...)`` and ``model.get_image_features`` in batches of
    ``batch_size``; texts through ``processor(text=...)`` and ``model.get_text_features``
    (SigLIP texts padded to max_length, as it was trained). Runs under torch.no_grad().
    """

    def __init__(self, model: Any, processor: Any, batch_size: int = 32) -> None:
        for fn in ("get_image_features", "get_text_features"):
            if not hasattr(model, fn):
                raise TypeError(
                    f"{type(model).__name__} has no {fn}(); the KeyScore encoder must be an "
                    "image-text model such as CLIPModel or SiglipModel"
                )
        self.model = model.eval()
        self.processor = processor
        self.batch_size = batch_size

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def __call__(self, frames: np.ndarray, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = next(self.model.parameters()).dtype
        chunks = []
        for start in range(0, len(frames), self.batch_size):
            batch = [np.asarray(f) for f in frames[start: start + self.batch_size]]
            pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"]
            out = self.model.get_image_features(pixel_values=pixels.to(self._device, dtype))
            chunks.append(_pooled(out).float().cpu())
        siglip = "siglip" in getattr(self.model.config, "model_type", "")
        tok = self.processor(
            text=list(texts), return_tensors="pt", truncation=True,
            padding="max_length" if siglip else True,
        )
        tok = {k: v.to(self._device) for k, v in tok.items() if k in ("input_ids", "attention_mask")}
        text = _pooled(self.model.get_text_features(**tok)).float().cpu()
        return torch.cat(chunks), text


def _pooled(out: Any) -> torch.Tensor:
    """get_*_features returns a tensor (transformers 4) or an output with pooler_output (5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def load_encoder(path_or_id: str, device: str | torch.device = "cpu", batch_size: int = 32) -> HFImageTextEncoder:
    """A CLIP / SigLIP checkpoint (local folder or hub id) loaded with from_pretrained."""
    from transformers import AutoModel, AutoProcessor

    try:
        model = AutoModel.from_pretrained(path_or_id)
        processor = AutoProcessor.from_pretrained(path_or_id)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot load an image-text encoder from {path_or_id!r}: {err}. Give a local folder or hub "
            "id of a CLIP / SigLIP checkpoint saved with its processor (save_pretrained)"
        ) from err
    return HFImageTextEncoder(model.to(device), processor, batch_size)


def pixels_to_rgb(pixels: torch.Tensor) -> np.ndarray:
    """[T, C, H, W] processor-normalised frames -> uint8 [T, H, W, 3], each frame min-max
    rescaled to 0..255 (an approximation: the processor's normalisation is not inverted)."""
    x = pixels.detach().float().cpu()[:, :3]
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    hi = x.amax(dim=(1, 2, 3), keepdim=True)
    x = (x - lo) / (hi - lo).clamp(min=1e-12)
    return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


@register
class KeyScore(FramesMethod):
    """KeyScore (arXiv 2510.06509) frame selection inside a wrapped video model.

    Keeps the n_total // N frames (N tokens per frame) with the highest KeyScore, at native
    resolution; below one frame's worth the best frame keeps n_total evenly spaced tokens.
    Knobs:
      weights=(1/3, 1/3, 1/3): (a, b, c) of S_sem, S_temp, S_drop (unverified).
      proposals="stacfp": the paper's pipeline - STACFP clusters the frames first (from ctx.pixels,
        min-max rescaled to RGB; k in (max(2, n_frames), k_max) by silhouette) and KeyScore ranks
        the cluster medoids; needs the ``video`` extra (OpenCV). "all": every
        sampled frame is a candidate.
      encoder=None: frame embedding = the frame's tokens (ctx.features) mean-pooled, caption
        embedding = the query's input embeddings (ctx.text_features) - both in the LLM's input
        space. Or any callable (frames uint8 [T, H, W, 3], [query]) -> (frame_emb, text_emb),
        given frames from ctx.pixels, e.g. load_encoder(CLIP / SigLIP). Without text only
        S_temp ranks the frames.
      negate_relevance=None: the project's sign convention (vlm_prune.relevance) - relevance is
        -cos for the in-model embeddings (encoder=None), +cos (the paper's) for an encoder.
      k_max=16, gamma_time=0.5: STACFP settings.
    """

    name = "keyscore"
    paper = "KeyScore + STACFP, arXiv 2510.06509"

    def __init__(
        self,
        keep: float | None = None,
        budget: int | None = None,
        weights: tuple[float, float, float] = DEFAULT_WEIGHTS,
        proposals: str = "stacfp",
        encoder: Encoder | None = None,
        k_max: int = 16,
        gamma_time: float = 0.5,
        negate_relevance: bool | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if proposals not in ("all", "stacfp"):
            raise ValueError(f"KeyScore proposals must be 'all' or 'stacfp', got {proposals!r}")
        if len(weights) != 3:
            raise ValueError(f"KeyScore weights are (a, b, c) for S_sem, S_temp, S_drop, got {weights!r}")
        if proposals == "stacfp":
            require_stacfp_packages()
        self.weights = tuple(float(w) for w in weights)
        self.proposals = proposals
        self.k_max = k_max
        self.gamma_time = gamma_time
        self._encoder = encoder
        self.negate_relevance = (IN_MODEL_NEGATED if encoder is None else False) if negate_relevance is None else negate_relevance

    def _candidates(self, ctx: FramesContext, n_frames: int) -> list[int]:
        t = ctx.features.shape[0]
        if self.proposals == "all" or t <= n_frames:
            return list(range(t))
        if ctx.pixels is None:
            raise ValueError("KeyScore proposals='stacfp' needs the frames' pixels, but the context has none")
        k_lo = max(2, n_frames)
        props = stacfp_proposals(pixels_to_rgb(ctx.pixels), (k_lo, max(k_lo, self.k_max)), self.gamma_time)
        return props.indices.tolist()

    def _embed(self, ctx: FramesContext, cand: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._encoder is None:
            frame_emb = ctx.features[cand].float().mean(1)
            text = ctx.text_features
            return frame_emb, None if text is None or text.numel() == 0 else text.float().mean(0)
        if ctx.pixels is None:
            raise ValueError("KeyScore's custom encoder needs the frames' pixels, but the context has none")
        frame_emb, text_emb = self._encoder(pixels_to_rgb(ctx.pixels[cand]), [ctx.query or ""])
        return frame_emb, text_emb if ctx.query else None

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        t, n, _ = ctx.features.shape
        n_frames = min(t, ctx.n_total // n)
        cand = self._candidates(ctx, max(1, n_frames))
        frame_emb, text_emb = self._embed(ctx, cand)
        scores = keyscore(frame_emb, text_emb, self.weights, self.negate_relevance).score
        frame_scores = torch.zeros(t)
        frame_scores[cand] = scores
        if n_frames == 0:
            plan = partial_frame_plan(cand[int(torch.argmax(scores))], t, n, ctx.n_total, ctx.features.device)
        else:
            kept = [cand[i] for i in top_k_in_order(scores, n_frames)]
            plan = frames_plan(kept, t, n, ctx.features.device)
        plan.frame_scores = frame_scores
        return plan
