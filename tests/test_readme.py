"""Every ```python block of README.md runs, in order and in one namespace, from the checkout's
root, and so do the blocks of the user guide pages that use no vLLM (docs/wrapping.md, docs/vit.md,
docs/video.md, in one namespace of their own), with the shipped tiny models (and a tiny random CLIP)
in place of the hub checkpoints."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("timm", reason="the README's ViT snippets need timm: pip install -e '.[vit]'")
pytest.importorskip("cv2", reason="KeyScore (STACFP) needs OpenCV: pip install -e '.[video]'")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    """A tiny random CLIP checkpoint folder (what `encoder=clip_dir` points to in the README)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = CLIPConfig(
        text_config={**tower, "vocab_size": 64, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1},
        vision_config={**tower, "image_size": 32, "patch_size": 8}, projection_dim=8,
    )
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(cfg).save_pretrained(path)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=CLIPTokenizer()).save_pretrained(path)
    return str(path)


#: the guide pages whose snippets run here, in this order (the later ones use the earlier ones' names)
GUIDE_PAGES = ("wrapping.md", "vit.md", "video.md")


def run_blocks(text: str, substitutions: dict[str, str], namespace: dict) -> None:
    """Run every python block of ``text`` in ``namespace`` after the substitutions (each must occur)."""
    code = "\n".join(python_blocks(text))
    for old, new in substitutions.items():
        assert old in code, f"the page no longer contains {old}: update the substitutions"
        code = code.replace(old, new)
    exec(compile(code, "snippets", "exec"), namespace)  # noqa: S102 - the pages are ours


def test_readme_python_snippets_run(monkeypatch, capsys):
    from vlm_prune.eval.synthetic import model_path

    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    # the shipped OneVision toy in place of LLaVA-OneVision-0.5B
    run_blocks((ROOT / "README.md").read_text(),
               {'"llava-hf/llava-onevision-qwen2-0.5b-ov-hf"': repr(str(model_path("video")))}, namespace)
    import vlm_prune

    assert not vlm_prune.api.is_wrapped(namespace["model"])
    out = capsys.readouterr().out
    assert namespace["sample"].question in out  # the quick start prints the question and the pruned answer
    assert "[16]" in out  # 16 of the toy's 64 visual tokens at keep=0.25


def substitutions(clip_dir: str) -> dict[str, str]:
    """Guide text -> what runs here (each must occur, so the test follows the pages' edits)."""
    from vlm_prune.eval.synthetic import model_path

    return {
        '"llava-hf/llava-onevision-qwen2-7b-ov-hf"': repr(str(model_path("video"))),  # the shipped OneVision toy
        '"llava-hf/llava-onevision-qwen2-0.5b-ov-hf"': repr(str(model_path("video"))),
        "pretrained=True": "pretrained=False",  # no hub here: random weights
        "steps=200": "steps=2, progress=False",
        '"clip.mp4"': repr(str(ROOT / "demo" / "examples" / "synthetic_clip.mp4")),
        "encoder=clip_dir": f"encoder={clip_dir!r}",
    }


def test_guide_python_snippets_run(clip_dir, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    text = "\n".join((ROOT / "docs" / page).read_text() for page in GUIDE_PAGES)
    # names the pages leave to the reader's own data
    namespace = {"loader": [(torch.randn(2, 3, 224, 224), torch.tensor([0, 1]))]}
    run_blocks(text, substitutions(clip_dir), namespace)
    import vlm_prune

    assert not vlm_prune.api.is_wrapped(namespace["model"])
    assert namespace["sel"].indices.size == 8 or namespace["sel"].indices.size == len(namespace["sel"].candidates)
    assert capsys.readouterr().out.strip() != ""  # the first snippet prints the pruned answer
