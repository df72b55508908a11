"""Shared machinery of the Hugging Face VLM adapters (LLaVA family, Qwen2-VL family).

Data flow for one prefill:
1. the inner model's ``forward`` (LlavaModel, Qwen2VLModel, ...) is wrapped: it records which
   rows of ``input_ids`` are visual placeholders (a :class:`Pending` for the engine);
2. the feature function (``get_image_features`` / ``get_video_features``) is wrapped: it runs
   the model's own tower and projector, then the vision / frames method on each image;
   reduced tokens are written back into their slots, dropped slots are marked;
3. the language model's ``forward`` is the engine (:class:`PrunedDecoder`), which removes the
   dropped rows before layer 0 (keeping original position ids) and runs the llm stage.
"""
from __future__ import annotations

import copy
import functools
import math
import time
from typing import Any, Callable, ClassVar

import torch

from vlm_prune.adapters.base import Adapter
from vlm_prune.engine import LMSpec, Pending, PrunedDecoder
from vlm_prune.methods.base import Reduction, VisionContext


class HFVLMAdapter(Adapter):
    """Base of adapters for ``*ForConditionalGeneration`` VLMs with ``model.model.language_model``."""

    stages: ClassVar[tuple[str, ...]] = ("vision", "llm")
    #: names of the feature functions on the inner model, by modality
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features"}

    # ---- layout -------------------------------------------------------------------------------
    @property
    def inner(self) -> torch.nn.Module:
        return self.model.model

    @property
    def language_model(self) -> torch.nn.Module:
        return self.inner.language_model

    def placeholder_ids(self) -> dict[str, int]:
        """Token id of each modality's placeholder, e.g. {"image": 32000}."""
        cfg = self.model.config
        out = {"image": cfg.image_token_id}
        if getattr(cfg, "video_token_id", None) is not None:
            out["video"] = cfg.video_token_id
        return out

    def apply_rope(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        import importlib

        module = importlib.import_module(type(self.language_model.layers[0].self_attn).__module__)
        return module.apply_rotary_pos_emb

    def lm_spec(self) -> LMSpec:
        lm = self.language_model
        return LMSpec(lm=lm, layers=lm.layers, family=self.family, apply_rope=self.apply_rope())

    def image_grid(self, n_tokens: int, image_index: int) -> tuple[int, int] | None:
        """(rows, cols) of one image's tokens when they form a square grid."""
        side = math.isqrt(n_tokens)
        return (side, side) if side * side == n_tokens else None

    # ---- attach / detach ----------------------------------------------------------------------
    def attach(self) -> None:
        lm = self.language_model
        self.decoder = PrunedDecoder(self.lm_spec(), self.state, lambda: lm.config._attn_implementation)
        self.patches.set(lm, "forward", self.decoder.forward)
        inner_forward = self.patches.original(self.inner, "forward")

        @functools.wraps(inner_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            self.before_forward(args, kwargs)
            try:
                return inner_forward(*args, **kwargs)
            finally:
                self.decoder.pending = None
                self._request = None

        self.patches.set(self.inner, "forward", forward)
        if "vision" in self.state.methods or "frames" in self.state.methods:
            for modality, fname in self.feature_functions.items():
                self._patch_features(modality, fname)

    def _patch_features(self, modality: str, fname: str) -> None:
        original = self.patches.original(self.inner, fname)

        @functools.wraps(original)
        def features(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if self._request is not None:
                out = self.reduce_features(modality, out)
            return out

        self.patches.set(self.inner, fname, features)

    # ---- per request --------------------------------------------------------------------------
    _request: dict[str, Any] | None = None

    def before_forward(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Record the visual rows of a prefill for the engine (decode steps pass through)."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if input_ids is None or (cache is not None and cache.get_seq_length() > 0):
            self._request = None
            return
        ids = self.placeholder_ids()
        masks = {m: input_ids == t for m, t in ids.items()}
        visual = torch.zeros_like(input_ids, dtype=torch.bool)
        for m in masks.values():
            visual |= m
        attn = kwargs.get("attention_mask")
        self._request = {
            "input_ids": input_ids,
            "attention_mask": attn if attn is not None else torch.ones_like(input_ids),
            "masks": masks,
            "keep": {m: [] for m in ids},
            "sizes": {m: [] for m in ids},
            "kwargs": kwargs,
        }
        self.decoder.pending = Pending(visual=visual, images_per_sample=self.images_per_sample(masks, kwargs))
        encoded = kwargs.get("mm_encoder_outputs")
        if encoded:  # generate() encodes images before the prefill: reduce them here
            kwargs["mm_encoder_outputs"] = {
                m: (self.reduce_features(m, out) if out is not None and m in self.feature_functions else out)
                for m, out in encoded.items()
            }

    def images_per_sample(self, masks: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> list[int]:
        """How many images / videos each sample holds (budget= is per image)."""
        out = []
        for b in range(next(iter(masks.values())).shape[0]):
            runs = 0
            for m in masks.values():
                row = m[b].int()
                runs += int((row[1:] > row[:-1]).sum() + row[0])
            out.append(runs)
        return out

    def sample_of_items(self, modality: str, counts: list[int]) -> list[int]:
        """Sample index of each image / video whose features have ``counts`` tokens, in order."""
        mask = self._request["masks"][modality]
        flat_sample = torch.nonzero(mask)[:, 0]
        out, offset = [], 0
        for n in counts:
            out.append(int(flat_sample[offset]) if offset < flat_sample.numel() else 0)
            offset += n
        return out

    def text_embeds(self, sample: int) -> torch.Tensor:
        """Input embeddings of the sample's instruction: valid text tokens after its last visual token."""
        req = self._request
        ids = req["input_ids"][sample]
        valid = req["attention_mask"][sample].bool()
        visual = torch.zeros_like(valid)
        for m in req["masks"].values():
            visual |= m[sample]
        idx = torch.nonzero(visual).squeeze(1)
        after = torch.arange(ids.numel(), device=ids.device) > (idx.max() if idx.numel() else -1)
        text_ids = ids[valid & ~visual & after]
        return self.language_model.embed_tokens(text_ids)

    def reduce_features(self, modality: str, out: Any) -> Any:
        """A copy of the encoder output ``out`` with the vision method applied to every image in
        ``out.pooler_output`` (a list of [N_i, D]); dropped slots are recorded for the engine."""
        method = self.state.methods.get("vision")
        if method is None:
            return out
        feats = list(out.pooler_output)
        samples = self.sample_of_items(modality, [f.shape[0] for f in feats])
        gen = torch.Generator().manual_seed(self.state.seed)
        t0 = time.perf_counter()
        keep_list, size_list, new_feats = [], [], []
        tower_attention = self.tower_attention_fn(out, modality)
        n_in, n_out = [], []
        for i, f in enumerate(feats):
            n = f.shape[0]
            n_imgs = 1
            ctx = VisionContext(
                features=f,
                n_keep=method.n_keep(n, n_imgs),
                grid=self.image_grid(n, i),
                text_embeds=self.text_embeds(samples[i]).detach(),
                tower_attention=(lambda i=i: tower_attention(i)) if tower_attention else None,
                generator=gen,
                image_index=i,
            )
            with torch.no_grad():
                red = method.reduce_image(ctx)
            new_f, keep, sizes = scatter_reduction(f, red)
            new_feats.append(new_f)
            keep_list.append(keep)
            size_list.append(sizes)
            n_in.append(n)
            n_out.append(int(keep.sum()))
        secs = time.perf_counter() - t0
        self._commit_vision(modality, keep_list, size_list)
        self.decoder.pending.records.append(
            {"stage": "vision", "method": method.name, "modality": modality, "tokens_in": n_in, "tokens_out": n_out, "seconds": secs}
        )
        out = copy.copy(out)
        out.pooler_output = new_feats
        return out

    def _commit_vision(self, modality: str, keep_list: list, size_list: list) -> None:
        pending = self.decoder.pending
        mask = self._request["masks"][modality]
        keep = pending.keep if pending.keep is not None else torch.ones_like(mask)
        sizes = pending.sizes if pending.sizes is not None else torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
        keep = keep.clone()
        sizes = sizes.clone()
        keep[mask] = torch.cat(keep_list).to(keep.device)
        sizes[mask] = torch.cat(size_list).to(sizes.device)
        pending.keep, pending.sizes = keep, sizes

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None:
        """Side computation of the tower's feature-layer attention for one image (VisionZip)."""
        return None


def scatter_reduction(features: torch.Tensor, red: Reduction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write a Reduction back into the image's N slots: (features [N, D], keep [N], sizes [N])."""
    n = features.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=features.device)
    keep[red.indices.to(features.device)] = True
    out = features
    if red.features is not None:
        out = features.clone()
        out[red.indices] = red.features.to(features.dtype)
    sizes = torch.ones(n, dtype=torch.float32, device=features.device)
    if red.sizes is not None:
        sizes[red.indices] = red.sizes.float().to(features.device)
    return out, keep, sizes
