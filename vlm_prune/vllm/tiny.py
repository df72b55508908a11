"""Small LLaVA-1.5-layout checkpoints in the hub's naming, written to a folder vLLM can load.

No hub here: tests and ``vlm-prune bench --serve`` build randomly initialised models from the real
transformers config classes and save them with ``save_pretrained`` (keys
``model.vision_tower.vision_model.*`` as on the hub), with a word-level tokenizer whose vocabulary
covers every id of the model (``w<i>`` words, ``<image>`` at the image token id) and a real
``LlavaProcessor``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} :"
    "{% if message['content'] is string %} {{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %} <image>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


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


def build_tokenizer(shape: LlavaShape):
    """Word-level tokenizer: ``<pad> <s> </s>``, words ``w3 ...``, ``<image>`` at the image token id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    image_id = image_token_id(shape)
    names = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, shape.vocab)]
    names[image_id] = "<image>"
    names[image_id + 1] = "user"
    names[image_id + 2] = "assistant"
    names[image_id + 3] = ":"
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>", extra_special_tokens={"image_token": "<image>"},
                                   chat_template=CHAT_TEMPLATE)


def build_model(shape: LlavaShape, seed: int = 0):
    """A randomly initialised ``LlavaForConditionalGeneration`` of ``shape`` (float32, eval)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                       max_position_embeddings=shape.max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = CLIPVisionConfig(hidden_size=shape.vision_hidden, intermediate_size=shape.vision_intermediate,
                              num_hidden_layers=shape.vision_layers, num_attention_heads=shape.vision_heads,
                              image_size=shape.image_size, patch_size=shape.patch, projection_dim=shape.vision_hidden)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id(shape),
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random init draws small weights: make the vision features matter, and the
        for p in model.model.multi_modal_projector.parameters():  # next-token distributions peaked
            p.mul_(4.0)                                            # (greedy decoding far from ties)
        model.lm_head.weight.mul_(16.0)
    return model


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
