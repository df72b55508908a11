"""ViT-stage methods (AS-ViT, ToMe) inside the CLIP vision tower of a VLM (LLaVA-1.5, LLaVA-NeXT).

The encoder layers up to the feature layer (``vision_feature_layer``: -2 for LLaVA-1.5, so 23
of 24 layers) get, on this instance only, the method's ``block_forward`` in place of their
``forward``; :class:`CLIPLayerOps` exposes a CLIP encoder layer's sub-computations to it
(see vlm_prune.vit_blocks.BlockOps). Every image of a tower batch keeps the same number of
tokens, so the tower output stays dense: the feature layer returns 1 + k tokens per image
(CLS first), the model's own code drops CLS and projects them to [k, D], and
:meth:`CLIPTowerStage.reductions` turns those rows into one vision-stage ``Reduction`` per
image: ``indices`` = the original patch index (slot) of each surviving token, ``features``
= its projected row, ``sizes`` = how many patches it stands for (ToMe). The engine then
drops the other placeholders before decoder layer 0, keeping original position ids, and
adds log(size) to attention logits for merged tokens.

Layers after the feature layer run unchanged on the surviving tokens (their output is not
read by the VLM). The slots travel with the tower output as its ``vlm_prune_vit`` attribute,
because ``generate()`` encodes the images before the forward that reduces them. LLaVA-NeXT
(one tower row per anyres tile) scatters each tile's survivors back to its grid before the
model packs the tiles, see vlm_prune.adapters.llava_next.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from vlm_prune.adapters.base import PerThread
from vlm_prune.adapters.hf_vlm import HFVLMAdapter, source_of
from vlm_prune.adapters.patching import Patcher
from vlm_prune.adapters.vision_towers import cls_row_attention
from vlm_prune.methods.base import Reduction
from vlm_prune.vit_blocks import AttentionResult, ViTMethod, ViTRun, weighted_softmax


class CLIPLayerOps:
    """The sub-computations of one CLIP encoder layer (see vlm_prune.vit_blocks.BlockOps).

    :meth:`attention` repeats ``CLIPAttention.forward`` step by step through the model's own
    attention function (SDPA / eager), so it is bit-identical to the layer when given no bias.
    An additive ``bias`` runs under SDPA or eager; under other kernels (FlashAttention) the
    layer's eager function is used for that call.
    """

    def __init__(self, layer: torch.nn.Module, index: int, depth: int, forward: Callable[..., torch.Tensor],
                 kwargs: dict[str, Any], following: torch.nn.Module | None = None) -> None:
        attn = layer.self_attn
        self.layer = layer
        #: the encoder layer after this one (None after the tower's last)
        self.following = following
        self.index = index
        self.depth = depth
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scale
        self.dim = attn.embed_dim
        self.mlp_hidden = layer.mlp.fc1.out_features
        self._forward = forward
        self._kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def attention(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, key_weights: torch.Tensor | None = None
    ) -> AttentionResult:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = self.layer.self_attn
        h = self.layer.layer_norm1(x)
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        probs = None
        if key_weights is not None:
            logits = (q @ k.transpose(-1, -2)) * self.scale
            if bias is not None:
                logits = logits + bias
            probs = weighted_softmax(logits, key_weights)
            out = (probs @ v).transpose(1, 2)
        else:
            eager = importlib.import_module(type(attn).__module__).eager_attention_forward
            impl = attn.config._attn_implementation
            fn = eager if bias is not None and impl not in ("eager", "sdpa") else ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
            out, _ = fn(attn, q, k, v, bias, scaling=self.scale, dropout=attn.dropout if attn.training else 0.0, **self._kwargs)
        update = attn.out_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        return AttentionResult(update, q, k, v, out.transpose(1, 2), probs)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.mlp(self.layer.layer_norm2(x))

    def cls_attention(self, x: torch.Tensor, bias: torch.Tensor | None = None, following: bool = False
                      ) -> torch.Tensor | None:
        """[B, N - 1] float32: the attention the [CLS] token (row 0) pays each other token of x [B, N, D]
        in this layer (``following``: in the layer after it, None when there is none), averaged over
        heads, computed on the side; ``bias`` [B, N] is added to the logits (-inf: padded keys)."""
        layer = self.following if following else self.layer
        if layer is None:
            return None
        with torch.no_grad():
            probs, _ = cls_row_attention(layer, x, bias)
        return probs[:, :, 1:].mean(1)


class CLIPTowerStage:
    """Runs a ViT-stage method inside a CLIP vision tower (with a CLS token) of a VLM.

    ``feature_layer`` is the model's ``vision_feature_layer`` (an index into the tower's hidden
    states); ``drop_cls`` is True for the 'default' select strategy (the features leave CLS
    out). ``active()`` False runs the tower unpruned (the adapter's bypass). Raises ValueError
    at construction for towers or settings it cannot handle.
    """

    #: the run of the calling thread's tower forward in progress
    run: ViTRun | None = PerThread()
    #: the run of the calling thread's latest tower forward (None when it ran unpruned), for code
    #: between the tower and the model's use of its output (LLaVA-NeXT's tile packing)
    finished: ViTRun | None = PerThread()
    #: patch tokens each tower row of the calling thread's next tower forward ends with (set by an
    #: adapter whose rows are parts of images, LLaVA-NeXT's tiles); None: the method's own target
    row_target: int | None = PerThread()

    def __init__(self, tower: torch.nn.Module, method: ViTMethod, feature_layer: Any, select_strategy: str,
                 patches: Patcher, active: Callable[[], bool]) -> None:
        body = getattr(tower, "vision_model", tower)
        name = type(tower).__name__
        if getattr(getattr(body, "embeddings", None), "class_embedding", None) is None:
            raise ValueError(
                f"method {method.name!r} runs inside the vision tower and needs its CLS token; this "
                f"{name} has none. Use a vision-stage method (e.g. 'divprune') instead"
            )
        if not isinstance(feature_layer, int):
            raise ValueError(
                f"method {method.name!r} prunes inside the vision tower and follows one feature layer; "
                f"this model concatenates layers {feature_layer}. Use a vision-stage method instead"
            )
        if select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {select_strategy!r}; expected 'default' or 'full'")
        self.layers = body.encoder.layers
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None)
            if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "out_proj", "scale")) or not all(
                hasattr(layer, a) for a in ("layer_norm1", "layer_norm2", "mlp")
            ):
                raise ValueError(
                    f"layer {i} of this {name} is a {type(layer).__name__}; vlm_prune runs ViT-stage methods "
                    "in CLIP encoder layers (self_attn with q/k/v/out_proj, layer_norm1/2, mlp) only"
                )
        #: layers whose output reaches the feature layer (hidden_states[i] is the output of layer i - 1)
        self.depth = feature_layer % (len(self.layers) + 1)
        if self.depth == 0:
            raise ValueError(f"vision_feature_layer {feature_layer} reads the tower's embeddings; no layer to prune in")
        self.tower = tower
        self.method = method
        self.drop_cls = select_strategy == "default"
        self.patches = patches
        self.active = active

    def attach(self) -> None:
        for i, layer in enumerate(self.layers[: self.depth]):
            self.patches.set(layer, "forward", self._layer_forward(i, layer))
        tower_forward = self.patches.original(self.tower, "forward")

        @functools.wraps(tower_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            self.run = self.finished = None
            out = tower_forward(*args, **kwargs)
            out.vlm_prune_vit = self.finished = self.run  # None when the tower ran unpruned
            self.run = None
            return out

        self.patches.set(self.tower, "forward", forward)

    def _layer_forward(self, index: int, layer: torch.nn.Module) -> Callable[..., torch.Tensor]:
        original = self.patches.original(layer, "forward")

        @functools.wraps(original)
        def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
            if not self.active():
                return original(hidden_states, attention_mask, **kwargs)
            if attention_mask is not None:
                raise ValueError(
                    f"vlm_prune's {self.method.name!r} changes the token count inside the vision tower and "
                    "cannot apply an attention mask there; unwrap the model to run the tower with a mask"
                )
            if index == 0 or self.run is None:
                self.run = ViTRun(n_prefix=1, n_tokens=hidden_states.shape[1], target=self.row_target)
            following = self.layers[index + 1] if index + 1 < len(self.layers) else None
            ops = CLIPLayerOps(layer, index, self.depth, functools.partial(original, attention_mask=None, **kwargs), kwargs,
                               following)
            return self.method.block_forward(ops, hidden_states, self.run)

        return forward

    def run_of(self, out: Any) -> ViTRun:
        """The pruned run that produced a tower (or feature function) output."""
        run: ViTRun | None = getattr(out, "vlm_prune_vit", None)
        if run is None:
            raise RuntimeError(
                f"these image features did not come through the tower wrapped for {self.method.name!r} "
                "(encoded before wrap(), or with pruning bypassed); pass pixel_values to the wrapped model"
            )
        return run

    def n_features(self, run: ViTRun) -> int:
        """Feature tokens per tower row before pruning (patches, plus CLS with the 'full' strategy)."""
        return run.n_tokens - (1 if self.drop_cls else 0)

    def survivors(self, run: ViTRun, rows: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(slots [rows, k], sizes [rows, k] or None): where each surviving feature token of every
        tower row sits among the row's :meth:`n_features` unpruned feature tokens, and how many
        patches it stands for (ToMe)."""
        skip = 1 if self.drop_cls else 0
        slots = run.token_slots(rows, device)[:, skip:].to(device) - skip
        sizes = run.sizes[:, skip:].to(device) if run.sizes is not None else None
        return slots, sizes

    def real_rows(self, run: ViTRun, rows: int, device: torch.device | str) -> torch.Tensor:
        """[rows, k] bool: the feature tokens of every tower row that are not padding (rows of one
        batch that ended with different token counts, MustDrop's merge, are padded to the longest)."""
        skip = 1 if self.drop_cls else 0
        if run.pad is None:
            return torch.ones(rows, run.token_slots(rows, device).shape[1] - skip, dtype=torch.bool, device=device)
        return run.pad[:, skip:].to(device)

    def protected(self, out: Any) -> list[torch.Tensor] | None:
        """Per image of an encoder output, [n_features] long over its placeholders: the rank of the token
        at each slot among those the llm stage must keep (:attr:`ViTRun.protected`), -1 elsewhere; None
        when the method protects nothing."""
        run = self.run_of(out)
        if run.protected is None:
            return None
        images = out.last_hidden_state.shape[0]
        device = run.protected.device
        skip = 1 if self.drop_cls else 0
        slots, _ = self.survivors(run, images, device)
        real = self.real_rows(run, images, device)
        ranks = run.protected[:, skip:]
        tables = []
        for j in (source_of(out, i) for i in range(len(out.pooler_output))):
            table = torch.full((self.n_features(run),), -1, dtype=torch.long, device=device)
            table[slots[j][real[j]]] = ranks[j][real[j]]
            tables.append(table)
        return tables

    def merged_into(self, run: ViTRun, rows: int, device: torch.device | str) -> torch.Tensor | None:
        """[rows, n_features]: for each feature token of every tower row, the slot (as in
        :meth:`survivors`) of the surviving token it was merged into (ToMe); None without merges."""
        if run.members is None:
            return None
        skip = 1 if self.drop_cls else 0
        current = run.members[:, skip:].to(device)
        return run.token_slots(rows, device).to(device).gather(1, current) - skip

    def record(self, run: ViTRun, tokens_in: list[int], tokens_out: list[int]) -> dict[str, Any]:
        """The stats record of the stage (tokens per image before / after)."""
        summary = run.summary()
        return {
            "stage": "vit", "method": self.method.name, "modality": "image",
            "tokens_in": tokens_in, "tokens_out": tokens_out,
            "tokens_per_layer": summary["tokens_per_block"], "flops_ratio": summary["flops_ratio"],
        }

    def reductions(self, out: Any) -> tuple[list[Reduction], dict[str, Any]]:
        """One Reduction per image of an encoder output (``pooler_output``: [k, D] per image, one
        tower row each) over the image's placeholders, and the stats record of the stage."""
        run = self.run_of(out)
        feats = out.pooler_output
        images = out.last_hidden_state.shape[0]
        slots, sizes = self.survivors(run, images, feats[0].device)
        src = [source_of(out, i) for i in range(len(feats))]  # the tower row of each (repeated) image
        real = self.real_rows(run, images, feats[0].device)
        reds = [Reduction(slots[j][real[j]], f[real[j]], sizes[j][real[j]] if sizes is not None else None)
                for j, f in zip(src, feats)]
        n = self.n_features(run)
        record = self.record(run, [n] * len(feats), [int(r.indices.numel()) for r in reds])
        merged = self.merged_into(run, images, feats[0].device)
        if merged is not None:
            record["merged_into"] = [merged[j].tolist() for j in src]
        return reds, record


class CLIPTowerAdapter(HFVLMAdapter):
    """Base of the LLaVA adapters whose CLIP tower hosts a ViT-stage method (AS-ViT, ToMe).

    Builds the :class:`CLIPTowerStage` at wrap time (so methods can check the tower's depth)
    and attaches it; subclasses hand its survivors to the engine in ``reduce_features``.
    """

    tower_stage: CLIPTowerStage | None = None

    def __init__(self, model: torch.nn.Module, state: Any) -> None:
        super().__init__(model, state)
        if "vit" in state.methods:
            cfg = model.config
            self.tower_stage = CLIPTowerStage(
                model.model.vision_tower, state.methods["vit"], cfg.vision_feature_layer,
                cfg.vision_feature_select_strategy, self.patches, active=lambda: not self.bypassed,
            )
            #: tower layers the ViT-stage method spans (up to the feature layer)
            self.depth = self.tower_stage.depth

    def vit_tokens(self) -> tuple[int, int]:
        """(prefix tokens, patch tokens) entering the tower's first layer for one image / tile."""
        vcfg = self.model.config.vision_config
        return 1, (vcfg.image_size // vcfg.patch_size) ** 2

    def attach(self) -> None:
        super().attach()
        if self.tower_stage is not None:
            self.tower_stage.attach()
            self.attach_tower_outputs()

    def attach_tower_outputs(self) -> None:
        """Hook for patches between the tower and the feature function (LLaVA-NeXT's tile packing)."""
