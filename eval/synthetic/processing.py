"""Tokenizer and processors of the synthetic benchmark, built from the real libraries.

A ``tokenizers`` WordLevel model over the benchmark's closed vocabulary, wrapped as a
transformers ``PreTrainedTokenizerFast`` (left padding, chat template), inside the real
``LlavaProcessor`` (CLIP image processor, 64x64, patch 8) or ``LlavaOnevisionProcessor``
(its image and video processors, 32x32 frames, patch 8).
"""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from vlm_prune.eval.synthetic.scenes import COLOURS, COUNTS, DIGITS, FRAME_SIZE, IMAGE_SIZE, KINDS

PATCH_SIZE = 8
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "<video>"]
WORDS = sorted(
    {"user", "assistant", ":", "?", "what", "colour", "is", "the", "shape", "there", "a", "coloured",
     "left", "or", "right", "how", "many", "shapes", "are", "kind", "yes", "no", "of", "background",
     "which", "digit", "came", "first", "times", "does", "appear"}
    | set(COLOURS) | set(KINDS) | set(COUNTS) | set(DIGITS)
)
# role: [<image>|<video>] text ... ; the generation prompt ends with "assistant :"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }} :"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %} <image>{% elif part['type'] == 'video' %} <video>"
    "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """WordLevel tokenizer over SPECIAL_TOKENS + WORDS, whitespace pre-tokenised, left padding."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    return tok


def build_processor(kind: str) -> LlavaProcessor | LlavaOnevisionProcessor:
    """The processor of the ``kind`` ("image" | "video") model, ready for ``save_pretrained``."""
    tokenizer = build_tokenizer()
    if kind == "image":
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=PATCH_SIZE,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=CHAT_TEMPLATE,
        )
    if kind == "video":
        size = {"height": FRAME_SIZE, "width": FRAME_SIZE}
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=[[FRAME_SIZE, FRAME_SIZE]]),
            video_processor=LlavaOnevisionVideoProcessor(size=size),
            tokenizer=tokenizer,
            num_image_tokens=(FRAME_SIZE // PATCH_SIZE) ** 2,
            vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_1",
            chat_template=CHAT_TEMPLATE,
        )
    raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")


def prompt(processor: LlavaProcessor | LlavaOnevisionProcessor, question: str, media: str) -> str:
    """The chat-template prompt for one question about an "image" or a "video"."""
    conversation = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
