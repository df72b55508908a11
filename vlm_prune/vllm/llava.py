"""LLaVA-1.5 served by vLLM with a vision-stage method of vlm_prune (out-of-tree model class).

How a fixed budget fits vLLM (see docs/design/vllm-plugin.md):

1. The processor gives every image ``method.n_keep(N)`` placeholder slots (N = the tower's
   tokens per image), the count ``wrap()`` keeps, so the scheduler and the paged KV cache only
   ever see kept tokens.
2. ``embed_multimodal`` runs vLLM's own tower and projector, then the SAME method object
   ``wrap()`` uses (``reduce_image`` with the same VisionContext: grid, seeded generator, question
   embeddings, VisionZip's tower view); the kept features fill the slots in order.
3. Kept tokens keep their ORIGINAL positions, as in ``wrap()``: the language model runs with
   three identical M-RoPE rows (exactly its 1-D RoPE), text after an image continues from the
   unpruned length (``get_mrope_input_positions``), and each kept token's offset from its slot
   rides in three extra embedding channels from the encoder to ``embed_input_ids``, which drops
   them and hands the offsets to the ``forward`` of the same step. (vLLM's own
   ``SupportsMultiModalPruning.recompute_mrope_positions`` hook is not called by its CPU runner.)
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
)
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from vlm_prune.methods.base import Method, VisionContext, item_generator
from vlm_prune.methods.visionzip import TowerFeatures
from vlm_prune.vllm.config import CLS_METHODS, TOWER_METHODS, SpecError, method_of, validate_spec
from vlm_prune.vllm.safety import check_mm_kwargs, dry_run_image, engine_dims, image_slots

#: extra embedding channels carrying each kept token's position offset (base-64 digits: exact in
#: bfloat16 too, up to 64**3 positions)
OFFSET_CHANNELS = 3
QUERY_KEY = "vlm_prune_query"
RANK_KEY = "vlm_prune_rank"


def encode_offsets(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[k] non-negative ints -> [k, 3] base-64 digits."""
    o = offsets.long()
    return torch.stack([o % 64, (o // 64) % 64, o // 4096], dim=1).to(dtype)


def decode_offsets(channels: torch.Tensor) -> torch.Tensor:
    c = channels.float().round().long()
    return c[:, 0] + 64 * c[:, 1] + 4096 * c[:, 2]


SPEC_KEY = "vlm_prune_spec"


def spec_of(hf_config: Any, mm_kwargs: Mapping[str, object] | None = None) -> dict[str, Any]:
    """The request's spec (``mm_processor_kwargs={"vlm_prune": "<json>"}``), validated for this model
    by :func:`vlm_prune.vllm.config.validate_spec` (in vLLM's front end, before the engine sees the
    request: a refusal is the request's HTTP 400), or the engine's. The request's other keys must be
    ones the operator allowed (:func:`vlm_prune.vllm.safety.check_mm_kwargs`)."""
    try:
        check_mm_kwargs(mm_kwargs or {}, hf_config)
    except SpecError as err:
        raise RequestSpecError(err) from None
    spec = (mm_kwargs or {}).get("vlm_prune")
    if spec is not None:
        try:
            return validate_spec(spec, (getattr(hf_config, "architectures", None) or [None])[0])
        except SpecError as err:
            raise RequestSpecError(err) from None
    spec = getattr(hf_config, "vlm_prune", None)
    if not spec:
        raise ValueError(
            "this model class needs hf_overrides={'vlm_prune': {...}}: build the engine with vlm_prune.vllm.LLM(...) "
            "or vlm_prune.vllm.engine_kwargs(...), or serve it with `vlm-prune serve`"
        )
    return spec


def square_grid(n: int) -> tuple[int, int] | None:
    """The square grid of ``n`` tokens, or None."""
    side = math.isqrt(n)
    return (side, side) if side * side == n else None


def dry_run_slots(info: Any, mm_kwargs: Mapping[str, object] | None, n: int, grid: tuple[int, int] | None = None,
                  crops: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """Placeholder slots of one image (or frame, temporal slice) of ``n`` visual tokens: the request's spec
    (:func:`spec_of`) dry-run on that item's count, ``grid`` (and anyres tile map ``crops``) at the engine's
    width and dtype (:func:`vlm_prune.vllm.safety.dry_run_image`), in the processor; a failure is the request's 400."""
    return dry_run_image(spec_of(info.get_hf_config(), mm_kwargs), n, grid, crops=crops, **engine_dims(info))


class RequestSpecError(SpecError, VLLMValidationError):
    """A refused request spec as vLLM's own validation error: the server's 400 names the field in its
    ``param`` too; still a ValueError for the offline ``LLM``'s callers."""

    def __init__(self, err: SpecError) -> None:
        ValueError.__init__(self, str(err))
        self.field = self.parameter = err.field
        self.value = None


def question_ids(prompt: list[int], placeholder_ranges: list[tuple[int, int]], suffix: list[int]) -> list[int]:
    """The prompt's text after its last image (the question), without the chat template's
    assistant prefix ``suffix``: what ``wrap()`` embeds for query-aware methods (CDPruner)."""
    end = max((o + n for o, n in placeholder_ranges), default=0)
    q = prompt[end:]
    if suffix and len(q) > len(suffix) and q[-len(suffix):] == suffix:
        q = q[: -len(suffix)]
    return q


def spec_bytes(spec: dict[str, Any]) -> torch.Tensor:
    """A method spec as the uint8 tensor that travels with an item from the processor to the encoder."""
    return torch.tensor(list(json.dumps(spec, sort_keys=True).encode()), dtype=torch.uint8)


def spec_from(raw: Any, default: dict[str, Any]) -> dict[str, Any]:
    """The spec an item carries (:func:`spec_bytes`), or ``default`` (the engine's) when it carries none."""
    return json.loads(bytes(raw.reshape(-1).tolist()).decode()) if raw is not None else default


def item_inputs(model: Any, item: Mapping[str, Any], device: torch.device, strip: Any = None
                ) -> tuple[dict[str, Any], Method, torch.Generator, int, torch.Tensor | None]:
    """What the encoder needs for one media item of ``model`` (a plugin class) from the kwargs the processor
    attached (:func:`tag_items`): its spec (or the engine's), the method (of ``strip(spec)`` where given), the
    item's generator (seed and rank in the prompt, as wrap()), its rank, and the question's input embeddings."""
    spec = spec_from(item[SPEC_KEY], spec_of(model.config))
    method = method_of(strip(spec) if strip is not None else spec)
    rank = int(item[RANK_KEY].reshape(-1)[0]) if item[RANK_KEY] is not None else 0
    text = None
    if item[QUERY_KEY] is not None:
        text = model.language_model.model.embed_tokens(item[QUERY_KEY].reshape(-1).to(device).long())
    return spec, method, item_generator(int(spec.get("seed", 0)), rank), rank, text


def pack_kept(keep: torch.Tensor, rows: torch.Tensor, method: Method, origin: torch.Tensor | None = None) -> torch.Tensor:
    """The encoder's output for one item: its kept rows ``rows[keep]`` in order, with each one's offset from its
    slot (its row, or ``origin[row]``, minus the slot) in the offset channels; zero offsets where the method
    renumbers positions (the official shorter sequence, as wrap())."""
    kept_rows = torch.nonzero(keep).squeeze(1)
    at = kept_rows if origin is None else origin.to(kept_rows.device)[kept_rows]
    offsets = at - torch.arange(kept_rows.numel(), device=kept_rows.device)
    if getattr(method, "renumber_positions", False):
        offsets = torch.zeros_like(offsets)
    kept = rows[kept_rows]
    return torch.cat([kept, encode_offsets(offsets, kept.dtype)], dim=1)


#: methods whose choice depends on the question (so it is part of an item's cache key)
READS_QUESTION = ("cdpruner", "keyscore")


def tag_items(out: Any, spec: dict[str, Any], method: Method, suffix: list[int],
              more: Any = None) -> Any:
    """Attach to each media item of a processed prompt ``out`` the encoder's kwargs: the question's
    ids (the text after the last item, without the template's ``suffix``), the item's rank in the
    prompt, the spec, and ``more(modality, rank)`` (named ints); key each item's cache entry by what
    else its method reads."""
    prompt = list(out["prompt_token_ids"])
    ranges = [(r.offset, _embeds_end(r)) for rs in out["mm_placeholders"].values() for r in rs]
    query = question_ids(prompt, ranges, suffix)
    packed = spec_bytes(spec)
    kwargs, hashes = out["mm_kwargs"], out["mm_hashes"]
    for modality, items in kwargs.items():
        for rank, item in enumerate(items):
            if item is None:
                continue
            extra: dict[str, Any] = dict(more(modality, rank)) if more is not None else {}
            fields = {QUERY_KEY: torch.tensor(query, dtype=torch.long), RANK_KEY: torch.tensor([rank]), SPEC_KEY: packed}
            fields.update({key: torch.tensor([value]) for key, value in extra.items()})
            for key, value in fields.items():
                item[key] = MultiModalFieldElem(data=value, field=MultiModalBatchedField())
            if method.name in READS_QUESTION:
                extra["query"] = query
            if method.name == "random":
                extra["rank"] = rank
            if extra:
                hashes[modality][rank] = keyed_hash(hashes[modality][rank], extra)
    return out


def _embeds_end(r: Any) -> int:
    """Length of a placeholder range up to its last embedding row (Qwen3-VL: a video's range ends
    with its last slice's end token, text as wrap() reads it)."""
    if r.is_embed is None or not bool(r.is_embed.any()):
        return r.length
    return int(torch.nonzero(r.is_embed)[-1]) + 1


def keyed_hash(mm_hash: str, extra: dict[str, Any]) -> str:
    """An item's cache key with what else the method reads (question, rank, ...): a cached encoding
    is never reused where that differs."""
    digest = hashlib.sha256(json.dumps(extra).encode()).hexdigest()[:16]
    return f"{mm_hash}-vlm_prune-{digest}"


def reduce_item(method: Method, features: torch.Tensor, grid: tuple[int, int] | None, text: torch.Tensor | None,
                spec: dict[str, Any], rank: torch.Tensor | None, index: int, tower_attention: Any = None
                ) -> torch.Tensor:
    """One image's [N, D] features reduced by ``method`` with the VisionContext ``wrap()`` builds (its
    ``grid``, the question's embeddings ``text``, the generator of the spec's seed and the image's
    ``rank`` in its prompt): the kept features in slot order, followed by each one's offset from its
    slot (:func:`encode_offsets`; zero where the method renumbers positions, as ``wrap()``)."""
    idx, kept = reduced(method, features, grid, text, spec, rank, index, tower_attention)
    offsets = idx - torch.arange(idx.numel(), device=idx.device)
    if getattr(method, "renumber_positions", False):  # the official code's shorter sequence (wrap() too)
        offsets = torch.zeros_like(offsets)
    return torch.cat([kept, encode_offsets(offsets, kept.dtype)], dim=1)


def reduced(method: Method, features: torch.Tensor, grid: tuple[int, int] | None, text: torch.Tensor | None,
            spec: dict[str, Any], rank: torch.Tensor | None, index: int, tower_attention: Any = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept indices, their features) of :func:`reduce_item`."""
    gen = item_generator(int(spec.get("seed", 0)), int(rank.reshape(-1)[0]) if rank is not None else 0)
    ctx = VisionContext(features=features, n_keep=image_slots(method, features.shape[0]), grid=grid, text_embeds=text,
                        tower_attention=tower_attention, generator=gen, image_index=index)
    with torch.no_grad():
        red = method.reduce_image(ctx)
    if red.sizes is not None:
        raise ValueError(f"method {method.name!r} merges tokens with sizes (proportional attention), which "
                         "vLLM's attention cannot weight; use a method that keeps or replaces tokens")
    idx = red.indices.to(features.device)
    return idx, features[idx] if red.features is None else red.features.to(features.dtype)


def check_cls_method(method: Method, hf_config: Any) -> None:
    """The model-side checks wrap() makes for HiRED / PruMerge (``check_model``), as a request's refusal:
    the [CLS] token must not be a visual token, and PruMerge reads the tower's last layer from the feature
    layer (-2) or its input (-1)."""
    if method.name not in CLS_METHODS:
        return
    strategy = hf_config.vision_feature_select_strategy
    if strategy != "default":
        raise ValueError(f"{method.name} ranks patches by the tower's [CLS] attention and needs "
                         f"vision_feature_select_strategy='default' (CLS no visual token); this model uses {strategy!r}")
    n = hf_config.vision_config.num_hidden_layers
    layer = hf_config.vision_feature_layer
    if method.name == "prumerge" and (not isinstance(layer, int) or layer % (n + 1) < n - 1):
        raise ValueError("prumerge reads the tower's last layer on the side from the feature layer, so it needs "
                         f"vision_feature_layer -2 (LLaVA-1.5's) or -1; this model uses {layer!r}")
    if method.name == "hired" and method.early_layer >= n:
        raise ValueError(f"hired early_layer={method.early_layer} is beyond the tower's {n} layers")


def layer_attention(layer: torch.nn.Module, row: torch.Tensor, has_cls: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention [N], keys [N, d]) of one tower row [T, C] of a vLLM CLIP / SigLIP encoder layer's input, as
    vlm_prune's FeatureLayerTap recomputes them on the HF tower: the attention the CLS query pays each patch
    (or, without CLS, the mean attention each token receives), and the keys, both averaged over heads."""
    attn = layer.self_attn
    if getattr(attn, "tp_size", 1) > 1:  # this rank holds only its share of the heads
        raise ValueError("the methods that read the tower's attention (visionzip, fastervlm, vispruner, hired, "
                         "prumerge) under tensor parallelism need the whole vision tower on every rank: start vLLM "
                         "with mm_encoder_tp_mode='data' (--mm-encoder-tp-mode data)")
    with torch.no_grad():
        x = layer.layer_norm1(row[None])
        qkv, _ = attn.qkv_proj(x)
        h, d = attn.num_heads_per_partition, attn.head_dim
        q, k, _ = qkv.split(h * d, dim=-1)
        q = q.view(1, -1, h, d).transpose(1, 2)
        k = k.view(1, -1, h, d).transpose(1, 2)
        if has_cls:
            probs = torch.softmax((q[:, :, :1] @ k.transpose(-1, -2)).float() * attn.scale, dim=-1)
            return probs[0, :, 0, 1:].mean(0), k[0, :, 1:].mean(0)
        probs = torch.softmax((q @ k.transpose(-1, -2)).float() * attn.scale, dim=-1)
        return probs[0].mean(0).mean(0), k[0].mean(0)


class LastLayerQK(torch.nn.Module):
    """The query / key side of the CLIP tower's last encoder layer, which vLLM does not build when the
    feature layer is the one before (LLaVA-1.5's -2): PruMerge's attention (adapters/llava.py ``layer_qk``
    reads the same three weights)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = torch.nn.LayerNorm(hidden, eps=eps)
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = torch.nn.Linear(hidden, hidden)
        self.self_attn.k_proj = torch.nn.Linear(hidden, hidden)


class PrunedLlavaProcessingInfo(LlavaProcessingInfo):
    """Each image gets the method's kept count of placeholder slots."""

    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        return method_of(spec_of(self.get_hf_config(), mm_kwargs))

    def unpruned_image_tokens(self, *, image_width: int, image_height: int) -> int:
        return super().get_num_image_tokens(image_width=image_width, image_height=image_height)

    def get_num_image_tokens(self, *, image_width: int, image_height: int,
                             mm_kwargs: Mapping[str, object] | None = None) -> int:
        n = self.unpruned_image_tokens(image_width=image_width, image_height=image_height)
        check_cls_method(self.method(mm_kwargs), self.get_hf_config())
        return dry_run_slots(self, mm_kwargs, n, square_grid(n))  # the encoder's grid (its ``side``)


class PrunedLlavaMultiModalProcessor(LlavaMultiModalProcessor):
    """LLaVA's processor, plus each image's question ids and rank within its prompt (kwargs of the
    encoder, and part of its cache key when the method reads them)."""

    def _template_suffix(self) -> list[int]:
        tok = self.info.get_tokenizer()
        template = getattr(tok, "chat_template", None)
        if not template:
            return []
        mark = "QQQ"
        try:
            text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": mark}]}],
                                           add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that needs other fields: keep the text as it is
            return []
        if mark not in text:
            return []
        return tok(text[text.rindex(mark) + len(mark):], add_special_tokens=False).input_ids

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, {k: v for k, v in hf_kwargs.items() if k != "vlm_prune"})

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        image_token_id = self.info.get_hf_config().image_token_index

        def replacement(item_idx: int) -> list[int]:
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
            n = self.info.get_num_image_tokens(image_width=size.width, image_height=size.height,
                                               mm_kwargs=hf_processor_mm_kwargs)
            return [image_token_id] * n

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=replacement)]

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = method_of(spec)
        return tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix())


class OffsetChannels:
    """The position side of a pruned vLLM model: each kept token's (t, h, w) offset from its slot
    travels in the last ``offset_channels`` embedding channels from the encoder; ``embed_input_ids``
    strips them and the ``forward`` of the same step adds them to the M-RoPE positions. LLaVA-1.5 and
    OneVision carry one offset for all three rows; Qwen2-VL overrides the codec with a (t, h, w) one.
    Put it before the vLLM model class in the bases."""

    offset_channels: int = OFFSET_CHANNELS
    _offsets: torch.Tensor | None = None

    def decode_channels(self, channels: torch.Tensor) -> torch.Tensor:
        """[k, offset_channels] -> [3, k] offsets (a 1-D offset moves the three rows alike)."""
        return decode_offsets(channels).expand(3, -1)

    def report_positions(self, positions: torch.Tensor, rows: torch.Tensor) -> list:
        """What ``last_image_positions`` holds: the (1-D) position of each media row."""
        return positions.reshape(-1, positions.shape[-1])[0, rows].tolist()

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        """Strip the offset channels off the image / video embeddings and remember, for the forward
        that follows in the same step, how far each kept token moves from its slot's position."""
        self._offsets = None
        if multimodal_embeddings is not None and len(multimodal_embeddings) > 0 and is_multimodal is not None:
            c = self.offset_channels
            rows = torch.nonzero(is_multimodal).squeeze(1)
            offsets = torch.cat([self.decode_channels(e[:, -c:]) for e in multimodal_embeddings], dim=1)
            if offsets.shape[1] != rows.numel():
                raise RuntimeError(f"vlm_prune: {offsets.shape[1]} embeddings for {rows.numel()} image / video rows")
            moved = torch.zeros(3, is_multimodal.shape[0], dtype=torch.long, device=rows.device)
            moved[:, rows] = offsets.to(rows.device)
            self._offsets, self._media_rows = moved, rows
            multimodal_embeddings = [e[:, :-c] for e in multimodal_embeddings]
        return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> Any:
        offsets, self._offsets = self._offsets, None
        if offsets is not None and inputs_embeds is not None:
            n = offsets.shape[1]
            positions = positions.clone()
            positions[..., :n] += (offsets if positions.dim() == 2 else offsets[0]).to(positions.device)
            #: positions of the image / video rows of the latest step that had any (tests, debugging)
            self.last_image_positions = self.report_positions(positions, self._media_rows)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds, **kwargs)


class FirstPositionRow:
    """Hands the language model one position row of the runner's three (equal) ones, so that it rotates by
    vLLM's own 1-D rotary embeddings (:func:`plain_rotary`): bit for bit vLLM's own model, and right for
    rotary kinds that take no M-RoPE sections (Gemma 3's linear scaling) or read positions themselves
    (Mistral's Llama-4 attention scaling). Put it after OffsetChannels in the bases."""

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> Any:
        if positions.dim() == 2:
            positions = positions[0]
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds, **kwargs)


def plain_rotary(layers: Any, params: Any) -> None:
    """Give every decoder layer's attention in ``layers`` the rotary embedding vLLM's own model builds, from
    ``params(i)`` (layer i's rope_parameters) without the ``mrope_section`` the plugin's config adds."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:  # a pipeline-parallel placeholder
            continue
        old = attn.rotary_emb
        attn.rotary_emb = get_rope(old.head_size, max_position=old.max_position_embeddings, is_neox_style=old.is_neox_style,
                                   rope_parameters={k: v for k, v in params(i).items() if k != "mrope_section"})


@MULTIMODAL_REGISTRY.register_processor(
    PrunedLlavaMultiModalProcessor, info=PrunedLlavaProcessingInfo, dummy_inputs=LlavaDummyInputsBuilder
)
class VlmPruneLlavaForConditionalGeneration(OffsetChannels, FirstPositionRow, LlavaForConditionalGeneration, SupportsMRoPE):
    """vLLM's LLaVA-1.5 with a vlm_prune vision-stage method (random, pool, divprune, cdpruner, visionzip,
    fastervlm, vispruner, hired - one partition, prumerge - with keep / budget)."""

    hf_to_vllm_mapper = WeightsMapper(
        # the CLIP tower in every naming: hub (vision_tower.vision_model.*), transformers 5
        # (model.vision_tower.* without vision_model.), and the legacy ones
        orig_to_new_regex={re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?"): "vision_tower.vision_model."},
        orig_to_new_prefix={
            "model.language_model.": "language_model.model.",
            "model.multi_modal_projector.": "multi_modal_projector.",
            "lm_head.": "language_model.lm_head.",
        },
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.method = method_of(spec_of(self.config))
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (FirstPositionRow)
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters)
        vc = self.config.vision_config
        self.side = vc.image_size // vc.patch_size
        self.drop_cls = self.config.vision_feature_select_strategy == "default"
        self.n_image = self.side * self.side + (0 if self.drop_cls else 1)
        self._feature_input: torch.Tensor | None = None
        self.vision_tower.vision_model.encoder.layers[-1].register_forward_pre_hook(self._keep_feature_input)
        #: PruMerge's view of the tower's last layer where vLLM stops the tower before it (feature layer -2)
        self._last_layer_index = vc.num_hidden_layers - 1
        self.vlm_prune_last_layer: LastLayerQK | None = None
        if len(self.vision_tower.vision_model.encoder.layers) == vc.num_hidden_layers - 1:
            self.vlm_prune_last_layer = LastLayerQK(vc.hidden_size, vc.layer_norm_eps)

    def _keep_feature_input(self, module: torch.nn.Module, args: tuple) -> None:
        self._feature_input = args[0].detach()

    # ---- encoder: the method picks what fills the slots -------------------------------------
    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        self._query = kwargs.pop(QUERY_KEY, None)
        self._rank = kwargs.pop(RANK_KEY, None)
        self._spec = kwargs.pop(SPEC_KEY, None)
        return super()._parse_and_validate_image_input(**kwargs)

    def _process_image_input(self, image_input: Any) -> Any:
        if image_input["type"] != "pixel_values":
            raise ValueError("vlm_prune.vllm prunes images given as pixels; image_embeds inputs are not supported")
        full = self.vision_tower(image_input["pixel_values"], feature_select_strategy="full")
        feats = full[:, 1:] if self.drop_cls else full
        projected = self.multi_modal_projector(feats)
        out = []
        for b in range(projected.shape[0]):
            out.append(self._reduce(b, projected[b], full[b]))
        return out

    def _item(self, value: Any, b: int) -> torch.Tensor | None:
        if value is None:
            return None
        return value[b] if isinstance(value, (list, tuple)) or value.dim() > 1 else value

    def _reduce(self, b: int, features: torch.Tensor, tower_row: torch.Tensor) -> torch.Tensor:
        n = features.shape[0]
        query = self._item(self._query, b)
        rank = self._item(self._rank, b)
        raw = self._item(self._spec, b)
        spec = spec_from(raw, spec_of(self.config))
        method = method_of(spec)
        text = None
        if query is not None:
            text = self.language_model.model.embed_tokens(query.reshape(-1).to(features.device).long())
        tower_attention = None
        if method.name in TOWER_METHODS:
            feature_input = self._feature_input[b]

            def tower_attention() -> tuple:
                attention, keys = self._attention_of(feature_input)
                cls = tower_row[0] if self.drop_cls else None
                body = tower_row[1:] if self.drop_cls else tower_row
                return attention, keys, TowerFeatures(body, cls, self.multi_modal_projector,
                                                      lambda: self._last_qk(feature_input, tower_row))

        side = self.side
        return reduce_item(method, features, (side, side) if side * side == n else None, text, spec, rank, b,
                           tower_attention)

    def _attention_of(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """VisionZip's view of the feature layer (as vlm_prune's FeatureLayerTap on the HF tower)."""
        return layer_attention(self.vision_tower.vision_model.encoder.layers[-1], row, self.drop_cls)

    def _last_qk(self, feature_input: torch.Tensor, tower_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PruMerge's view of one image (``TowerFeatures.last_qk``): the tower's last layer's query and key
        projections, all heads as one ([T, C] each), of its input - the feature layer's output (vLLM's tower
        row) when vLLM stops before the last layer, the feature layer's input when the feature layer is the last."""
        from vlm_prune.adapters.llava import layer_qk

        if self.vlm_prune_last_layer is not None:
            return layer_qk(self.vlm_prune_last_layer, tower_row)
        layer = self.vision_tower.vision_model.encoder.layers[-1]
        attn = layer.self_attn
        with torch.no_grad():
            qkv, _ = attn.qkv_proj(layer.layer_norm1(feature_input[None]))
            q, k, _ = qkv[0].split(attn.num_heads_per_partition * attn.head_dim, dim=-1)
        return q, k

    # ---- positions: kept tokens at their original positions ---------------------------------
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned sequence: each image's k slots start where its N tokens
        started (slot i at base + i; forward() moves each kept token to base + its index), and the
        text after an image continues from base + N, decode steps from the unpruned length. Methods
        that renumber (VisionZip's official variant) keep vLLM's contiguous positions."""
        n_tokens = len(input_tokens)
        pos = torch.empty(n_tokens, dtype=torch.long)
        shift, cursor = 0, 0
        for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
            start, k = f.mm_position.offset, f.mm_position.length
            pos[cursor:start] = torch.arange(cursor, start) + shift
            pos[start:start + k] = torch.arange(start, start + k) + shift
            if not self._renumbers(f):
                shift += max(0, self.n_image - k)
            cursor = start + k
        pos[cursor:] = torch.arange(cursor, n_tokens) + shift
        return pos[None].expand(3, -1).clone(), shift

    def _renumbers(self, feature: MultiModalFeatureSpec) -> bool:
        """Whether the image's method renumbers positions (VisionZip's official variant feeds the
        language model the shorter sequence, as wrap() does): then nothing is shifted."""
        item = feature.data
        elem = item.get(SPEC_KEY) if item is not None else None
        spec = spec_from(elem.data if elem is not None else None, spec_of(self.config))
        return bool(getattr(method_of(spec), "renumber_positions", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loading; the tower's last layer's query / key weights also fill :class:`LastLayerQK`
        where vLLM's tower stops before that layer (vLLM drops them)."""
        own = self.vlm_prune_last_layer
        if own is None:
            return super().load_weights(weights)
        prefix = f"vision_tower.vision_model.encoder.layers.{self._last_layer_index}."
        params = dict(own.named_parameters())
        loaded: set[str] = set()

        def tee(ws: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in ws:
                mapped = self.hf_to_vllm_mapper._map_name(name)
                if mapped is not None and mapped.startswith(prefix) and mapped[len(prefix):] in params:
                    with torch.no_grad():
                        params[mapped[len(prefix):]].copy_(w)
                    loaded.add("vlm_prune_last_layer." + mapped[len(prefix):])
                yield name, w

        done = super().load_weights(tee(weights))
        missing = set(params) - {n[len("vlm_prune_last_layer."):] for n in loaded}
        if missing:
            raise ValueError(f"the checkpoint has no weights {sorted(missing)} of the tower's last layer "
                             f"({prefix}), which prumerge reads")
        return done | loaded
