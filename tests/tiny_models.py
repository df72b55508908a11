"""Tiny randomly initialised VLMs built from the real config classes (CPU, seconds)."""
from __future__ import annotations

import torch

IMAGE_TOKEN = 90
VIDEO_TOKEN = 91
VOCAB = 96


def _llama(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llava(attn: str = "sdpa", seed: int = 0):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=_llama(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    cfg._attn_implementation = attn
    model = LlavaForConditionalGeneration(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def llava_inputs(batch: int = 2, n_img_tokens: int = 16, pad: str = "left", seed: int = 1):
    """input_ids with one image each, different prompt lengths, padded; pixel values."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for b in range(batch):
        pre = torch.randint(3, 80, (2 + b,), generator=g).tolist()
        post = torch.randint(3, 80, (5 + 2 * b,), generator=g).tolist()
        seqs.append([1] + pre + [IMAGE_TOKEN] * n_img_tokens + post)
    n = max(len(s) for s in seqs)
    ids = torch.zeros(batch, n, dtype=torch.long)
    mask = torch.zeros(batch, n, dtype=torch.long)
    for b, s in enumerate(seqs):
        if pad == "left":
            ids[b, n - len(s):] = torch.tensor(s)
            mask[b, n - len(s):] = 1
        else:
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
