"""Test helpers of the eval harness: a tiny LLaVA-OneVision checkpoint with its processor, and
real MP4 / PNG media written with OpenCV."""
from __future__ import annotations

import os

import cv2
import numpy as np
import torch

FRAME = 48  # processor frame size; patch 8 -> 6 x 6 patches -> 3 x 3 = 9 pooled tokens per frame
WORDS = ["user", "assistant", "what", "is", "the", "answer", "colour", "of", "shape", "red", "green",
         "blue", "A", "B", "C", "D", "E", ".", "?", "letter", "option"]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "<video>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} :"
    "{% if message['content'] is string %} {{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %} <image>"
    "{% elif part['type'] == 'video' %} <video>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
                              LlavaOnevisionVideoProcessor, PreTrainedTokenizerFast)

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"}, padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    size = {"height": FRAME, "width": FRAME}
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=[[FRAME, FRAME]]),
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        tokenizer=tok, num_image_tokens=(FRAME // 8) ** 2, vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE, vision_aspect_ratio="anyres_max_1",
    )


def build_model(seed: int = 0):
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config,
                              SiglipVisionConfig)

    vocab = len(SPECIAL) + len(WORDS)
    cfg = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=FRAME, patch_size=8),
        text_config=Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_id=SPECIAL.index("<image>"), video_token_id=SPECIAL.index("<video>"),
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_grid_pinpoints=[[FRAME, FRAME]], vision_aspect_ratio="anyres_max_1",
    )
    torch.manual_seed(seed)
    return LlavaOnevisionForConditionalGeneration(cfg).eval()


def save_tiny_checkpoint(path: str) -> str:
    """Write the tiny model and its processor to ``path`` (a folder --model can load)."""
    build_model().save_pretrained(path)
    build_processor().save_pretrained(path)
    return path


def write_video(path: str, n_frames: int = 12, fps: float = 6.0, seed: int = 0, size: tuple[int, int] = (40, 56)) -> str:
    """A real MP4 (mp4v) of coloured noise with a moving square."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    h, w = size
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    rng = np.random.default_rng(seed)
    for t in range(n_frames):
        frame = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
        frame[8:20, 2 + 3 * t: 14 + 3 * t] = (0, 0, 255)
        writer.write(frame)
    writer.release()
    return path


def write_image(path: str, seed: int = 0) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    cv2.imwrite(path, img)
    return path
