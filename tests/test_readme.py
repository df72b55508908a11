"""Every ```python block of README.md runs, in order and in one namespace, from the checkout's
root, with the shipped tiny models (and a tiny random CLIP) in place of the hub checkpoints."""
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


def substitutions(clip_dir: str) -> dict[str, str]:
    """README text -> what runs here (each must occur, so the test follows README edits)."""
    from vlm_prune.eval.synthetic import model_path

    return {
        '"llava-hf/llava-onevision-qwen2-7b-ov-hf"': repr(str(model_path("video"))),  # the shipped OneVision toy
        "pretrained=True": "pretrained=False",  # no hub here: random weights
        "steps=200": "steps=2, progress=False",
        '"clip.mp4"': repr(str(ROOT / "demo" / "examples" / "synthetic_clip.mp4")),
        "encoder=clip_dir": f"encoder={clip_dir!r}",
    }


def test_readme_python_snippets_run(clip_dir, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = "\n".join(python_blocks((ROOT / "README.md").read_text()))
    for old, new in substitutions(clip_dir).items():
        assert old in code, f"README no longer contains {old}: update the substitutions"
        code = code.replace(old, new)
    # names the README leaves to the reader's own data
    namespace = {"loader": [(torch.randn(2, 3, 224, 224), torch.tensor([0, 1]))]}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README is ours
    import vlm_prune

    assert not vlm_prune.api.is_wrapped(namespace["model"])
    assert namespace["sel"].indices.size == 8 or namespace["sel"].indices.size == len(namespace["sel"].candidates)
    assert capsys.readouterr().out.strip() != ""  # the first snippet prints the pruned answer
