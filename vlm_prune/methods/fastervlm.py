"""FasterVLM: keep the visual tokens the vision tower's [CLS] token attends to most."""
from __future__ import annotations

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.visionzip import tower_view
from vlm_prune.registry import register


@register
class FasterVLM(ShorterSequence, VisionMethod):
    """FasterVLM (Zhang et al., "[CLS] Attention is All You Need for Training-Free Visual Token
    Pruning: Make VLM Inference Faster", arXiv 2412.01818v1; Theia-4869/FasterVLM at f5d5f120,
    llava/model/llava_arch.py ``encode_images`` and multimodal_encoder/clip_encoder.py).

    Per image: the attention the [CLS] token pays each patch in the tower's feature layer (the
    layer whose output the projector reads, LLaVA's -2), averaged over heads, computed on the side
    from the tapped layer input; keep the top ``n_keep`` patches, in their original order, before
    the projector's output reaches the LLM. Towers without CLS (SigLIP in LLaVA-OneVision video)
    rank by the mean attention each token receives instead, pooled to the frame grid (as VisionZip).
    ``positions``: "renumber" (default, the official code: the kept tokens are concatenated between
    the text pieces and the shorter sequence is numbered 0..n-1; decode continues from that count)
    or "keep" (original position ids, gaps stay).
    Budget: the official code takes the kept count (``visual_token_num``) as a required argument and
    has no default; so keep / budget are required here (the README's headline setting, 90% pruned,
    is ``keep=0.1``).
    """

    name = "fastervlm"
    supported = ("llava", "llava_onevision")  # adapters that tap the tower feature layer (OneVision: video frames)
    needs_tower_attention = True
    paper = "FasterVLM, Zhang et al., arXiv 2412.01818v1 (Theia-4869/FasterVLM)"
    summary = "keeps the tokens the vision tower's [CLS] token attends to most, before the LLM"

    def __init__(self, positions: str | None = None, keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        check_positions("FasterVLM", positions)
        self.positions = positions

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        attention, _, _ = tower_view(ctx, "fastervlm", "FasterVLM")
        return Reduction.top_k(attention, ctx.n_keep)
