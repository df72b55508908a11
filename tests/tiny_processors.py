"""Real processors of the issue-29 families on tiny word-level tokenizers whose special tokens sit at
the tiny models' ids (tests/tiny_models*.py), so a tiny model and its processor saved to a folder load
through the entry points (`vlm-prune eval / bench / demo --model`, the lmms-eval plugin) as a real
checkpoint does."""
from __future__ import annotations

import tiny_models_llavalike as L
import tiny_models_qwen3 as Q
from tiny_models import IMAGE_TOKEN, VIDEO_TOKEN, VOCAB

WORDS = ["user", "assistant", "User:", "Assistant:", "what", "is", "the", "colour", "shape", "?", "A", "B", "C", "D",
         "E", "red", "green", "blue", "yes", "no", "Answer", "with", "one", "word:", "circle", "square", "."]

#: a generic chat template: "<role> : <media tokens> text" per message, then "assistant :"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} :"
    "{% if message['content'] is string %} {{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %} {IMAGE}"
    "{% elif part['type'] == 'video' %} {VIDEO}{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def tokenizer(specials: dict[str, int], named: dict[str, str], template: str):
    """A word-level PreTrainedTokenizerFast of VOCAB ids: ``specials`` (token -> id) at their ids,
    :data:`WORDS` and fillers elsewhere; ``named``: extra special-token attributes
    (``image_token`` -> "<image>" ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab = {**base, **specials}
    free = [i for i in range(VOCAB) if i not in vocab.values()]
    vocab.update({w: i for w, i in zip(WORDS, free)})
    vocab.update({f"<unused{i}>": i for i in range(VOCAB) if i not in vocab.values()})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", extra_special_tokens=named, padding_side="left",
                                  chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in named.values()]})
    return tok


#: the pixels of a whole video (Qwen3-VL's and GLM's video processors budget all frames together): 16
#: frames of 32 x 32 px, 16 tokens a temporal slice of 2 frames
VIDEO_PIXELS = {"shortest_edge": 32 * 32, "longest_edge": 16 * 32 * 32}


def _template(image: str, video: str = "") -> str:
    return TEMPLATE.replace("{IMAGE}", image).replace("{VIDEO}", video)


def _patch_merging(processor_cls, image_cls, video_cls, ids: dict[str, int], names: dict[str, str], image: str,
                   video: str):
    """A Qwen2-VL-style processor: 32 px images -> 8 x 8 patches of 4 px, merged 2 x 2 -> 16 tokens;
    a video's frames share :data:`VIDEO_PIXELS`."""
    template = _template(image, video)
    pixels = {"shortest_edge": 32 * 32, "longest_edge": 32 * 32}
    patches = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    return processor_cls(image_processor=image_cls(size=pixels, **patches),
                         video_processor=video_cls(size=VIDEO_PIXELS, **patches),
                         tokenizer=tokenizer(ids, names, template), chat_template=template)


def qwen3_vl_processor():
    """Qwen3VLProcessor (Qwen3-VL, Qwen3.5)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    names = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
             "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
    ids = {"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN, "<|vision_start|>": Q.VISION_START,
           "<|vision_end|>": Q.VISION_END}
    return _patch_merging(Qwen3VLProcessor, Qwen2VLImageProcessor, Qwen3VLVideoProcessor, ids, names,
                          "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>")


def glm4v_processor():
    """Glm4vProcessor (GLM-4.1V): video frames with the image placeholder."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    names = {"image_token": "<|image|>", "video_token": "<|video|>"}
    ids = {"<|image|>": IMAGE_TOKEN, "<|video|>": VIDEO_TOKEN, "<|begin_of_image|>": Q.IMAGE_START,
           "<|end_of_image|>": Q.IMAGE_END, "<|begin_of_video|>": Q.VISION_START, "<|end_of_video|>": Q.VISION_END}
    return _patch_merging(Glm4vProcessor, Glm4vImageProcessor, Glm4vVideoProcessor, ids, names,
                          "<|begin_of_image|><|image|><|end_of_image|>", "<|begin_of_video|><|video|><|end_of_video|>")


def mistral3_processor():
    """PixtralProcessor (Mistral 3): images up to 64 px, 4 px patches merged 2 x 2 -> 8 px a token;
    [IMG_BREAK] after each row, [IMG_END] after the image."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    ids = {"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": L.IMG_BREAK, "[IMG_END]": L.IMG_END}
    template = _template("[IMG]")
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 32}, patch_size={"height": 8, "width": 8}),
        tokenizer=tokenizer(ids, {"image_token": "[IMG]"}, template), patch_size=4, spatial_merge_size=2,
        image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]", chat_template=template)


def internvl_processor():
    """InternVLProcessor: 32 px tiles (no cropping into more tiles) -> 16 tokens between <img> and
    </img>; a video's frames are written as images ("Frame1: <img>...</img>")."""
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    names = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    ids = {"<IMG_CONTEXT>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN, "<img>": L.IMG_BREAK, "</img>": L.IMG_END}
    template = _template("<IMG_CONTEXT>", "<video>")
    size = {"height": 32, "width": 32}
    return InternVLProcessor(image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False),
                             video_processor=InternVLVideoProcessor(size=size),
                             tokenizer=tokenizer(ids, names, template), image_seq_length=16, chat_template=template)


def llava_next_video_processor():
    """LlavaNextVideoProcessor: 32 px images (anyres tiles of the tiny model's pinpoints) and 32 px
    frames pooled 2 x 2 -> 4 tokens a frame."""
    from transformers import LlavaNextImageProcessor, LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor

    names = {"image_token": "<image>", "video_token": "<video>"}
    ids = {"<image>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN}
    template = _template("<image>", "<video>")
    size = {"height": 32, "width": 32}
    return LlavaNextVideoProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size=size,
                                                image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]]),
        video_processor=LlavaNextVideoVideoProcessor(size={"shortest_edge": 32}, crop_size=size),
        tokenizer=tokenizer(ids, names, template), patch_size=8, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=template)


def gemma3_processor():
    """Gemma3Processor: 32 px images -> 16 tokens between <start_of_image> and <end_of_image>."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    names = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    ids = {"<image_soft_token>": IMAGE_TOKEN, "<start_of_image>": L.IMG_BREAK, "<end_of_image>": L.IMG_END}
    template = _template("<start_of_image>")
    return Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}),
                           tokenizer=tokenizer(ids, names, template), image_seq_length=16, chat_template=template)


def onevision15_processor():
    """LLaVA-OneVision-1.5's processor (transformers maps it to Exaone4_5_Processor): Qwen2-VL image
    and video processors, 4 px patches merged 2 x 2, no temporal patch."""
    from transformers import Exaone4_5_Processor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    names = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    ids = {"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN, "<|vision_start|>": L.IMG_BREAK,
           "<|vision_end|>": L.IMG_END}
    template = _template("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>")
    pixels = {"shortest_edge": 32 * 32, "longest_edge": 32 * 32}
    return Exaone4_5_Processor(
        image_processor=Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=1, size=pixels),
        video_processor=Qwen2VLVideoProcessor(patch_size=4, merge_size=2, temporal_patch_size=1,
                                              size={"shortest_edge": 16 * 16, "longest_edge": 16 * 16}),
        tokenizer=tokenizer(ids, names, template), chat_template=template)


def videollama3_processor():
    """VideoLlama3Processor: Qwen-style placeholders; 4 px patches, images merged 2 x 2 (32 px -> 16
    tokens)."""
    from transformers import VideoLlama3ImageProcessor, VideoLlama3Processor, VideoLlama3VideoProcessor

    names = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    ids = {"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": VIDEO_TOKEN}
    template = _template("<|image_pad|>", "<|video_pad|>")
    pixels = {"shortest_edge": 32 * 32, "longest_edge": 32 * 32}
    return VideoLlama3Processor(
        image_processor=VideoLlama3ImageProcessor(patch_size=4, merge_size=2, size=pixels),
        video_processor=VideoLlama3VideoProcessor(patch_size=4, merge_size=2, size=VIDEO_PIXELS),
        tokenizer=tokenizer(ids, names, template), chat_template=template)


#: family -> (tiny model builder, processor builder, media the family takes)
FAMILIES = {
    "mistral3": (L.tiny_mistral3, mistral3_processor, ("image",)),
    "internvl": (L.tiny_internvl, internvl_processor, ("image", "video")),
    "llava_next_video": (L.tiny_llava_next_video, llava_next_video_processor, ("image", "video")),
    "gemma3": (L.tiny_gemma3, gemma3_processor, ("image",)),
    "llava_onevision15": (L.tiny_onevision15, onevision15_processor, ("image", "video")),
    "qwen3_vl": (Q.tiny_qwen3_vl, qwen3_vl_processor, ("image", "video")),
    "qwen3_5": (Q.tiny_qwen3_5, qwen3_vl_processor, ("image", "video")),
    "glm4v": (Q.tiny_glm4v, glm4v_processor, ("image", "video")),
    "smolvlm": (L.tiny_smolvlm, L.smolvlm_processor, ("image", "video")),
    "idefics3": (L.tiny_idefics3, lambda: L.smolvlm_processor(idefics3=True), ("image",)),
    # its processor takes videos, the adapter refuses them (the model's own token compression)
    "videollama3": (L.tiny_videollama3, videollama3_processor, ("image",)),
}


def family_of(name: str) -> str:
    """The adapter family of a :data:`FAMILIES` entry (Idefics3 is the smolvlm adapter's)."""
    return {"idefics3": "smolvlm"}.get(name, name)
