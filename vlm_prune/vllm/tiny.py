"""Small LLaVA-1.5-, LLaVA-NeXT(-Video)-, LLaVA-OneVision-, Qwen2-VL-, Qwen2.5-VL-, Qwen3-VL(-MoE)-, Gemma 3-,
Mistral 3-, GLM-4.1V / 4.5V- and Qwen3.5(-MoE)-layout checkpoints written to a folder vLLM can load.

No hub here: tests and ``vlm-prune bench --serve`` build randomly initialised models from the real
transformers config classes and save them with ``save_pretrained`` (transformers 5's key naming; the
plugin's weight mappers accept it and the hub's), with a word-level tokenizer whose vocabulary covers
every id of the model (``w<i>`` words, the media tokens at their ids) and the model's real processor
class.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

def chat_template(image: str, video: str | None = None) -> str:
    """``role : content`` turns, ``assistant :`` to generate; image / video parts written as ``image`` / ``video``."""
    media = f"{{% if part['type'] == 'image' %}} {image}"
    if video is not None:
        media += f"{{% elif part['type'] == 'video' %}} {video}"
    return ("{{ bos_token }}{% for message in messages %}{{ message['role'] }} :"
            "{% if message['content'] is string %} {{ message['content'] }}{% else %}{% for part in message['content'] %}"
            + media + "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


CHAT_TEMPLATE = chat_template("<image>")


def word_tokenizer(vocab: int, names_at: dict[int, str], template: str, media_tokens: dict[str, str],
                   added: tuple[str, ...] = ()):
    """Word-level tokenizer over ``vocab`` ids: ``<pad> <s> </s>``, words ``w3 ...``, ``names_at``
    replacing the words at their ids; ``added`` become special added tokens (matched unspaced)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    for i, name in names_at.items():
        names[i] = name
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if added:
        core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>", extra_special_tokens=media_tokens, chat_template=template)


def text_config(shape: "LlavaShape | QwenShape") -> dict:
    """The decoder's sizes and special ids (Llama / Qwen2 configs take the same keys)."""
    return dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                max_position_embeddings=shape.max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def sharpen(model: torch.nn.Module, projector: torch.nn.Module) -> torch.nn.Module:
    """Random init draws small weights: scale the projector so the vision features matter and the
    LM head so next-token distributions are peaked (greedy decoding far from ties)."""
    with torch.no_grad():
        for p in projector.parameters():
            p.mul_(4.0)
        model.lm_head.weight.mul_(16.0)
    return model


@dataclass(frozen=True)
class LlavaShape:
    """Sizes of a LLaVA-1.5-layout model (CLIP tower + Llama)."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 4
    heads: int = 2  # head_dim 32: vLLM's CPU attention has no kernel for 16
    kv_heads: int = 1
    vocab: int = 96
    vision_hidden: int = 32
    vision_intermediate: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    image_size: int = 32
    patch: int = 8
    max_positions: int = 1024

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


#: LLaVA-1.5-7B (CLIP ViT-L/14-336 + Vicuna-7B) scaled down ``s`` times in width and depth:
#: the same 576 visual tokens per image (24 x 24 grid)
def llava15_scaled(s: int = 8) -> LlavaShape:
    return LlavaShape(hidden=4096 // s, intermediate=11008 // s, layers=max(2, 32 // s), heads=max(1, 32 // s),
                      kv_heads=max(1, 32 // s), vocab=32064, vision_hidden=1024 // s, vision_intermediate=4096 // s,
                      vision_layers=max(2, 24 // s), vision_heads=max(1, 16 // s), image_size=336, patch=14,
                      max_positions=4096)


def image_token_id(shape: LlavaShape) -> int:
    return shape.vocab - 6


def llava_names(shape: LlavaShape) -> dict[int, str]:
    """``<image>`` at the image token id, then ``user assistant :``."""
    image_id = image_token_id(shape)
    return {image_id: "<image>", image_id + 1: "user", image_id + 2: "assistant", image_id + 3: ":"}


def build_tokenizer(shape: LlavaShape):
    """Word-level tokenizer: ``<pad> <s> </s>``, words ``w3 ...``, ``<image>`` at the image token id."""
    return word_tokenizer(shape.vocab, llava_names(shape), CHAT_TEMPLATE, {"image_token": "<image>"})


def clip_config(shape: LlavaShape):
    """The CLIP tower's config of a LLaVA-layout ``shape``."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                            num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                            image_size=shape.image_size, patch_size=shape.patch, projection_dim=shape.vision_hidden)


def build_model(shape: LlavaShape, seed: int = 0):
    """A randomly initialised ``LlavaForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(**text_config(shape))
    cfg = LlavaConfig(vision_config=clip_config(shape), text_config=text, image_token_id=image_token_id(shape),
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(cfg).eval()
    return sharpen(model, model.model.multi_modal_projector)


def write_llava(folder: str | Path, shape: LlavaShape = LlavaShape(), seed: int = 0) -> Path:
    """Save a random LLaVA-1.5-layout model of ``shape`` with tokenizer and processor to ``folder``."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    folder = Path(folder)
    model = build_model(shape, seed)
    model.save_pretrained(folder)
    size = shape.image_size
    proc = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=build_tokenizer(shape), patch_size=shape.patch, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE,
    )
    proc.save_pretrained(folder)
    return folder


# ---- Qwen2-VL / Qwen2.5-VL ------------------------------------------------------------------------
QWEN_CHAT_TEMPLATE = chat_template("<|vision_start|><|image_pad|><|vision_end|>",
                                   "<|vision_start|><|video_pad|><|vision_end|>")
QWEN_SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


@dataclass(frozen=True)
class QwenShape:
    """Sizes of a Qwen2-VL / Qwen2.5-VL-layout model (ViT with a 2 x 2 merger + Qwen2). ``patch`` px
    patches, so an image of H x W px gives (H / 2 patch) x (W / 2 patch) tokens."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 4
    heads: int = 2  # head_dim 32 (vLLM's CPU attention has no kernel for 16); M-RoPE sections 4 / 6 / 6
    kv_heads: int = 1
    vocab: int = 96
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    patch: int = 4
    max_positions: int = 1024
    v25: bool = False  # Qwen2.5-VL (RMSNorm SwiGLU tower with window attention) instead of Qwen2-VL


def qwen_token_ids(shape: QwenShape) -> dict[str, int]:
    """Ids of the special tokens: the last ids of the vocabulary."""
    return {tok: shape.vocab - 7 + i for i, tok in enumerate(QWEN_SPECIAL)}


def build_qwen_tokenizer(shape: QwenShape):
    """Word-level tokenizer: ``<pad> <s> </s>``, words ``w3 ...``, ``user assistant :`` and Qwen's
    vision tokens as added special tokens (the processor writes ``<|image_pad|>`` N times unspaced)."""
    names = {i: tok for tok, i in qwen_token_ids(shape).items()}
    names.update({shape.vocab - 3: "user", shape.vocab - 2: "assistant", shape.vocab - 1: ":"})
    return word_tokenizer(shape.vocab, names, QWEN_CHAT_TEMPLATE,
                          {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}, added=QWEN_SPECIAL)


def qwen_config(config_class: type, shape: QwenShape, vision: dict, head_dim: int | None = None,
                mrope_interleaved: bool = False, text_extra: dict | None = None):
    """A Qwen-VL config of ``shape``: its decoder (M-RoPE sections 3/8, 3/8 of the half-dim for h, w, on the
    rotary half-dim; ``text_extra``: more of its keys), the ``vision`` tower and the special token ids."""
    half = shape.hidden // shape.heads // 2
    a = half * 3 // 8
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * a, a, a]}
    if mrope_interleaved:
        rope["mrope_interleaved"] = True
    text = dict(text_config(shape), tie_word_embeddings=False, rope_parameters=rope)
    if head_dim is not None:
        text["head_dim"] = head_dim
    text.update(text_extra or {})
    ids = qwen_token_ids(shape)
    return config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False)


def build_qwen_model(shape: QwenShape, seed: int = 0):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` (or 2.5) of ``shape`` (float32, eval)."""
    torch.manual_seed(seed)
    if shape.v25:
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(depth=shape.vision_layers, hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
                      num_heads=shape.vision_heads, out_hidden_size=shape.hidden, patch_size=shape.patch,
                      temporal_patch_size=2, spatial_merge_size=2, window_size=4 * shape.patch,
                      fullatt_block_indexes=[shape.vision_layers - 1], tokens_per_second=2)
    else:
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=shape.vision_layers, embed_dim=shape.vision_hidden, hidden_size=shape.hidden,
                      num_heads=shape.vision_heads, mlp_ratio=2, patch_size=shape.patch, temporal_patch_size=2,
                      spatial_merge_size=2)
    model = Model(qwen_config(Config, shape, vision)).eval()
    return sharpen(model, model.model.visual.merger)


def write_qwen2_vl(folder: str | Path, shape: QwenShape = QwenShape(), seed: int = 0) -> Path:
    """Save a random Qwen2-VL (``shape.v25``: Qwen2.5-VL) model with tokenizer and processor to ``folder``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    if shape.v25:
        from transformers import Qwen2_5_VLProcessor as Processor
    else:
        from transformers import Qwen2VLProcessor as Processor
    folder = Path(folder)
    build_qwen_model(shape, seed).save_pretrained(folder)
    unit = shape.patch * 2
    sizes = dict(size={"shortest_edge": unit * unit, "longest_edge": 64 * unit * unit}, patch_size=shape.patch,
                 temporal_patch_size=2, merge_size=2)
    proc = Processor(image_processor=Qwen2VLImageProcessor(**sizes), video_processor=Qwen2VLVideoProcessor(**sizes),
                     tokenizer=build_qwen_tokenizer(shape), chat_template=QWEN_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    return folder


# ---- LLaVA-OneVision ------------------------------------------------------------------------------
ONEVISION_TEMPLATE = chat_template("<image>", "<video>")


@dataclass(frozen=True)
class OnevisionShape(LlavaShape):
    """Sizes of a LLaVA-OneVision-layout model (SigLIP tower, anyres images, pooled video frames, Qwen2)."""

    patch: int = 4  # 8 x 8 tokens per tile, 4 x 4 per video frame
    max_positions: int = 384  # QuoTA's decoupling generates up to the model's room: keep it short

    @property
    def pinpoints(self) -> list[list[int]]:
        s = self.image_size
        return [[s, s], [s, 2 * s], [2 * s, s]]


def video_token_id(shape: OnevisionShape) -> int:
    return shape.vocab - 7


def build_onevision_tokenizer(shape: OnevisionShape):
    """The LLaVA-1.5 word-level tokenizer plus ``<video>`` at :func:`video_token_id`."""
    video_id = video_token_id(shape)
    names = {video_id - 3: "A", video_id - 2: "yes", video_id - 1: "no", video_id: "<video>"}  # QuoTA's answer words
    return word_tokenizer(shape.vocab, {**names, **llava_names(shape)}, ONEVISION_TEMPLATE,
                          {"image_token": "<image>", "video_token": "<video>"})


def build_onevision_model(shape: OnevisionShape, seed: int = 0):
    """A randomly initialised ``LlavaOnevisionForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config,
                              SiglipVisionConfig)

    torch.manual_seed(seed)
    text = Qwen2Config(**text_config(shape))
    vision = SiglipVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                                num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                                image_size=shape.image_size, patch_size=shape.patch)
    cfg = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_id=image_token_id(shape),
                               video_token_id=video_token_id(shape), image_grid_pinpoints=shape.pinpoints,
                               vision_feature_layer=-1, vision_feature_select_strategy="full")
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()
    return sharpen(model, model.model.multi_modal_projector)


def write_onevision(folder: str | Path, shape: OnevisionShape = OnevisionShape(), seed: int = 0) -> Path:
    """Save a random LLaVA-OneVision-layout model of ``shape`` with tokenizer and processor to ``folder``."""
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    folder = Path(folder)
    model = build_onevision_model(shape, seed)
    model.save_pretrained(folder)
    size = {"height": shape.image_size, "width": shape.image_size}
    proc = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=shape.pinpoints),
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        tokenizer=build_onevision_tokenizer(shape), num_image_tokens=(shape.image_size // shape.patch) ** 2,
        vision_feature_select_strategy="full", chat_template=ONEVISION_TEMPLATE,
    )
    proc.save_pretrained(folder)
    return folder


# ---- Qwen3-VL -------------------------------------------------------------------------------------
#: Qwen3-VL's processor writes "<t seconds>" before every temporal slice of a video: words for the
#: timestamps of a 2 fps video (slices of two frames: 0.25 s, 1.25 s, ... printed with one decimal)
QWEN3_TIMESTAMPS = tuple(f"<{t + 0.25:.1f}" for t in range(8)) + ("seconds>",)


@dataclass(frozen=True)
class Qwen3Shape(QwenShape):
    """Sizes of a Qwen3-VL-layout model (ViT with learned position embeddings, a 2 x 2 merger and
    DeepStack mergers after ``deepstack`` tower blocks, + Qwen3 with interleaved M-RoPE)."""

    vision_layers: int = 3
    deepstack: tuple[int, ...] = (0, 1)  # tower blocks whose features are added after decoder layers 0, 1


def qwen3_vision(shape: Qwen3Shape, deepstack: bool = True) -> dict:
    """Qwen3-VL's tower of ``shape`` (learned position embeddings, 2 x 2 merger; DeepStack mergers after
    ``shape.deepstack`` blocks, or none: Qwen3.5's)."""
    vision = dict(depth=shape.vision_layers, hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
                  num_heads=shape.vision_heads, out_hidden_size=shape.hidden, patch_size=shape.patch,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)
    if deepstack:
        vision["deepstack_visual_indexes"] = list(shape.deepstack)
    return vision


def build_qwen3_tokenizer(shape: Qwen3Shape):
    """Qwen2-VL's word-level tokenizer plus the timestamp words (:data:`QWEN3_TIMESTAMPS`)."""
    names = {i: tok for tok, i in qwen_token_ids(shape).items()}
    names.update({shape.vocab - 3: "user", shape.vocab - 2: "assistant", shape.vocab - 1: ":"})
    first = shape.vocab - 7 - len(QWEN3_TIMESTAMPS)
    names.update({first + i: word for i, word in enumerate(QWEN3_TIMESTAMPS)})
    return word_tokenizer(shape.vocab, names, QWEN_CHAT_TEMPLATE,
                          {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}, added=QWEN_SPECIAL)


def sharpen_qwen3(model: torch.nn.Module) -> torch.nn.Module:
    """:func:`sharpen`, and the DeepStack mergers scaled as the merger (their features must matter too)."""
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            for p in merger.parameters():
                p.mul_(4.0)
    return sharpen(model, model.model.visual.merger)


def build_qwen3_model(shape: Qwen3Shape, seed: int = 0):
    """A randomly initialised ``Qwen3VLForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    vision = qwen3_vision(shape)
    cfg = qwen_config(Qwen3VLConfig, shape, vision, head_dim=shape.hidden // shape.heads, mrope_interleaved=True)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    return sharpen_qwen3(model)


def write_qwen3_vl(folder: str | Path, shape: Qwen3Shape = Qwen3Shape(), seed: int = 0) -> Path:
    """Save a random Qwen3-VL model with tokenizer and processor (Qwen3-VL's processor classes) to ``folder``."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    folder = Path(folder)
    build_qwen3_model(shape, seed).save_pretrained(folder)
    unit = shape.patch * 2
    sizes = dict(size={"shortest_edge": unit * unit, "longest_edge": 64 * unit * unit}, patch_size=shape.patch,
                 temporal_patch_size=2, merge_size=2)
    # the video processor budgets the pixels of all frames together: room for 16 frames of 32 x 48 px
    video = dict(sizes, size={"shortest_edge": unit * unit, "longest_edge": 1024 * unit * unit})
    # images normalised as videos (mean = std = 0.5, as Qwen3-VL's checkpoints): vLLM 0.32 normalises both
    # on the device with the image processor's values (mm_device_do_normalize)
    half = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes, **half),
                            video_processor=Qwen3VLVideoProcessor(**video, cap_pixels_per_frame=False),
                            tokenizer=build_qwen3_tokenizer(shape), chat_template=QWEN_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    return folder


# ---- Gemma 3 --------------------------------------------------------------------------------------
#: Gemma 3's image markup (the processor writes "\n\n<start_of_image>" + 256 soft tokens + "<end_of_image>\n\n")
#: and the newline runs vLLM's Gemma 3 processor looks up in the vocabulary
GEMMA3_SPECIAL = ("<start_of_image>", "<image_soft_token>", "<end_of_image>", "\n", "\n\n", "\n\n\n", "\n\n\n\n")


@dataclass(frozen=True)
class Gemma3Shape(LlavaShape):
    """Sizes of a Gemma 3-layout model (SigLIP tower whose patch grid is average-pooled to
    ``tokens`` per image, + Gemma 3 with sliding-window and global layers)."""

    layers: int = 6
    patch: int = 4  # 8 x 8 patches per 32 px image, pooled 2 x 2 to 4 x 4 = 16 tokens
    tokens: int = 16  # mm_tokens_per_image (256 on the released checkpoints)
    sliding_window: int = 128  # covers the tests' prompts and answers


def gemma3_token_ids(shape: Gemma3Shape) -> dict[str, int]:
    """Ids of :data:`GEMMA3_SPECIAL` and ``user assistant :``: the last ids of the vocabulary."""
    names = GEMMA3_SPECIAL + ("user", "assistant", ":")
    return {tok: shape.vocab - len(names) + i for i, tok in enumerate(names)}


def build_gemma3_tokenizer(shape: Gemma3Shape):
    """Word-level tokenizer with Gemma 3's image tokens and newline runs as added special tokens."""
    names = {i: tok for tok, i in gemma3_token_ids(shape).items()}
    return word_tokenizer(shape.vocab, names, chat_template("<start_of_image>"),
                          {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                           "eoi_token": "<end_of_image>"}, added=GEMMA3_SPECIAL)


def build_gemma3_model(shape: Gemma3Shape, seed: int = 0):
    """A randomly initialised ``Gemma3ForConditionalGeneration`` of ``shape`` (float32, eval): layers
    sliding, sliding, global (x 2); the global layers' RoPE linearly scaled (factor 8, as the 4B-27B
    checkpoints), the sliding ones plain."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    ids = gemma3_token_ids(shape)
    text = Gemma3TextConfig(**text_config(shape), head_dim=shape.hidden // shape.heads,
                            query_pre_attn_scalar=shape.hidden // shape.heads, sliding_window=shape.sliding_window,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * (shape.layers // 3),
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1000000.0}},
                            tie_word_embeddings=False)
    vision = SiglipVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                                num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                                image_size=shape.image_size, patch_size=shape.patch)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=shape.tokens,
                       image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                       eoi_token_index=ids["<end_of_image>"], tie_word_embeddings=False)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initialises the projector to zeros: give the images a voice
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
        model.lm_head.weight.mul_(16.0)
    return model


def hub_naming(weights: Path) -> None:
    """Rename the vision tower's keys ``[model.]vision_tower.X``, as transformers 5 saves a SigLIP / CLIP
    tower, to the hub's ``[model.]vision_tower.vision_model.X`` (the naming vLLM's own classes load;
    transformers loads both)."""
    import re

    from safetensors.torch import load_file, save_file

    tower = re.compile(r"^((?:model\.)?vision_tower\.)(?!vision_model\.)")
    save_file({tower.sub(r"\1vision_model.", k): v for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})


def write_gemma3(folder: str | Path, shape: Gemma3Shape = Gemma3Shape(), seed: int = 0) -> Path:
    """Save a random Gemma 3-layout model of ``shape`` with tokenizer and processor to ``folder``, the
    tower's weights in the hub's naming (vLLM's own Gemma 3 loads no other; the plugin loads both)."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    folder = Path(folder)
    build_gemma3_model(shape, seed).save_pretrained(folder)
    hub_naming(folder / "model.safetensors")
    size = {"height": shape.image_size, "width": shape.image_size}
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessor(size=size), tokenizer=build_gemma3_tokenizer(shape),
                           image_seq_length=shape.tokens, chat_template=chat_template("<start_of_image>"))
    proc.save_pretrained(folder)
    return folder


# ---- Mistral 3 ------------------------------------------------------------------------------------
#: Pixtral's image tokens: a row of [IMG] per 2 x 2 merged patches, [IMG_BREAK] ending a row, [IMG_END] the image
MISTRAL3_SPECIAL = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


@dataclass(frozen=True)
class Mistral3Shape(LlavaShape):
    """Sizes of a Mistral 3-layout model (Pixtral tower at the image's own resolution, a 2 x 2 patch merger,
    + Mistral): ``patch`` px patches, so an image of H x W px (at most ``image_size`` a side) gives
    (H / 2 patch) x (W / 2 patch) tokens."""

    patch: int = 4
    image_size: int = 64


def build_mistral3_tokenizer(shape: Mistral3Shape):
    """Word-level tokenizer with Pixtral's image tokens as added special tokens."""
    names = {shape.vocab - 6 + i: tok for i, tok in enumerate(MISTRAL3_SPECIAL + ("user", "assistant", ":"))}
    return word_tokenizer(shape.vocab, names, chat_template("[IMG]"), {"image_token": "[IMG]"}, added=MISTRAL3_SPECIAL)


def build_mistral3_model(shape: Mistral3Shape, seed: int = 0):
    """A randomly initialised ``Mistral3ForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    torch.manual_seed(seed)
    text = MistralConfig(**text_config(shape), head_dim=shape.hidden // shape.heads, sliding_window=None,
                         tie_word_embeddings=False)
    vision = PixtralVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                                 num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                                 head_dim=shape.vision_hidden // shape.vision_heads, image_size=shape.image_size,
                                 patch_size=shape.patch)
    cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=shape.vocab - 6,
                         spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
    model = Mistral3ForConditionalGeneration(cfg).eval()
    return sharpen(model, model.model.multi_modal_projector)


def write_mistral3(folder: str | Path, shape: Mistral3Shape = Mistral3Shape(), seed: int = 0) -> Path:
    """Save a random Mistral 3-layout model of ``shape`` with tokenizer and processor to ``folder``."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    folder = Path(folder)
    build_mistral3_model(shape, seed).save_pretrained(folder)
    proc = PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": shape.image_size},
                                                                  patch_size=shape.patch),
                            tokenizer=build_mistral3_tokenizer(shape), patch_size=shape.patch, spatial_merge_size=2,
                            image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]",
                            chat_template=chat_template("[IMG]"))
    proc.save_pretrained(folder)
    return folder


# ---- InternVL (Hugging Face format) --------------------------------------------------------------
INTERNVL_SPECIAL = ("<IMG_CONTEXT>", "<img>", "</img>", "<video>")
INTERNVL_TEMPLATE = chat_template("<IMG_CONTEXT>", "<video>")


@dataclass(frozen=True)
class InternVLShape(LlavaShape):
    """Sizes of an ``InternVLForConditionalGeneration`` (InternViT + pixel shuffle 0.5 + Qwen2): 32 px
    tiles of 8 x 8 patches of 4 px, shuffled to 4 x 4 = 16 tokens a tile; an image is cut into up to
    ``max_tiles`` tiles plus a thumbnail (GotOcr2ImageProcessor's ``crop_to_patches``)."""

    patch: int = 4
    max_tiles: int = 4

    @property
    def tile_tokens(self) -> int:
        return (self.image_size // self.patch // 2) ** 2


def internvl_token_ids(shape: InternVLShape) -> dict[str, int]:
    """``<IMG_CONTEXT> <img> </img> <video>`` at ids vocab - 8 ... vocab - 5."""
    return {tok: shape.vocab - 8 + i for i, tok in enumerate(INTERNVL_SPECIAL)}


def build_internvl_tokenizer(shape: InternVLShape):
    names = {i: tok for tok, i in internvl_token_ids(shape).items()}
    names.update({shape.vocab - 3: "user", shape.vocab - 2: "assistant", shape.vocab - 1: ":"})
    media = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
             "video_token": "<video>"}
    return word_tokenizer(shape.vocab, names, INTERNVL_TEMPLATE, media, added=INTERNVL_SPECIAL)


def build_internvl_model(shape: InternVLShape, seed: int = 0):
    """A randomly initialised ``InternVLForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config

    torch.manual_seed(seed)
    text = Qwen2Config(**text_config(shape), architectures=["Qwen2ForCausalLM"])
    vision = InternVLVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                                  num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                                  image_size=(shape.image_size,) * 2, patch_size=(shape.patch,) * 2)
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=internvl_token_ids(shape)["<IMG_CONTEXT>"],
                         image_seq_length=shape.tile_tokens, downsample_ratio=0.5, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=False)
    model = InternVLForConditionalGeneration(cfg).eval()
    return sharpen(model, model.model.multi_modal_projector)


def write_internvl(folder: str | Path, shape: InternVLShape = InternVLShape(), seed: int = 0) -> Path:
    """Save a random InternVL (Hugging Face format) model with tokenizer and processor to ``folder``."""
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    folder = Path(folder)
    build_internvl_model(shape, seed).save_pretrained(folder)
    size = {"height": shape.image_size, "width": shape.image_size}
    proc = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1,
                                              max_patches=shape.max_tiles),
        video_processor=InternVLVideoProcessor(size=size), tokenizer=build_internvl_tokenizer(shape),
        image_seq_length=shape.tile_tokens, chat_template=INTERNVL_TEMPLATE)
    proc.save_pretrained(folder)
    return folder


# ---- GLM-4.1V -------------------------------------------------------------------------------------
GLM_SPECIAL = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
               "<|end_of_video|>")
GLM_CHAT_TEMPLATE = chat_template("<|begin_of_image|><|image|><|end_of_image|>",
                                  "<|begin_of_video|><|video|><|end_of_video|>")
#: GLM-4.1V's processor writes each temporal slice's whole second after it ("0", "1", ...): words for 8 s
GLM_TIMESTAMPS = tuple(str(t) for t in range(8))


def glm_token_ids(shape: QwenShape) -> dict[str, int]:
    """Ids of GLM-4.1V's image / video tokens: the ids before ``user assistant :`` at the vocabulary's end."""
    return {tok: shape.vocab - 3 - len(GLM_SPECIAL) + i for i, tok in enumerate(GLM_SPECIAL)}


def build_glm4v_tokenizer(shape: QwenShape):
    """Word-level tokenizer: GLM's image / video tokens as added special tokens, the timestamp words
    (:data:`GLM_TIMESTAMPS`) before them, ``user assistant :`` last."""
    names = {i: tok for tok, i in glm_token_ids(shape).items()}
    names.update({shape.vocab - 3: "user", shape.vocab - 2: "assistant", shape.vocab - 1: ":"})
    first = min(names) - len(GLM_TIMESTAMPS)
    names.update({first + i: word for i, word in enumerate(GLM_TIMESTAMPS)})
    return word_tokenizer(shape.vocab, names, GLM_CHAT_TEMPLATE,
                          {"image_token": "<|image|>", "video_token": "<|video|>"}, added=GLM_SPECIAL)


def build_glm4v_model(shape: QwenShape, seed: int = 0, moe: dict | None = None):
    """A randomly initialised ``Glm4vForConditionalGeneration`` of ``shape`` (float32, eval): GLM's tower
    (learned position embeddings interpolated to the grid, a 2 x 2 downsampling convolution and merger)
    and GLM-4's decoder with partial rotary (half of each head) on M-RoPE's three axes. ``moe``: GLM-4.5V's
    ``Glm4vMoeForConditionalGeneration`` with these MoE keys in its decoder's config."""
    if moe is None:
        from transformers import Glm4vConfig, Glm4vForConditionalGeneration
    else:
        from transformers import Glm4vMoeConfig as Glm4vConfig, Glm4vMoeForConditionalGeneration as Glm4vForConditionalGeneration

    torch.manual_seed(seed)
    head = shape.hidden // shape.heads
    a = head // 4 // 4  # M-RoPE sections of the rotary half-dim (head / 4): t 2a, h a, w a
    vision = dict(depth=shape.vision_layers, hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
                  num_heads=shape.vision_heads, out_hidden_size=shape.hidden, patch_size=shape.patch, image_size=32,
                  temporal_patch_size=2, spatial_merge_size=2)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [head // 4 - 2 * a, a, a],
            "partial_rotary_factor": 0.5}
    text = dict(text_config(shape), rope_parameters=rope, **(moe or {}))
    ids = glm_token_ids(shape)
    cfg = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                      video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                      image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                      video_end_token_id=ids["<|end_of_video|>"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    model = Glm4vForConditionalGeneration(cfg).eval()
    return sharpen(model, model.model.visual.merger)


def write_glm4v(folder: str | Path, shape: QwenShape = QwenShape(), seed: int = 0, moe: dict | None = None) -> Path:
    """Save a random GLM-4.1V model (``moe``: GLM-4.5V's MoE classes, build_glm4v_model) with tokenizer and
    processor (GLM-4.1V's processor classes) to ``folder``."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    folder = Path(folder)
    build_glm4v_model(shape, seed, moe).save_pretrained(folder)
    unit = shape.patch * 2
    sizes = dict(patch_size=shape.patch, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                 image_std=[0.5, 0.5, 0.5])  # one normalisation: vLLM 0.32 applies the image processor's to both
    image = Glm4vImageProcessor(size={"shortest_edge": unit * unit, "longest_edge": 64 * unit * unit}, **sizes)
    video = Glm4vVideoProcessor(size={"shortest_edge": unit * unit, "longest_edge": 1024 * unit * unit},
                                max_image_size={"longest_edge": 1024 * unit * unit}, **sizes)
    proc = Glm4vProcessor(image_processor=image, video_processor=video, tokenizer=build_glm4v_tokenizer(shape),
                          chat_template=GLM_CHAT_TEMPLATE)
    proc.save_pretrained(folder)
    return folder


# ---- Idefics3 / SmolVLM ---------------------------------------------------------------------------
IDEFICS3_SPECIAL = ("<image>", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>",
                    "<row_2_col_1>", "<row_2_col_2>", "<end_of_utterance>")


@dataclass(frozen=True)
class Idefics3Shape(LlavaShape):
    """Sizes of an ``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration`` (SigLIP-style
    tower + pixel shuffle 2 + Llama): 32 px tiles of 8 x 8 patches of 4 px, shuffled to 4 x 4 = 16 tokens
    a tile; images resized to at most ``longest_edge`` px and split into 32 px tiles plus a global tile
    (an image of at most 32 px is its global tile alone). ``smolvlm``: the SmolVLM classes."""

    patch: int = 4
    longest_edge: int = 64
    smolvlm: bool = False

    @property
    def tile_tokens(self) -> int:
        return (self.image_size // self.patch // 2) ** 2


def idefics3_token_ids(shape: Idefics3Shape) -> dict[str, int]:
    """The image tokens at ids vocab - 11 ... vocab - 4."""
    return {tok: shape.vocab - 11 + i for i, tok in enumerate(IDEFICS3_SPECIAL)}


def build_idefics3_tokenizer(shape: Idefics3Shape):
    names = {i: tok for tok, i in idefics3_token_ids(shape).items()}
    names.update({shape.vocab - 3: "user", shape.vocab - 2: "assistant", shape.vocab - 1: ":"})
    media = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
             "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
    return word_tokenizer(shape.vocab, names, chat_template("<image>"), media, added=IDEFICS3_SPECIAL)


def build_idefics3_model(shape: Idefics3Shape, seed: int = 0):
    """A randomly initialised ``Idefics3ForConditionalGeneration`` (``shape.smolvlm``: SmolVLM) (float32, eval)."""
    from transformers import LlamaConfig

    if shape.smolvlm:
        from transformers import SmolVLMConfig as Config, SmolVLMForConditionalGeneration as Model
        from transformers import SmolVLMVisionConfig as VisionConfig
    else:
        from transformers import Idefics3Config as Config, Idefics3ForConditionalGeneration as Model
        from transformers import Idefics3VisionConfig as VisionConfig
    torch.manual_seed(seed)
    text = LlamaConfig(**text_config(shape), tie_word_embeddings=False)
    vision = VisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                          num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                          image_size=shape.image_size, patch_size=shape.patch)
    cfg = Config(vision_config=vision, text_config=text, image_token_id=idefics3_token_ids(shape)["<image>"],
                 scale_factor=2, tie_word_embeddings=False, pad_token_id=0)
    model = Model(cfg).eval()
    return sharpen(model, model.model.connector)


def write_idefics3(folder: str | Path, shape: Idefics3Shape = Idefics3Shape(), seed: int = 0) -> Path:
    """Save a random Idefics3 (``shape.smolvlm``: SmolVLM, whose processor needs num2words) model with
    tokenizer and processor to ``folder``."""
    folder = Path(folder)
    build_idefics3_model(shape, seed).save_pretrained(folder)
    images = dict(size={"longest_edge": shape.longest_edge}, max_image_size={"longest_edge": shape.image_size},
                  do_image_splitting=True)
    tok, template = build_idefics3_tokenizer(shape), chat_template("<image>")
    if shape.smolvlm:
        from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

        video = SmolVLMVideoProcessor(size={"longest_edge": shape.image_size},
                                      max_image_size={"longest_edge": shape.image_size})
        proc = SmolVLMProcessor(image_processor=SmolVLMImageProcessor(**images), tokenizer=tok, video_processor=video,
                                image_seq_len=shape.tile_tokens, chat_template=template)
    else:
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        proc = Idefics3Processor(image_processor=Idefics3ImageProcessor(**images), tokenizer=tok,
                                 image_seq_len=shape.tile_tokens, chat_template=template)
    proc.save_pretrained(folder)
    return folder


# ---- LLaVA-NeXT -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlavaNextShape(LlavaShape):
    """Sizes of a LLaVA-NeXT-layout model (CLIP tower, anyres tiles, image_newline, Llama): three tower
    layers, so the feature layer (-2: layer 1) differs from HiRED's early layer (0)."""

    patch: int = 4  # 8 x 8 tokens per tile
    vision_layers: int = 3
    max_positions: int = 512

    @property
    def pinpoints(self) -> list[list[int]]:
        s = self.image_size
        return [[s, s], [s, 2 * s], [2 * s, s]]


def build_llava_next_model(shape: LlavaNextShape, seed: int = 0, video: bool = False):
    """A randomly initialised ``LlavaNextForConditionalGeneration`` of ``shape`` (float32, eval);
    ``video``: ``LlavaNextVideoForConditionalGeneration`` (frames pooled by 2, ``<video>`` at :func:`video_token_id`)."""
    import transformers
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    kind = "LlavaNextVideo" if video else "LlavaNext"
    extra = dict(video_token_id=video_token_id(shape), spatial_pool_stride=2, spatial_pool_mode="average") if video else {}
    cfg = getattr(transformers, f"{kind}Config")(
        vision_config=clip_config(shape), text_config=LlamaConfig(**text_config(shape)),
        image_token_id=image_token_id(shape), image_grid_pinpoints=shape.pinpoints, vision_feature_layer=-2,
        vision_feature_select_strategy="default", **extra)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()
    return sharpen(model, model.model.multi_modal_projector)


def write_llava_next(folder: str | Path, shape: LlavaNextShape = LlavaNextShape(), seed: int = 0,
                     video: bool = False) -> Path:
    """Save a random LLaVA-NeXT-layout model of ``shape`` with tokenizer and processor to ``folder``
    (``video``: LLaVA-NeXT-Video's, with its video processor and ``<video>`` token)."""
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor, LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor

    folder = Path(folder)
    build_llava_next_model(shape, seed, video).save_pretrained(folder)
    size = shape.image_size
    crop = {"height": size, "width": size}
    images = LlavaNextImageProcessor(size={"shortest_edge": size}, crop_size=crop, image_grid_pinpoints=shape.pinpoints)
    common = dict(image_processor=images, patch_size=shape.patch, vision_feature_select_strategy="default",
                  num_additional_image_tokens=1)
    if video:
        proc = LlavaNextVideoProcessor(video_processor=LlavaNextVideoVideoProcessor(size={"shortest_edge": size},
                                                                                    crop_size=crop),
                                       tokenizer=build_onevision_tokenizer(shape), chat_template=ONEVISION_TEMPLATE,
                                       **common)
    else:
        proc = LlavaNextProcessor(tokenizer=build_tokenizer(shape), chat_template=CHAT_TEMPLATE, **common)
    proc.save_pretrained(folder)
    return folder


# ---- LLaVA-NeXT-Video -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LlavaNextVideoShape(LlavaNextShape):
    """Sizes of a LLaVA-NeXT-Video-layout model: LLaVA-NeXT's, video frames pooled by 2 (4 x 4 tokens each)."""


def write_llava_next_video(folder: str | Path, shape: LlavaNextVideoShape = LlavaNextVideoShape(), seed: int = 0) -> Path:
    """Save a random LLaVA-NeXT-Video-layout model of ``shape`` with tokenizer and processor to ``folder``."""
    return write_llava_next(folder, shape, seed, video=True)

# ---- Qwen3.5 --------------------------------------------------------------------------------------
#: channels of a Gated DeltaNet head (keys and values) in the tiny Qwen3.5 models
LINEAR_HEAD = 128


def qwen3_5_config(config_class: type, shape: Qwen3Shape, text_extra: dict | None = None):
    """A Qwen3.5(-MoE) config of ``shape``: Qwen3-VL's tower without DeepStack; ``shape.layers`` decoder layers
    alternating Gated DeltaNet and full attention (the first linear), M-RoPE over the whole head."""
    vision = qwen3_vision(shape, deepstack=False)
    head = shape.hidden // shape.heads
    # linear heads of 128 channels: vLLM 0.32's CPU kernel of the gated delta rule takes no other size
    linear = dict(layer_types=["linear_attention", "full_attention"] * (shape.layers // 2), linear_conv_kernel_dim=4,
                  linear_key_head_dim=LINEAR_HEAD, linear_value_head_dim=LINEAR_HEAD, linear_num_key_heads=1,
                  linear_num_value_heads=2, **(text_extra or {}))
    cfg = qwen_config(config_class, shape, vision, head_dim=head, mrope_interleaved=True, text_extra=linear)
    cfg.text_config.rope_parameters["partial_rotary_factor"] = 1.0  # (Qwen3.5's default is 0.25)
    return cfg


def build_qwen3_5_model(shape: Qwen3Shape, seed: int = 0):
    """A randomly initialised ``Qwen3_5ForConditionalGeneration`` of ``shape`` (float32, eval): Qwen3-VL's
    tower without DeepStack, a decoder alternating Gated DeltaNet (linear attention) and full-attention
    layers (``shape.layers`` of them, the first linear)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(qwen3_5_config(Qwen3_5Config, shape)).eval()
    return sharpen(model, model.model.visual.merger)


def write_qwen3_5(folder: str | Path, shape: Qwen3Shape = Qwen3Shape(), seed: int = 0) -> Path:
    """Save a random Qwen3.5 model with tokenizer and processor (Qwen3-VL's processor classes, as
    Qwen3.5's checkpoints name them) to ``folder``."""
    folder = Path(folder)
    write_qwen3_vl(folder, shape, seed)  # the processor and tokenizer (the model is replaced below)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    build_qwen3_5_model(shape, seed).save_pretrained(folder)
    return folder


# ---- MoE language models, saved as the hub's checkpoints lay their experts out ---------------------
#: experts of the tiny MoE decoders: 4, two per token, 16 wide (no square weight: a transposed layout is unambiguous)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _rewrite_checkpoint(folder: Path, weights: Any, text_config: dict) -> None:
    """Rewrite a saved checkpoint's tensors (``weights``: name, tensor -> [(name, tensor)]) and add
    ``text_config``'s keys to its config.json."""
    import json

    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v.contiguous() for name, t in tensors.items() for k, v in weights(name, t)}, path,
                  metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(text_config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_qwen3_vl_moe(folder: str | Path, shape: Qwen3Shape = Qwen3Shape(), seed: int = 0) -> Path:
    """Save a random Qwen3-VL-MoE model (:data:`MOE` experts in every decoder layer) with tokenizer and processor
    to ``folder``, laid out as the hub's Qwen3-VL-MoE checkpoints: each layer's experts fused and transposed
    (``gate_up_proj`` [E, hidden, 2 * moe_intermediate], ``down_proj`` [E, moe_intermediate, hidden]; transformers 5
    transposes them on load, and vLLM 0.32 loads only this layout) and ``norm_topk_prob`` in the config (vLLM
    reads it; transformers 5's Qwen3-VL-MoE always renormalises the top-k weights, as true)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    folder = Path(folder)
    write_qwen3_vl(folder, shape, seed)  # the processor and tokenizer (the model is replaced below)
    torch.manual_seed(seed)
    vision = qwen3_vision(shape)
    cfg = qwen_config(Qwen3VLMoeConfig, shape, vision, head_dim=shape.hidden // shape.heads, mrope_interleaved=True,
                      text_extra=dict(MOE, decoder_sparse_step=1))
    model = Qwen3VLMoeForConditionalGeneration(cfg).eval()
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    sharpen_qwen3(model).save_pretrained(folder)

    def hub_layout(name: str, t: torch.Tensor) -> list:
        fused = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        return [(name, t.transpose(1, 2) if fused else t)]

    _rewrite_checkpoint(folder, hub_layout, {"norm_topk_prob": True})
    return folder


def write_qwen3_5_moe(folder: str | Path, shape: Qwen3Shape = Qwen3Shape(), seed: int = 0) -> Path:
    """Save a random Qwen3.5-MoE model (:data:`MOE` experts and a shared expert in every decoder layer) with
    tokenizer and processor to ``folder``, laid out as the hub's Qwen3.5-MoE checkpoints: one
    ``experts.<e>.gate_proj / up_proj / down_proj`` Linear weight per expert (transformers 5 fuses them on load)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    folder = Path(folder)
    write_qwen3_vl(folder, shape, seed)
    torch.manual_seed(seed)
    cfg = qwen3_5_config(Qwen3_5MoeConfig, shape, dict(MOE, shared_expert_intermediate_size=32))
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    sharpen(model, model.model.visual.merger).save_pretrained(folder)
    _rewrite_checkpoint(folder, per_expert, {})
    return folder


def per_expert(name: str, t: torch.Tensor) -> list:
    """transformers 5's fused experts of one layer as the hub's one Linear weight per expert:
    ``gate_up_proj`` [E, 2 * inter, hidden] (gate rows, then up rows), ``down_proj`` [E, hidden, inter]."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("mlp.experts.gate_up_proj"):
        inter = t.shape[1] // 2
        return [(f"{base}.{e}.{proj}.weight", t[e, i * inter : (i + 1) * inter])
                for e in range(t.shape[0]) for i, proj in enumerate(("gate_proj", "up_proj"))]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"{base}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


def write_glm4v_moe(folder: str | Path, shape: QwenShape = QwenShape(), seed: int = 0) -> Path:
    """Save a random GLM-4.5V model (``Glm4vMoeForConditionalGeneration``: :data:`MOE`'s routed experts, a shared
    expert, the first decoder layer dense) with tokenizer and processor to ``folder``, laid out as the hub's
    GLM-4.5V checkpoints: one Linear weight per expert (transformers 5 fuses them on load)."""
    moe = {"n_routed_experts": MOE["num_experts"], "num_experts_per_tok": MOE["num_experts_per_tok"],
           "moe_intermediate_size": MOE["moe_intermediate_size"], "n_shared_experts": 1, "first_k_dense_replace": 1,
           "head_dim": shape.hidden // shape.heads, "use_qk_norm": False}  # (the hub's configs state them; vLLM reads them)
    folder = write_glm4v(folder, shape, seed, moe=moe)
    _rewrite_checkpoint(folder, per_expert, {})
    return folder
