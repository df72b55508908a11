"""Tiny randomly initialised models of the LLaVA-like families of issue 29 (Mistral 3, InternVL,
LLaVA-NeXT-Video, Gemma 3, SmolVLM, LLaVA-OneVision-1.5), built from the real config classes,
and their inputs (batch 2 with padding, as tests/tiny_models.py)."""
from __future__ import annotations

import pytest
import torch

from tiny_models import IMAGE_TOKEN, VIDEO_TOKEN, VOCAB, _finish, _llama, _pad, _qwen2

IMG_BREAK, IMG_END = 92, 93


def tiny_mistral3(attn: str = "sdpa", seed: int = 0):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    torch.manual_seed(seed)
    text = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                         pad_token_id=0, sliding_window=None)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, image_size=64, patch_size=4)
    cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         spatial_merge_size=2, vision_feature_layer=-1)
    return _finish(Mistral3ForConditionalGeneration(cfg), attn)


#: (height, width) in pixels of each sample's image: Pixtral's variable resolution (8 px a token)
MISTRAL3_SIZES = [(32, 32), (32, 48)]


def mistral3_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    """One image per sample at its own resolution: rows of [IMG] placeholders, each row ended by
    [IMG_BREAK], the image by [IMG_END] (as the Pixtral processor lays them out)."""
    g = torch.Generator().manual_seed(seed)
    sizes = MISTRAL3_SIZES[:batch] if batch <= len(MISTRAL3_SIZES) else MISTRAL3_SIZES * batch
    sizes = sizes[:batch]
    hmax = max(h for h, _ in sizes)
    wmax = max(w for _, w in sizes)
    pixels = torch.zeros(batch, 3, hmax, wmax)
    seqs = []
    for b, (h, w) in enumerate(sizes):
        pixels[b, :, :h, :w] = torch.randn(3, h, w, generator=g)
        rows, cols = h // 8, w // 8
        image = []
        for r in range(rows):
            image += [IMAGE_TOKEN] * cols + [IMG_BREAK if r < rows - 1 else IMG_END]
        pre = torch.randint(3, 80, (2 + b,), generator=g).tolist()
        post = torch.randint(3, 80, (5 + 2 * b,), generator=g).tolist()
        seqs.append([1] + pre + image + post)
    ids, mask = _pad(seqs, pad)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_sizes": torch.tensor(sizes)}


def tiny_internvl(attn: str = "sdpa", seed: int = 0):
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig

    torch.manual_seed(seed)
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=(32, 32), patch_size=(4, 4))
    cfg = InternVLConfig(vision_config=vision, text_config=_qwen2(), image_token_id=IMAGE_TOKEN, image_seq_length=16,
                         downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default")
    return _finish(InternVLForConditionalGeneration(cfg), attn)


def internvl_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, tiles: list[int] | None = None):
    """Per sample one image of ``tiles[b]`` tiles (default 1): 32 px tiles, 8 x 8 patches, pixel
    shuffle -> 16 tokens a tile, between <img> (92) and </img> (93) as the processor writes them."""
    from tiny_models import prompts

    tiles = tiles or [1] * batch
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(tiles), 3, 32, 32, generator=g)
    ids, mask = prompts([[(IMAGE_TOKEN, 16 * t)] for t in tiles], pad, seed, start=(IMG_BREAK,), end=(IMG_END,))
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def tiny_llava_next_video(attn: str = "sdpa", seed: int = 0, tower_layers: int = 2):
    """tower_layers: CLIP layers (the feature layer is the second last): AS-ViT needs 4."""
    from transformers import CLIPVisionConfig, LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaNextVideoConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=tower_layers,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=_llama(), image_token_index=IMAGE_TOKEN, video_token_index=VIDEO_TOKEN,
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], vision_feature_layer=-2, spatial_pool_stride=2,
    )
    return _finish(LlavaNextVideoForConditionalGeneration(cfg), attn)


def llava_next_video_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, frames: int = 4):
    """A video of ``frames`` 32 px frames per sample: 4 x 4 patches pooled to 2 x 2 tokens a frame."""
    from tiny_models import prompts

    g = torch.Generator().manual_seed(seed)
    vids = torch.randn(batch, frames, 3, 32, 32, generator=g)
    ids, mask = prompts([[(VIDEO_TOKEN, frames * 4)] for _ in range(batch)], pad, seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values_videos": vids}


def llava_next_video_image_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    import tiny_models as T

    return T.llava_next_inputs(model, batch=batch, pad=pad, seed=seed)


def tiny_gemma3(attn: str = "sdpa", seed: int = 0, sliding_window: int = 128):
    """Gemma 3 with alternating sliding-window and full-attention layers (window ``sliding_window``
    columns: the prompts and answers of the tests fit it) and 16 tokens per image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    text = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=VOCAB,
                            max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            sliding_window=sliding_window,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=4)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, image_token_index=IMAGE_TOKEN,
                       boi_token_index=IMG_BREAK, eoi_token_index=IMG_END)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers initialises the projector to zeros: give the images a voice
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    return _finish(model, attn)


def gemma3_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    """One 32 px image per sample (8 x 8 patches pooled to 4 x 4 = 16 tokens) between
    <start_of_image> and <end_of_image>, and ``token_type_ids`` (1 at the image tokens) as the
    Gemma 3 processor returns them."""
    from tiny_models import prompts

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    ids, mask = prompts([[(IMAGE_TOKEN, 16)] for _ in range(batch)], pad, seed, start=(IMG_BREAK,), end=(IMG_END,))
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
            "token_type_ids": (ids == IMAGE_TOKEN).long()}


def tiny_onevision15(attn: str = "sdpa", seed: int = 0):
    """LLaVA-OneVision-1.5 (transformers 5.25 added it: on an older release its tests skip)."""
    import transformers

    if not hasattr(transformers, "LlavaOnevision15ForConditionalGeneration"):
        pytest.skip(f"LLaVA-OneVision-1.5 needs transformers >= 5.25 (this is {transformers.__version__})")
    from transformers import (LlavaOnevision15Config, LlavaOnevision15ForConditionalGeneration,
                              LlavaOnevision15VisionConfig, Qwen3Config)

    torch.manual_seed(seed)
    text = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0)
    vision = LlavaOnevision15VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                          spatial_merge_size=2, out_hidden_size=64)
    cfg = LlavaOnevision15Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                 video_token_id=VIDEO_TOKEN, vision_start_token_id=IMG_BREAK, vision_end_token_id=IMG_END)
    model = _finish(LlavaOnevision15ForConditionalGeneration(cfg), attn)
    # a real checkpoint never answers with a placeholder; a random one may, and with use_cache=False
    # the model (wrapped or not) then refuses the unmatched placeholder, as transformers does
    model.generation_config.suppress_tokens = [IMAGE_TOKEN, VIDEO_TOKEN, IMG_BREAK, IMG_END]
    return model


def onevision15_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1, video: bool = False):
    """One 32 x 32 px image (8 x 8 patches -> 4 x 4 tokens) or a 4-frame 16 x 16 px video (4 x 4
    patches -> 2 x 2 tokens a frame) per sample, between the vision start / end tokens."""
    from tiny_models import prompts

    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[4, 4, 4] if video else [1, 8, 8]] * batch)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 4 * 4, generator=g)
    tok = VIDEO_TOKEN if video else IMAGE_TOKEN
    ids, mask = prompts([[(tok, 16)] for _ in range(batch)], pad, seed, start=(IMG_BREAK,), end=(IMG_END,))
    key = "video" if video else "image"
    return {"input_ids": ids, "attention_mask": mask, f"pixel_values{'_videos' if video else ''}": pixels,
            f"{key}_grid_thw": grid}


def onevision15_video_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    return onevision15_inputs(model, batch=batch, pad=pad, seed=seed, video=True)


#: SmolVLM / Idefics3 prompt tokens (the tokenizer's <fake_token_around_image>, <global-img>,
#: <row_1_col_1>, <row_1_col_2> and "\n")
FAKE_IMAGE, GLOBAL_IMG, ROW1_COL1, ROW1_COL2, NEWLINE = IMG_BREAK, IMG_END, 88, 89, 10


def tiny_smolvlm(attn: str = "sdpa", seed: int = 0, idefics3: bool = False):
    """SmolVLM (or Idefics3): 32 px tiles, 8 x 8 patches pixel-shuffled (scale 2) to 4 x 4 = 16
    tokens a tile, a Llama text model."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, SmolVLMConfig,
                              SmolVLMForConditionalGeneration, SmolVLMVisionConfig)

    torch.manual_seed(seed)
    vision_cls, cfg_cls, model_cls = ((Idefics3VisionConfig, Idefics3Config, Idefics3ForConditionalGeneration) if idefics3
                                      else (SmolVLMVisionConfig, SmolVLMConfig, SmolVLMForConditionalGeneration))
    vision = vision_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        image_size=32, patch_size=4)
    cfg = cfg_cls(vision_config=vision, text_config=_llama(), image_token_id=IMAGE_TOKEN, scale_factor=2)
    model = _finish(model_cls(cfg), attn)
    # a real checkpoint never answers with a placeholder; a random one may (see tiny_onevision15)
    model.generation_config.suppress_tokens = [IMAGE_TOKEN, FAKE_IMAGE, GLOBAL_IMG]
    return model


def tiny_idefics3(attn: str = "sdpa", seed: int = 0):
    return tiny_smolvlm(attn, seed, idefics3=True)


def smolvlm_tiles(split: bool) -> list[int]:
    """Token ids of one image as the SmolVLM / Idefics3 processor writes it: split into 1 x 2 tiles
    and its global tile, or (``split=False``) the global tile alone."""
    tile = [IMAGE_TOKEN] * 16
    ids = []
    if split:
        ids = [FAKE_IMAGE, ROW1_COL1, *tile, FAKE_IMAGE, ROW1_COL2, *tile, NEWLINE, NEWLINE]
    return ids + [FAKE_IMAGE, GLOBAL_IMG, *tile, FAKE_IMAGE]


def smolvlm_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    """Sample 0: one image split into 1 x 2 tiles + its global tile (3 tiles); sample 1: two images
    the processor did not split (a tile each); later samples alternate. ``pixel_values`` [B, 3, 3,
    32, 32] with all-zero padding tiles and ``pixel_attention_mask``, as the processor returns them."""
    g = torch.Generator().manual_seed(seed)
    layouts = [[True], [False, False]] * batch
    layouts = layouts[:batch]
    pixels = torch.zeros(batch, 3, 3, 32, 32)
    pmask = torch.zeros(batch, 3, 32, 32, dtype=torch.bool)
    seqs = []
    for b, images in enumerate(layouts):
        n_tiles = sum(3 if split else 1 for split in images)
        pixels[b, :n_tiles] = torch.randn(n_tiles, 3, 32, 32, generator=g)
        pmask[b, :n_tiles] = True
        s = [1] + torch.randint(3, 80, (2 + b,), generator=g).tolist()
        for split in images:
            s += smolvlm_tiles(split) + torch.randint(3, 80, (2,), generator=g).tolist()
        s += torch.randint(3, 80, (5 + 2 * b,), generator=g).tolist()
        seqs.append(s)
    ids, mask = _pad(seqs, pad)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "pixel_attention_mask": pmask}


#: the SmolVLM / Idefics3 chat template (images only; SmolVLMProcessor brings its own for videos)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def smolvlm_processor(idefics3: bool = False):
    """The real SmolVLMProcessor (or Idefics3Processor) on a word-level tokenizer whose special tokens
    sit at the tiny models' ids: images resized to at most 64 px and split into 32 px tiles (16
    tokens each after the pixel shuffle), video frames of 32 px (SmolVLM only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": 0, "<s>": 1, "<end_of_utterance>": 2, "<unk>": 3, "<|im_start|>": 4, "<image>": IMAGE_TOKEN,
                "<video>": VIDEO_TOKEN, "<fake_token_around_image>": FAKE_IMAGE, "<global-img>": GLOBAL_IMG,
                "<row_1_col_1>": ROW1_COL1, "<row_1_col_2>": ROW1_COL2, "<row_2_col_1>": 86, "<row_2_col_2>": 87}
    words = ["User:", "Assistant:", "what", "is", "the", "colour", "shape", "?", "A", "B", "C", "D", "red", "blue"]
    vocab = dict(specials)
    free = [i for i in range(VOCAB) if i not in vocab.values()]
    vocab.update({w: i for w, i in zip(words, free)})
    vocab.update({f"<unused{i}>": i for i in range(VOCAB) if i not in vocab.values()})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<end_of_utterance>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>",
                              "video_token": "<video>"},
        padding_side="left", chat_template=SMOLVLM_TEMPLATE,
    )
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t.startswith(("<row", "<|im"))]})
    if idefics3:
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        ip = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
        return Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=16, chat_template=SMOLVLM_TEMPLATE)
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    ip = SmolVLMImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    vp = SmolVLMVideoProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
    return SmolVLMProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, image_seq_len=16,
                            chat_template=SMOLVLM_TEMPLATE)


def tiny_videollama3(attn: str = "sdpa", seed: int = 0):
    """VideoLLaMA3: a 2-layer tower (patch 4) on packed patches, each image downsampled by its merge
    size 2, a Qwen2 text model."""
    from transformers import VideoLlama3Config, VideoLlama3ForConditionalGeneration, VideoLlama3VisionConfig

    torch.manual_seed(seed)
    vision = VideoLlama3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     patch_size=4)
    cfg = VideoLlama3Config(vision_config=vision, text_config=_qwen2(), image_token_id=IMAGE_TOKEN,
                            video_token_id=VIDEO_TOKEN)
    model = _finish(VideoLlama3ForConditionalGeneration(cfg), attn)
    model.generation_config.suppress_tokens = [IMAGE_TOKEN, VIDEO_TOKEN]
    return model


#: (height, width) in patches of each sample's image (4 px patches, merge 2): 4 x 4 and 4 x 6 tokens
VIDEOLLAMA3_PATCHES = [(8, 8), (8, 12)]


def videollama3_inputs(model, batch: int = 2, pad: str = "left", seed: int = 1):
    """One image per sample at its own resolution, patches packed as the processor packs them
    (``image_grid_thw``, ``image_merge_sizes``), its (h / 2) * (w / 2) placeholders between random text."""
    from tiny_models import prompts

    g = torch.Generator().manual_seed(seed)
    sizes = (VIDEOLLAMA3_PATCHES * batch)[:batch]
    grid = torch.tensor([[1, h, w] for h, w in sizes])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 4 * 4, generator=g)
    ids, mask = prompts([[(IMAGE_TOKEN, h * w // 4)] for h, w in sizes], pad, seed)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grid,
            "image_merge_sizes": torch.full((batch,), 2, dtype=torch.long)}
