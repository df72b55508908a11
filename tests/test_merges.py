"""Which tokens merged into which: the ``merged_into`` of merging stages' last_stats records
(PACT in the LLM, ToMe in the CLIP tower, VisionZip after it) reproduces the merged features on
tiny models, and methods that only keep / drop report none."""
from __future__ import annotations

import pytest
import torch
from tiny_models import (
    IMAGE_TOKEN,
    llava_inputs,
    onevision_video_inputs,
    tiny_llava,
    tiny_onevision,
)

import vlm_prune
from vlm_prune.methods.pact import PACT
from vlm_prune.methods.tome import (
    ToMe,
    bipartite_matching,
    merge_matched,
    merged_positions,
)
from vlm_prune.methods.visionzip import VisionZip


def groups(into: list[int]) -> dict[int, list[int]]:
    """slot -> the tokens merged into the token at that slot (dropped tokens left out)."""
    out: dict[int, list[int]] = {}
    for j, g in enumerate(into):
        if g >= 0:
            out.setdefault(g, []).append(j)
    return out


def record_of(model, stage: str) -> dict:
    return next(r for r in model.vlm_prune.last_stats["stages"] if r["stage"] == stage)


def capture(layer: torch.nn.Module, pre: bool) -> list[torch.Tensor]:
    """Hidden states entering (pre) or leaving a decoder layer, appended on every call."""
    seen: list[torch.Tensor] = []
    if pre:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    else:
        layer.register_forward_hook(lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).detach().clone()))
    return seen


def image_slots(inputs: dict, b: int) -> torch.Tensor:
    """Input columns of sample b's image tokens, in order."""
    return torch.nonzero((inputs["input_ids"][b] == IMAGE_TOKEN) & inputs["attention_mask"][b].bool()).squeeze(1)


def rows_at(model, inputs: dict, b: int, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
    """Image token number -> the row of ``hidden`` (after the last reduction) at its input column."""
    cols = image_slots(inputs, b).tolist()
    origin = model.vlm_prune.last_rows[b].tolist()
    return {cols.index(o): hidden[b, r] for r, o in enumerate(origin) if o in cols}


@torch.no_grad()
def test_pact_rows_are_the_mean_of_their_members():
    model, inputs = tiny_llava(), llava_inputs()
    before, after = capture(model.model.language_model.layers[3], pre=False), capture(model.model.language_model.layers[4], pre=True)
    vlm_prune.wrap(model, PACT(layer=4), keep=0.25)
    model(**inputs)
    rec = record_of(model, "llm")
    assert len(rec["merged_into"]) == 2
    for b, into in enumerate(rec["merged_into"]):
        g = groups(into)
        assert len(g) == rec["tokens_out"][b] and len(into) == rec["tokens_in"][b]
        assert any(len(m) > 1 for m in g.values())  # something merged
        kept = rows_at(model, inputs, b, after[0])
        assert set(kept) == set(g)
        cols = image_slots(inputs, b)
        for slot, members in g.items():
            assert slot in members  # a cluster sits at its centre's slot, the centre is a member
            torch.testing.assert_close(kept[slot], before[0][b, cols[members]].mean(0), atol=1e-5, rtol=1e-5)


def test_tome_positions_compose_like_the_merged_features():
    """One-hot tokens merged block after block: each output token's non-zero entries are exactly
    the original tokens merged_positions (composed) sends to it."""
    g = torch.Generator().manual_seed(0)
    n, p = 17, 1
    x, sizes = torch.eye(n)[None].repeat(2, 1, 1), torch.ones(2, n)
    members = torch.arange(n).expand(2, n)
    for r in (5, 4, 2):
        match = bipartite_matching(torch.randn(2, x.shape[1], 6, generator=g), r, p)
        members = merged_positions(x.shape[1], *match, p).gather(1, members)
        x, sizes = merge_matched(x, sizes, *match, n_prefix=p)
    for b in range(2):
        for i in range(x.shape[1]):
            expect = (members[b] == i).float()
            torch.testing.assert_close(x[b, i], expect / expect.sum())
            assert sizes[b, i] == expect.sum()


def deep_llava(identity_blocks: bool):
    """tiny_llava with a 4-layer CLIP tower (3 blocks up to the feature layer); with
    ``identity_blocks`` every block leaves its input unchanged (attention output and MLP zeroed),
    so merged tokens are plain means of the patch embeddings they stand for."""
    from tiny_models import _llama
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                     num_attention_heads=2, image_size=32, patch_size=8),
                      text_config=_llama(), image_token_id=IMAGE_TOKEN, vision_feature_layer=-2,
                      vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(cfg).eval()
    if identity_blocks:
        with torch.no_grad():
            for layer in model.model.vision_tower.encoder.layers:
                for lin in (layer.self_attn.out_proj, layer.mlp.fc2):
                    lin.weight.zero_()
                    lin.bias.zero_()
    return model


@torch.no_grad()
def test_tome_members_reproduce_the_merged_image_tokens():
    model, inputs = deep_llava(identity_blocks=True), llava_inputs()
    tower = model.model.vision_tower
    patches = tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[0][:, 1:]  # block-0 input
    seen = capture(model.model.language_model.layers[0], pre=True)
    vlm_prune.wrap(model, ToMe(r=3))
    model(**inputs)
    rec = record_of(model, "vit")
    assert rec["tokens_per_layer"] == [17, 14, 11]  # merges composed over three blocks
    for b, into in enumerate(rec["merged_into"]):
        g = groups(into)
        assert len(into) == 16 and len(g) == rec["tokens_out"][b] == 16 - 9  # CLS never merges
        assert max(len(m) for m in g.values()) > 2  # a token merged twice
        kept = rows_at(model, inputs, b, seen[0])
        for slot, members in g.items():
            assert slot in members
            expect = model.model.multi_modal_projector(patches[b, members].mean(0))
            torch.testing.assert_close(kept[slot], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["slots", "official"])
@torch.no_grad()
def test_visionzip_contextual_tokens_are_their_targets_plus_the_mean_of_the_rest(variant):
    model, inputs = tiny_llava(), llava_inputs()
    hidden = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
    project = model.model.multi_modal_projector
    feats = project(hidden) if variant == "slots" else hidden  # where the variant merges
    seen = capture(model.model.language_model.layers[0], pre=True)
    vlm_prune.wrap(model, VisionZip(variant=variant, dominant_ratio=0.5), keep=0.5)
    model(**inputs)
    rec = record_of(model, "vision")
    for b, into in enumerate(rec["merged_into"]):
        g = groups(into)
        cls = variant == "official"  # the official variant packs the tower's CLS into slot 0: no image token's
        assert len(g) + cls == rec["tokens_out"][b] == 8 and -1 not in into and (0 not in g or not cls)
        assert sum(len(m) > 1 for m in g.values()) >= 1
        kept = rows_at(model, inputs, b, seen[0])
        # official: the contextual targets are every (R // C)-th of the R tokens left after the dominant ones
        n_dominant = 8 // 2 - cls
        rest = sorted(j for slot, m in g.items() if slot >= cls + n_dominant for j in m)
        n_ctx = len(g) - n_dominant
        targets = set(rest[:: len(rest) // n_ctx][:n_ctx])
        for slot, members in g.items():
            target = slot if variant == "slots" else next(m for m in members if len(members) == 1 or m in targets)
            rest = [m for m in members if m != target]
            merged = feats[b, target] + (feats[b, rest].mean(0) if rest else 0)
            expect = merged if variant == "slots" else project(merged)
            torch.testing.assert_close(kept[slot], expect, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_visionzip_on_video_frames_merges_within_each_frame():
    model = tiny_onevision()
    inputs = onevision_video_inputs(model)
    vlm_prune.wrap(model, "visionzip", keep=0.5)
    model(**inputs)
    rec = record_of(model, "vision")
    n = rec["tokens_in"][0] // 4  # four frames of n tokens each
    for into, n_in, n_out in zip(rec["merged_into"], rec["tokens_in"], rec["tokens_out"]):
        assert len(into) == n_in and len(groups(into)) == n_out
        assert all(g // n == j // n for j, g in enumerate(into) if g >= 0)


@pytest.mark.parametrize("method", ["random", "divprune", "fastv", "asvit"])
@torch.no_grad()
def test_methods_that_only_keep_or_drop_report_no_merges(method):
    model, inputs = deep_llava(identity_blocks=False), llava_inputs()
    vlm_prune.wrap(model, method if method != "fastv" else vlm_prune.registry.method_class("fastv")(layer=1), keep=0.5)
    model(**inputs)
    records = model.vlm_prune.last_stats["stages"]
    assert records and not any("merged_into" in r for r in records)
