"""Qwen3-VL and Qwen3-VL-MoE: Qwen2-VL's layout (M-RoPE, rope_deltas, 2 x 2 merged patches) plus
DeepStack and text-timestamp video.

DeepStack (transformers ``Qwen3VLTextModel``): the tower's ``deepstack_features`` - one [N, D] map per
chosen tower block - are added to the visual rows' hidden states after decoder layers 0, 1, 2, ...
The pruned decoder takes them as :attr:`vlm_prune.engine.Rows.inject`, so:

- a token dropped by the vision, frames or llm stage leaves every DeepStack layer with its row;
- a token whose features a vision method rewrites (pool's averages) gets its DeepStack features
  rewritten the same way: the method is replayed on each DeepStack map with the same generator (in a
  frames + vision pipeline, on the frames the frames stage kept) and must choose the same slots (a method whose choice depends on the values and that also rewrites
  features is refused at run time with that reason); a vision-stage merge (``merged_into``) averages
  its members' DeepStack rows;
- an llm-stage merge (PACT before a DeepStack layer) averages the members' additions with the
  weights it averaged their hidden states with (their sizes), so merging and adding commute.

Video: the processor writes ``<t seconds>`` text and vision start / end tokens around every temporal
slice, so a video's placeholders form one run per slice; each slice's M-RoPE positions start after
the text before it. Frames methods that keep whole slices (uniform, KeyScore) keep every kept
token at its own slot and position; the dropped slices' timestamp text stays in the prompt (it was
written before pruning: choose frames first with ``vlm_prune.select_frames`` when that matters).
QuoTA is refused (``QuoTA.refusal``): it packs resized frames into the video's first slots, which on
Qwen3-VL lie behind other slices' timestamps.

MoE language models (Qwen3-VL-MoE) route every token on its own (no capacity limit in
transformers), so removing rows changes no other row's experts.

Read side by side with transformers 5.25 ``models/qwen3_vl/modeling_qwen3_vl.py``
(``Qwen3VLTextModel.forward`` / ``_deepstack_process``, ``Qwen3VLModel.get_rope_index``) and
``processing_qwen3_vl.py`` (the per-slice timestamp layout).
"""
from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.hf_vlm import Item
from vlm_prune.adapters.qwen2_vl import Qwen2VLAdapter
from vlm_prune.engine import LMSpec
from vlm_prune.methods.base import Reduction


def deepstack_injections(kwargs: dict[str, Any], embeds: torch.Tensor) -> torch.Tensor | None:
    """Pop Qwen3-VL's ``visual_pos_masks`` [B, S] and ``deepstack_visual_embeds`` (per layer
    [N_visual, D], rows in mask order) from a language-model call: [n, B, S, D], zero off the mask."""
    mask = kwargs.pop("visual_pos_masks", None)
    feats = kwargs.pop("deepstack_visual_embeds", None)
    if mask is None or not feats:
        return None
    mask = mask.to(embeds.device)
    stacked = torch.stack([f.to(embeds.device) for f in feats])
    out = stacked.new_zeros(len(feats), *mask.shape, stacked.shape[-1])
    out[:, mask] = stacked
    return out


class Qwen3VLAdapter(Qwen2VLAdapter):
    family = "qwen3_vl"
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]
    model_classes = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
    def lm_spec(self) -> LMSpec:
        spec = super().lm_spec()
        spec.take_injections = deepstack_injections
        return spec

    def reduce_features(self, modality: str, out: Any) -> Any:
        """The encoder output reduced as Qwen2-VL's, with its DeepStack maps following every item's
        reduction (see the module docstring)."""
        new = super().reduce_features(modality, out)
        stacks = getattr(out, "deepstack_features", None)
        if new is out or not stacks:
            return new
        items = self.items(modality, out)
        reds = self.request.reductions[modality]
        samples = self.sample_of_items(modality, [it.features.shape[0] for it in items])
        new = copy.copy(new)
        new.deepstack_features = [
            type(layer)(self._follow(modality, Item(f, it.frames, it.grid, it.tail), red, samples, i)
                        for i, (f, it, red) in enumerate(zip(layer, items, reds)))
            for layer in stacks
        ]
        return new

    @property
    def _frames_plans(self) -> dict[int, Any]:
        """The calling request's frames plans per video item (a frames + vision pipeline replays the
        vision stage on them)."""
        request = self.request
        if not hasattr(request, "vlm_prune_frames_plans"):
            request.vlm_prune_frames_plans = {}
        return request.vlm_prune_frames_plans

    def vision_after_frames(self, method: Any, it: Item, plan: Any, sample: int, gen: torch.Generator,
                            index: int) -> tuple[Any, list[int]]:
        self._frames_plans[index] = plan  # the frames stage's plan, before the vision stage composes it
        return super().vision_after_frames(method, it, plan, sample, gen, index)

    def _follow(self, modality: str, side: Item, red: Reduction, samples: list[int], index: int) -> torch.Tensor:
        """One item's DeepStack map [N, D] after the reduction ``red`` of its main features."""
        if red.features is None:
            return side.features  # only kept / dropped: the engine drops the rows
        feats = side.features
        if red.merged_into is not None:
            into = red.merged_into.to(feats.device)
            members = torch.nonzero(into >= 0).squeeze(1)
            total = torch.zeros_like(feats, dtype=torch.float32).index_add_(0, into[members], feats[members].float())
            count = torch.zeros(feats.shape[0], device=feats.device).index_add_(
                0, into[members], torch.ones(members.numel(), device=feats.device))
            merged = (total[red.indices] / count[red.indices, None]).to(feats.dtype)
        else:
            method = self.state.methods.get("vision")
            plan = self._frames_plans.get(index) if modality == "video" and "frames" in self.state.methods else None
            replay = None
            if method is not None and (plan is not None or modality != "video" or "frames" not in self.state.methods):
                gen = self.item_generator(samples, index)
                with torch.no_grad():
                    if plan is None:
                        replay = self.reduce_frames(method, side, samples[index], gen, index)
                    else:  # a frames + vision pipeline: the vision stage again on the frames the frames stage kept
                        replay = super().vision_after_frames(method, side, plan, samples[index], gen, index)[0].reduction
            if replay is None or not torch.equal(replay.indices.cpu(), red.indices.cpu()) or replay.features is None:
                name = (self.state.methods.get("frames") if method is None else method).name
                raise ValueError(
                    f"{name!r} rewrote visual features in a way vlm_prune cannot repeat on Qwen3-VL's DeepStack "
                    "features (replayed on them it chose other tokens), so the rewritten tokens would get DeepStack "
                    "features of other tokens. Use a method that only keeps / drops tokens (random, divprune, "
                    "cdpruner, uniform, keyscore) or pool"
                )
            merged = replay.features.to(feats.dtype)
        feats = feats.clone()
        feats[red.indices.to(feats.device)] = merged
        return feats
