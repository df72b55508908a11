"""Tiny randomly initialised VLMs built from the real config classes (CPU, seconds)."""
from __future__ import annotations

import torch

IMAGE_TOKEN = 90
VIDEO_TOKEN = 91
VOCAB = 96


def forward_stats(model, inp: dict) -> dict:
    """One no-grad forward of a wrapped model and its ``last_stats``; unwraps it even when the forward fails."""
    import vlm_prune

    try:
        with torch.no_grad():
            model(**inp)
        return model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)


def _llama(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llava(attn: str = "sdpa", seed: int = 0, tower_layers: int = 2, image_size: int = 32):
    """tower_layers: CLIP layers (the feature layer is the second to last: ViT-stage methods need 3);
    image_size: pixels per side (patch 8: 32 -> a 4 x 4 grid of 16 tokens, 48 -> 6 x 6)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=tower_layers,
                                       num_attention_heads=2, image_size=image_size, patch_size=8),
        text_config=_llama(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    cfg._attn_implementation = attn
    model = LlavaForConditionalGeneration(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def llava_inputs(batch: int = 2, n_img_tokens: int = 16, pad: str = "left", seed: int = 1, image_size: int = 32):
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
    pixels = torch.randn(batch, 3, image_size, image_size, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def _qwen2(**kw):
    from transformers import Qwen2Config

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)
    base.update(kw)
    return Qwen2Config(**base)


def _finish(model, attn):
    model.set_attn_implementation(attn)
    return model.eval()


def tiny_llava_next(attn: str = "sdpa", seed: int = 0, tower_layers: int = 2):
    """tower_layers: as for :func:`tiny_llava`."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=tower_layers,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=_llama(),
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
        vision_feature_layer=-2,
    )
    return _finish(LlavaNextForConditionalGeneration(cfg), attn)


def tiny_onevision(attn: str = "sdpa", seed: int = 0):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=32, patch_size=8),
        text_config=_qwen2(),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        image_grid_pinpoints=[[32, 32], [32, 64], [64, 32]],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    return _finish(LlavaOnevisionForConditionalGeneration(cfg), attn)


def tiny_qwen2_vl(attn: str = "sdpa", seed: int = 0, v25: bool = False):
    torch.manual_seed(seed)
    if v25:
        from transformers import Qwen2_5_VLConfig as Cfg, Qwen2_5_VLForConditionalGeneration as Model
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
    else:
        from transformers import Qwen2VLConfig as Cfg, Qwen2VLForConditionalGeneration as Model
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cfg = Cfg(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
              vision_start_token_id=92, vision_end_token_id=93, pad_token_id=0)
    return _finish(Model(cfg), attn)


def _pad(seqs: list[list[int]], pad: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(n - len(s), n) if pad == "left" else slice(0, len(s))
        ids[b, sl] = torch.tensor(s)
        mask[b, sl] = 1
    return ids, mask


def prompts(counts: list[list[tuple[int, int]]], pad: str = "left", seed: int = 1, start=(), end=()):
    """Token ids: per sample a list of (placeholder id, count) blocks between random text."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for b, blocks in enumerate(counts):
        s = [1] + torch.randint(3, 80, (2 + b,), generator=g).tolist()
        for tok, n in blocks:
            s += list(start) + [tok] * n + list(end)
        s += torch.randint(3, 80, (5 + 2 * b,), generator=g).tolist()
        seqs.append(s)
    return _pad(seqs, pad)


def onevision_video_inputs(model, batch: int = 2, frames: int = 4, pad: str = "left", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    vids = torch.randn(batch, frames, 3, 32, 32, generator=g)
    side = -(-4 // 2)
    n = frames * side * side + 1
    ids, mask = prompts([[(VIDEO_TOKEN, n)] for _ in range(batch)], pad, seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values_videos": vids}


def onevision_image_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 2, 3, 32, 32, generator=g)  # base + one tile (32 x 32 image)
    sizes = torch.tensor([[32, 32]] * batch)
    with torch.no_grad():
        feats = model.model.get_image_features(pixels, sizes, batch_num_images=torch.ones(batch, dtype=torch.long)).pooler_output
    ids, mask = prompts([[(IMAGE_TOKEN, f.shape[0])] for f in feats], pad, seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_sizes": sizes}


def llava_next_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, 3, 32, 32, generator=g)  # base + 2 tiles of a 32 x 64 image
    sizes = torch.tensor([[32, 64]] * batch)
    with torch.no_grad():
        feats = model.model.get_image_features(pixels, sizes).pooler_output
    ids, mask = prompts([[(IMAGE_TOKEN, f.shape[0])] for f in feats], pad, seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_sizes": sizes}


def qwen2_vl_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, video: bool = False):
    """One 16 x 16 px image (4 x 4 patches -> 2 x 2 tokens... scaled up: 8 x 8 patches -> 16 tokens)
    or a 4-frame video (2 temporal slices x 16 tokens) per sample."""
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    t = 2 if video else 1
    grid = torch.tensor([[t, 8, 8]] * batch)
    n_patch = int(grid.prod(-1).sum())
    dim = 3 * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(n_patch, dim, generator=g)
    tok = VIDEO_TOKEN if video else IMAGE_TOKEN
    n = t * 16
    ids, mask = prompts([[(tok, n)] for _ in range(batch)], pad, seed, start=(92,), end=(93,))
    mm = torch.zeros_like(ids, dtype=torch.int)
    mm[ids == tok] = 2 if video else 1
    key = "video" if video else "image"
    out = {"input_ids": ids, "attention_mask": mask, f"pixel_values{'_videos' if video else ''}": pixels,
           f"{key}_grid_thw": grid, "mm_token_type_ids": mm}
    return out


def qwen_tokenizer():
    """A word-level tokenizer with the tiny Qwen2-VL's special ids and a chat template, usable as
    the ``processor`` QuoTA prompts the model with (apply_chat_template + encode)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 4, "<|image_pad|>": IMAGE_TOKEN,
               "<|video_pad|>": VIDEO_TOKEN, "<|vision_start|>": 92, "<|vision_end|>": 93}
    words = ["A", "B", "user", "assistant", ":", "Does", "the", "image", "contain", "sufficient", "information",
             "to", "answer", "given", "question?", "yes", "no", "A.", "B.", "what", "colour", "is", "shape", "?"]
    vocab = dict(special)
    free = (i for i in range(VOCAB) if i not in special.values())
    for word in words:
        vocab[word] = next(free)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}{{ m['role'] }} :{% for part in m['content'] %}"
                "{% if part['type'] == 'video' %} <|vision_start|> <|video_pad|> <|vision_end|>"
                "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %} {% endfor %}"
                "{% if add_generation_prompt %}assistant :{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=template)
