"""Tiny randomly initialised Qwen3-VL / Qwen3-VL-MoE / GLM-4.1V / Qwen3.5 models from the real config
classes (CPU, seconds), with inputs laid out as their processors lay them out."""
from __future__ import annotations

import torch

from tiny_models import IMAGE_TOKEN, VIDEO_TOKEN, VOCAB, _finish, _pad

VISION_START, VISION_END = 92, 93
#: Qwen3-VL writes "<t seconds>" before every frame of a video: stand-in text ids per frame
TIMESTAMP = (60, 61)
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}


def tiny_qwen3_vl(attn: str = "sdpa", seed: int = 0, moe: bool = False):
    """Qwen3-VL (or Qwen3-VL-MoE): 2-block tower (patch 4, merge 2), DeepStack features from tower
    blocks 0 and 1 injected after decoder layers 0 and 1; 6 decoder layers."""
    torch.manual_seed(seed)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    text = dict(_TEXT, rope_parameters=dict(_ROPE))
    if moe:
        from transformers import Qwen3VLMoeConfig as Cfg, Qwen3VLMoeForConditionalGeneration as Model
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    else:
        from transformers import Qwen3VLConfig as Cfg, Qwen3VLForConditionalGeneration as Model
    cfg = Cfg(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, pad_token_id=0)
    return _never_placeholders(_finish(Model(cfg), attn))


def _never_placeholders(model):
    """Random weights would generate placeholder ids, which a re-run without cache (use_cache=False)
    reads as one more image token than the pixels give: suppress them, as trained models never emit them."""
    model.generation_config.suppress_tokens = [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END]
    return model


def qwen3_vl_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, video: bool = False):
    """One 32 x 32 px image (8 x 8 patches -> 16 tokens) per sample, or a 4-frame video (2 temporal
    slices x 16 tokens) laid out as Qwen3-VL's processor does: each slice behind its own timestamp
    text and vision start / end tokens."""
    tok = VIDEO_TOKEN if video else IMAGE_TOKEN
    return _sliced_inputs(model, batch, pad, seed, video, tok,
                          lambda f: (list(TIMESTAMP) if video else []) + [VISION_START] + [tok] * 16 + [VISION_END])


def _sliced_inputs(model, batch: int, pad: str, seed: int, video: bool, placeholder: int, block, around=((), ())):
    """Inputs of one 8 x 8-patch image (16 tokens) or a 2-slice video per sample: random text, then
    ``block(slice)`` for each temporal slice (between ``around`` for a video), then random text;
    patches, grid and mm_token_type_ids (the ``placeholder`` rows: 1 image, 2 video)."""
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    t = 2 if video else 1
    grid = torch.tensor([[t, 8, 8]] * batch)
    dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=g)
    seqs = []
    for b in range(batch):
        s = [1] + torch.randint(3, 50, (2 + b,), generator=g).tolist()
        s += list(around[0]) if video else []
        for f in range(t):
            s += block(f)
        s += list(around[1]) if video else []
        s += torch.randint(3, 50, (5 + 2 * b,), generator=g).tolist()
        seqs.append(s)
    ids, mask = _pad(seqs, pad)
    mm = torch.zeros_like(ids, dtype=torch.int)
    mm[ids == placeholder] = 2 if video else 1
    key = "video" if video else "image"
    return {"input_ids": ids, "attention_mask": mask, f"pixel_values{'_videos' if video else ''}": pixels,
            f"{key}_grid_thw": grid, "mm_token_type_ids": mm}


IMAGE_START, IMAGE_END = 94, 95


def tiny_glm4v(attn: str = "sdpa", seed: int = 0, variant: str = "4.1"):
    """GLM-4.1V (variant "4.5": GLM-4.5V's MoE language model, first layer dense; "4.6": GLM-4.6V's
    classes): 2-block tower (patch 4, merge 2), 6 decoder layers with GLM's partial rotary (half of
    each head) on M-RoPE's three axes."""
    import transformers

    Glm4vConfig, Glm4vForConditionalGeneration = {
        "4.1": (transformers.Glm4vConfig, transformers.Glm4vForConditionalGeneration),
        "4.5": (transformers.Glm4vMoeConfig, transformers.Glm4vMoeForConditionalGeneration),
        "4.6": (transformers.Glm46VConfig, transformers.Glm46VForConditionalGeneration),
    }[variant]
    torch.manual_seed(seed)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  image_size=32, temporal_patch_size=2, spatial_merge_size=2)
    text = {k: v for k, v in _TEXT.items() if k != "head_dim"}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                               "partial_rotary_factor": 0.5}
    if variant == "4.5":
        text.update(moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                    first_k_dense_replace=1)
    cfg = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                      image_start_token_id=IMAGE_START, image_end_token_id=IMAGE_END, video_start_token_id=VISION_START,
                      video_end_token_id=VISION_END, pad_token_id=0)
    model = _finish(Glm4vForConditionalGeneration(cfg), attn)
    model.generation_config.suppress_tokens = [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END, IMAGE_START, IMAGE_END]
    return model


def glm4v_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, video: bool = False):
    """One 32 x 32 px image (16 tokens) per sample, or a 4-frame video (2 temporal slices x 16
    tokens) laid out as GLM-4.1V's processor does: every slice is image placeholders between image
    start / end tokens followed by its timestamp, inside video start / end; mm_token_type_ids tell
    video slots (2) from image slots (1)."""
    return _sliced_inputs(
        model, batch, pad, seed, video, IMAGE_TOKEN,
        lambda f: [IMAGE_START] + [IMAGE_TOKEN] * 16 + [IMAGE_END] + ([TIMESTAMP[f % 2]] if video else []),
        around=([VISION_START], [VISION_END]))


def tiny_qwen3_5(attn: str = "sdpa", seed: int = 0, moe: bool = False):
    """Qwen3.5 (or Qwen3.5-MoE): Qwen3-VL's tower without DeepStack; 4 decoder layers alternating
    Gated DeltaNet (linear attention, recurrent state + 4-wide causal convolution) and full attention."""
    if moe:
        from transformers import Qwen3_5MoeConfig as Qwen3_5Config, Qwen3_5MoeForConditionalGeneration as Qwen3_5ForConditionalGeneration
    else:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)
    text = dict(_TEXT, num_hidden_layers=4, rope_parameters=dict(_ROPE, partial_rotary_factor=1.0),
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_conv_kernel_dim=4)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, pad_token_id=0)
    return _never_placeholders(_finish(Qwen3_5ForConditionalGeneration(cfg), attn))
