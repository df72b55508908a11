"""AS-ViT: adaptive sparse ViT token pruning (Liu et al., IJCAI 2023, arXiv 2209.13802;
Cydia2018/AS-ViT).

The scoring functions are pure (tensors in, scores out) so any ViT adapter can reuse them:

    A_h = softmax(Q_h K_h^T * scale)      O_h = A_h V_h
    w_h,j = ||O_h,j|| / sum_h' ||O_h',j||  (how much head h contributes to token j)
    s_j = sum_h A_h[cls, j] * w_h,j

Only the CLS query row of A is needed; it is computed on the side from the block's own q
and k (O(H N d)), while the block itself keeps timm's fused attention, whose per-head output
O (before the projection) gives the norms for free. The extra cost per scoring block is one
[H, N] logit row, its softmax and the [H, N] norms of O - under 1% of the block for N >= 64.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vlm_prune.methods.base import validate_budget
from vlm_prune.registry import register
from vlm_prune.vit_blocks import AttentionResult, BlockOps, ViTMethod, ViTRun, gather_tokens

#: the paper's initial thresholds for DeiT (196 patch tokens)
PAPER_THRESHOLDS = (0.001, 0.002, 0.003)
PAPER_PATCHES = 196


def cls_attention(q_cls: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of the CLS query over all keys, per head.

    q_cls: [B, H, d] the CLS row of the (unscaled) queries; k: [B, H, N, d]. Returns
    [B, H, N] float32.
    """
    logits = torch.einsum("bhd,bhnd->bhn", q_cls.float(), k.float()) * scale
    return logits.softmax(dim=-1)


def head_weights(heads: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """w_h,j = ||O_h,j|| / sum_h' ||O_h',j|| from per-head outputs O [B, H, N, d]; [B, H, N]."""
    norms = heads.float().norm(dim=-1)
    return norms / (norms.sum(dim=1, keepdim=True) + eps)


def asvit_scores(cls_attn: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """s_j = sum_h A_h[cls, j] w_h,j; cls_attn [B, H, N], heads [B, H, N, d] -> [B, N]."""
    return (cls_attn * head_weights(heads)).sum(dim=1)


def straight_through_mask(scores: torch.Tensor, theta: torch.Tensor, tau: float) -> torch.Tensor:
    """1[sigmoid((s - theta) / tau) > 0.5] forward, gradient of the sigmoid backward."""
    soft = torch.sigmoid((scores - theta) / tau)
    return (soft > 0.5).to(soft.dtype) - soft.detach() + soft


def default_locations(depth: int) -> list[int]:
    """0-indexed blocks before which AS-ViT prunes: floor(depth * f) for f = 1/3, 7/12, 5/6.

    This reproduces every schedule of the official code (Cydia2018/AS-ViT@e57f445, main.py /
    infer.py): DeiT-T/S (12 blocks) [4, 7, 10], LV-ViT-S (16) [5, 9, 13], LV-ViT-M (20)
    [6, 11, 16]. Each pruning point is scored by the block just before it. Shallow towers
    (fewer than 6 blocks) get the distinct points of that rule within [1, depth - 1].
    """
    if depth < 2:
        raise ValueError(
            f"AS-ViT needs a ViT with at least 2 blocks (in a VLM: tower layers up to the feature layer), "
            f"this one has {depth}"
        )
    marks = [depth * f // 12 for f in (4, 7, 10)]
    return sorted({min(max(m, 1), depth - 1) for m in marks})


@register
class ASViT(ViTMethod):
    """AS-ViT (Liu et al., IJCAI 2023, "Adaptive Sparse ViT", arXiv 2209.13802;
    Cydia2018/AS-ViT@e57f445): prune patch tokens at three points of a ViT by the head-weighted
    CLS attention score (see the module docstring), computed in the block just before each point.

    Modes:
      - ``mode="keep"`` (training-free, default): top-k of the scores. ``keep`` / ``budget`` is
        the number of patch tokens left after the LAST stage (the tokens that reach the tower's
        output; per image), the same meaning as for every other method. The per-stage counts
        follow the official geometric schedule (DynamicViT convention: stage s of S keeps
        N * rho**s) with rho = (target / N) ** (1 / S), so stage s keeps
        floor(N * (target / N) ** (s / S)) and the last stage exactly the target.
      - ``mode="threshold"``: stage s keeps the tokens with s_j > theta_s, as the official
        inference code. Thresholds are given (``thresholds=``) or learned by :func:`calibrate`
        (budget-aware); the default is the paper's initial (0.001, 0.002, 0.003) for 196
        patches, scaled by 196 / N because scores average 1/N. With a batch of B > 1 images,
        each image keeps its top k = floor(total kept / B) tokens (as the official code does),
        so the batch stays rectangular; B = 1 keeps exactly the tokens above the threshold.
        With explicit thresholds the kept sets equal the official code's
        (tests/test_fidelity_vision.py); the official code orders the kept tokens by score
        where this one keeps them in patch order, which a ViT without positional state after
        the embedding does not see (logits equal to float rounding).

    ``locations``: 0-indexed blocks before which to prune; default :func:`default_locations`
    ([4, 7, 10] for 12 blocks, the official ``pruning_loc``). The CLS and other prefix tokens
    are never pruned.
    """

    name = "asvit"
    paper = "AS-ViT, Liu et al., IJCAI 2023 (arXiv 2209.13802)"
    own_schedule = True

    def __init__(
        self,
        keep: float | None = None,
        budget: int | None = None,
        mode: str = "keep",
        thresholds: Iterable[float] | None = None,
        locations: Iterable[int] | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if mode not in ("keep", "threshold"):
            raise ValueError(f"AS-ViT mode must be 'keep' (top-k) or 'threshold' (learned), got {mode!r}")
        self.mode = mode
        self.thresholds = tuple(float(t) for t in thresholds) if thresholds is not None else None
        self.locations = tuple(int(i) for i in locations) if locations is not None else None
        self._theta: torch.Tensor | None = None  # trainable thresholds while calibrating
        self._calibrating = False
        self.tau = 1e-4

    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        keep = self.keep if self.keep is not None else keep
        budget = self.budget if self.budget is not None else budget
        if self.mode == "threshold" and (keep is not None or budget is not None):
            raise ValueError(
                "AS-ViT threshold mode sets its budget through learned thresholds; drop keep/budget and "
                "run vlm_prune.methods.asvit.calibrate(model, loader, target=...) instead"
            )
        self.keep, self.budget = validate_budget(keep, budget, required=self.mode == "keep", method=self.name)

    def check_model(self, adapter: Any) -> None:
        super().check_model(adapter)
        locs = self.prune_locations(adapter.depth)
        if self.thresholds is not None and len(self.thresholds) != len(locs):
            raise ValueError(f"AS-ViT got {len(self.thresholds)} thresholds for {len(locs)} pruning locations {locs}")

    def prune_locations(self, depth: int) -> list[int]:
        if self.locations is None:
            return default_locations(depth)
        locs = list(self.locations)
        if not locs or locs != sorted(set(locs)) or locs[0] < 1 or locs[-1] > depth - 1:
            raise ValueError(
                f"AS-ViT locations must be increasing block indices in [1, {depth - 1}] "
                f"(pruning happens before them, scored by the block before), got {locs}"
            )
        return locs

    # ---- budgets ---------------------------------------------------------------------------
    def stage_keep(self, stage: int, n_stages: int, n_patches: int, target: int | None = None) -> int:
        """Patch tokens kept after stage ``stage`` (1-based) in keep mode: the geometric schedule
        ending at ``target`` (default :meth:`n_keep` of the ``n_patches`` patch tokens; see the
        class docstring)."""
        target = self.n_keep(n_patches, 1) if target is None else target
        if stage >= n_stages:
            return target
        frac = (target / n_patches) ** (stage / n_stages)
        return max(target, min(n_patches, math.floor(n_patches * frac + 1e-6)))

    def threshold_values(self, n_patches: int, n_stages: int) -> torch.Tensor:
        if self._theta is not None:
            return self._theta
        if self.thresholds is not None:
            return torch.tensor(self.thresholds)
        init = [t * PAPER_PATCHES / n_patches for t in PAPER_THRESHOLDS]
        return torch.tensor((init + [init[-1]] * n_stages)[:n_stages])

    # ---- the block -------------------------------------------------------------------------
    def run_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        locs = self.prune_locations(ops.depth)
        stage = locs.index(ops.index + 1) + 1 if ops.index + 1 in locs else 0
        if self._calibrating:
            return self._calibration_block(ops, x, run, stage, len(locs))
        if stage == 0:
            return ops.forward(x)
        p = run.n_prefix
        n_cur = x.shape[1] - p
        if self.mode == "keep":
            k = min(n_cur, self.stage_keep(stage, len(locs), run.n_patches, self.patch_target(run)))
            if k >= n_cur:
                return ops.forward(x)
        a = ops.attention(x)
        x = x + a.out
        x = x + ops.mlp(x)
        scores = self.token_scores(a, ops.scale)[:, p:]
        if self.mode == "threshold":
            theta = self.threshold_values(run.n_patches, len(locs))[stage - 1].to(scores)
            k = int((scores > theta).sum()) // scores.shape[0]
        idx = top_indices(scores, k)
        run.slots = keep_rows(run.token_slots(x.shape[0], x.device), idx, p)
        return keep_rows(x, idx, p)

    def token_scores(self, a: AttentionResult, scale: float) -> torch.Tensor:
        """[B, N] AS-ViT scores of all tokens from a block's attention (prefix included)."""
        return asvit_scores(cls_attention(a.q[:, :, 0], a.k, scale), a.heads)

    def _calibration_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun, stage: int, n_stages: int) -> torch.Tensor:
        """Full-length tokens, dropped ones masked as keys (differentiable in the thresholds)."""
        if stage == 0 and run.policy is None:
            return ops.forward(x)
        policy = run.policy if run.policy is not None else x.new_ones(x.shape[:2])
        a = ops.attention(x, key_weights=policy)
        x = x + a.out
        x = x + ops.mlp(x)
        if stage:
            p = run.n_prefix
            scores = asvit_scores(a.probs[:, :, 0].float(), a.heads)[:, p:]
            theta = self.threshold_values(run.n_patches, n_stages)[stage - 1]
            mask = straight_through_mask(scores, theta, self.tau) * policy[:, p:]
            run.policy = torch.cat([policy[:, :p], mask.to(policy.dtype)], dim=1)
        return x


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] ascending indices of each row's k highest scores (scores [B, N])."""
    return torch.topk(scores, k, dim=1, sorted=False).indices.sort(dim=1).values


def keep_rows(x: torch.Tensor, idx: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """x [B, P + N, ...] with its P prefix rows and the rows ``idx`` [B, k] of the N others."""
    return torch.cat([x[:, :n_prefix], gather_tokens(x[:, n_prefix:], idx)], dim=1)


def keep_top(x: torch.Tensor, scores: torch.Tensor, k: int, n_prefix: int) -> torch.Tensor:
    """x [B, P + N, D] with its P prefix tokens and each image's k best-scoring of the N
    others (scores [B, N]), in their original order."""
    return keep_rows(x, top_indices(scores, k), n_prefix)


@contextmanager
def _pruning_off(method: ViTMethod) -> Iterator[None]:
    method._active = False
    try:
        yield
    finally:
        method._active = True


def calibrate(
    model: torch.nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    target: float = 0.7,
    steps: int = 100,
    train_model: bool = False,
    lr: float | None = None,
    model_lr: float = 1e-5,
    tau: float = 1e-4,
    ratio_weight: float = 2.0,
    distill_weight: float = 0.5,
    progress: bool = True,
) -> list[float]:
    """Learn AS-ViT's thresholds for a FLOPs budget (the paper's budget-aware training).

    ``model`` must be wrapped with ``ASViT(mode="threshold")``. Each step runs the pruned
    model with the straight-through mask 1[sigmoid((s - theta) / tau) > 0.5] (dropped tokens
    masked as keys, so the step is differentiable in theta) and minimises
    CE + ratio_weight * |FLOPs / FLOPs_full - target| + distill_weight * KL(unpruned || pruned).
    Only the thresholds train (Adam, ``lr``, default 0.02 / N patches per step), unless
    ``train_model`` (then the whole model too, at ``model_lr``, distilled from a frozen copy).
    ``loader`` yields (images, labels); it is cycled for ``steps`` steps. Returns the learned
    thresholds, which are also set on the wrapped model's method (``model.vlm_prune.methods["vit"]``;
    the object given to wrap() is a configuration and stays as it was). Defaults: the paper's tau 1e-4, weights 2
    and 0.5, target (rho) 0.7. With tau 1e-4 only tokens scoring within about 1e-3 of a
    threshold pass gradient, so a threshold far outside the scores of its stage does not move.

    The budget term is the official one divided by the unpruned FLOPs: the official loss
    (Cydia2018/AS-ViT@e57f445, losses.py ``DistillDiffPruningFLOPsLoss``) uses
    |mean GFLOPs - rho * GFLOPs_full| in absolute GFLOPs, of the whole model (patch embedding
    included); here |FLOPs / FLOPs_full - rho| over the transformer blocks, a scale-free
    version. At the same ``ratio_weight`` the official term's gradient is FLOPs_full times
    larger (about 4.6 for DeiT-S, 1.3 for DeiT-T), so to mimic the official training on those
    models multiply ``ratio_weight`` by their GFLOPs; on other models (a VLM's tower) the
    ratio keeps the weight meaningful without knowing the model's size.
    """
    import copy

    import vlm_prune

    state = getattr(model, "vlm_prune", None)
    method = state.methods.get("vit") if state is not None else None
    if not isinstance(method, ASViT) or method.mode != "threshold":
        raise ValueError(
            "calibrate() needs a model wrapped with AS-ViT in threshold mode: "
            "vlm_prune.wrap(model, vlm_prune.methods.ASViT(mode='threshold'))"
        )
    if not 0 < target <= 1:
        raise ValueError(f"target is the FLOPs ratio to reach, in (0, 1], got {target!r}")
    teacher = None
    if train_model:
        vlm_prune.unwrap(model)
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
        vlm_prune.wrap(model, method)
        method = model.vlm_prune.methods["vit"]  # wrap() attaches its own copy
    was_training = model.training
    grads = [p.requires_grad for p in model.parameters()]
    model.train(train_model)
    model.requires_grad_(train_model)
    batches = _cycle(loader)
    images, labels = next(batches)
    with torch.no_grad(), _pruning_off(method):
        model(images)
    n_patches, n_stages = method.last_run.n_patches, len(method.prune_locations(len(model.blocks)))
    device = next(model.parameters()).device
    theta = torch.nn.Parameter(method.threshold_values(n_patches, n_stages).clone().float().to(device))
    groups = [{"params": [theta], "lr": lr if lr is not None else 0.02 / n_patches}]
    if train_model:
        groups.append({"params": [p for p in model.parameters()], "lr": model_lr})
    opt = torch.optim.Adam(groups)
    method._theta, method._calibrating, method.tau = theta, True, tau
    try:
        bar = tqdm(range(steps), desc=f"AS-ViT calibrate (target {target:.2f})", disable=not progress)
        for step in bar:
            if step:
                images, labels = next(batches)
            with torch.no_grad():
                if teacher is not None:
                    t_logits = teacher(images)
                else:
                    with _pruning_off(method):
                        t_logits = model(images)
            logits = model(images)
            ratio = method.last_run.flops_ratio().mean()
            kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), reduction="batchmean", log_target=True)
            loss = F.cross_entropy(logits, labels) + ratio_weight * (ratio - target).abs() + distill_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(flops=f"{ratio.item():.3f}", loss=f"{loss.item():.3f}")
    finally:
        method._theta, method._calibrating = None, False
        method.thresholds = tuple(float(t) for t in theta.detach().cpu())
        model.train(was_training)
        for p, g in zip(model.parameters(), grads):
            p.requires_grad_(g)
    return list(method.thresholds)


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("calibrate() got an empty loader")
