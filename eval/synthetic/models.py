"""The two tiny VLMs of the synthetic benchmark, built from the real transformers classes.

image: LlavaForConditionalGeneration, CLIP tower (2 x 96, patch 8, 64x64 -> 64 tokens + CLS)
       and a Llama decoder (6 x 128).
video: LlavaOnevisionForConditionalGeneration, SigLIP tower (2 x 96, patch 8, 32x32 frames ->
       16 patches, pooled 2x2 by the model to 4 tokens per frame, 16 frames -> 65 tokens with
       the newline) and a Qwen2 decoder (6 x 128).
Six decoder layers let the in-LLM methods prune at their own default layers (FastV K=2, PACT 4).
BENCHMARKS.md has the training commands. Trained weights ship as float16 safetensors under
eval/synthetic/models/{image,video} (training seed 0) and {image,video}-seed<N> (further seeds),
each with ``synthetic.json``: the task families it answers and how it was trained.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2Config,
    SiglipVisionConfig,
)

from vlm_prune.eval.synthetic.processing import PATCH_SIZE, build_tokenizer
from vlm_prune.eval.synthetic.scenes import FRAME_SIZE, IMAGE_SIZE

MODELS_DIR = Path(__file__).resolve().parent / "models"
_VISION = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, patch_size=PATCH_SIZE)
_TEXT = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=512, tie_word_embeddings=False,
)


def build_model(kind: str) -> PreTrainedModel:
    """A randomly initialised model of ``kind`` ("image" | "video") with the benchmark vocabulary."""
    tok = build_tokenizer()
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    image_id, video_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<video>")
    if kind == "image":
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(image_size=IMAGE_SIZE, projection_dim=96, **_VISION),
            text_config=LlamaConfig(**_TEXT, **ids),
            image_token_id=image_id,
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
        )
        model = LlavaForConditionalGeneration(config)
    elif kind == "video":
        config = LlavaOnevisionConfig(
            vision_config=SiglipVisionConfig(image_size=FRAME_SIZE, **_VISION),
            text_config=Qwen2Config(**_TEXT, **ids),
            image_token_id=image_id,
            video_token_id=video_id,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            vision_aspect_ratio="anyres_max_1",
            image_grid_pinpoints=[[FRAME_SIZE, FRAME_SIZE]],
        )
        model = LlavaOnevisionForConditionalGeneration(config)
    else:
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def model_path(kind: str, seed: int = 0) -> Path:
    """Directory of the shipped ``kind`` ("image" | "video") model trained with ``seed``, and its processor.

    Seed 0 lives in ``models/<kind>``, further training seeds in ``models/<kind>-seed<N>``.
    """
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    return MODELS_DIR / (kind if seed == 0 else f"{kind}-seed{seed}")


def shipped_seeds(kind: str) -> list[int]:
    """The training seeds of ``kind`` whose weights ship with the package, in order."""
    return [s for s in range(16) if (model_path(kind, s) / "model.safetensors").exists()]


#: what models shipped before the task families answer (their folders carry no synthetic.json)
LEGACY_QTYPES: dict[str, tuple[str, ...]] = {"image": ("colour", "exist", "position"), "video": ("colour", "exist")}


def model_card(kind: str, seed: int = 0) -> dict[str, Any]:
    """The training record ``synthetic.json`` beside a shipped model ({} for older models)."""
    path = model_path(kind, seed) / "synthetic.json"
    return json.loads(path.read_text()) if path.exists() else {}


def trained_qtypes(kind: str, seed: int = 0) -> tuple[str, ...]:
    """The question families the shipped ``kind`` model of ``seed`` answers (what to test it on)."""
    return tuple(model_card(kind, seed).get("eval_qtypes", LEGACY_QTYPES[kind]))


def load(kind: str, seed: int = 0) -> tuple[PreTrainedModel, ProcessorMixin]:
    """The shipped trained model (eval mode, float32) of ``kind`` and training ``seed``, and its processor, offline."""
    path = model_path(kind, seed)
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(
            f"no trained {kind} model for seed {seed} at {path} (shipped seeds: {shipped_seeds(kind)}); train it with "
            f"`python -m vlm_prune.eval.synthetic.train --kind {kind} --seed {seed}`"
        )
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return model.eval(), processor
