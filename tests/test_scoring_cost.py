"""In-LLM scoring projects only what it uses, once: FastV / AdaptInfer project the query rows
they read (not every row), PACT projects layer L once for EUTI and its clustering keys, and a
pure drop at keep=1.0 scores nothing. The scores and selections stay those of the full projection."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

import test_invariants as inv
import vlm_prune
from vlm_prune.methods import LayerContext
from vlm_prune.methods.adaptinfer import AdaptInfer
from vlm_prune.methods.fastv import FastV
from vlm_prune.methods.pact import PACT

CASES = ["llava", "onevision_video", "qwen2_vl_image"]  # Llama, Qwen2 GQA, M-RoPE


def captured_context(case: str) -> LayerContext:
    """The LayerContext entering layer 1 of a wrapped tiny model (left-padded batch of 2)."""
    model, make = inv.build(case)
    seen: dict[str, LayerContext] = {}

    class Recording(FastV):
        def select(self, ctx: LayerContext) -> list:
            seen["ctx"] = ctx
            return super().select(ctx)

    vlm_prune.wrap(model, Recording(layer=1), keep=0.5)
    try:
        with torch.no_grad():
            model(**make())
    finally:
        vlm_prune.unwrap(model)
    return seen["ctx"]


def full_projection(project: Any) -> Any:
    """The former cost: every query row projected (then the used rows gathered), and PACT's
    two projections (without RoPE, then with it)."""

    def reference(hidden: torch.Tensor, pos: torch.Tensor, rope: Any = True, q_rows: torch.Tensor | None = None):
        if rope == "keys":
            q, k = project(hidden, pos, rope=False)
            return q, k, project(hidden, pos, rope=True)[1]
        q, k = project(hidden, pos, rope=rope)
        if q_rows is not None:
            q = torch.gather(q, 2, q_rows[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        return q, k

    return reference


@pytest.mark.parametrize("case", CASES)
def test_projecting_selected_rows_equals_the_full_projection(case: str) -> None:
    ctx = captured_context(case)
    rows = torch.stack([torch.nonzero(v).squeeze(1)[[0, -3, -1]] for v in ctx.valid])  # [B, 3]
    with torch.no_grad():
        for rope in (True, False):
            q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=rope, q_rows=rows)
            q_ref, k_ref = full_projection(ctx.project_qk)(ctx.hidden, ctx.positions, rope=rope, q_rows=rows)
            torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
            assert torch.equal(k, k_ref)
        q, k, k_rope = ctx.project_qk(ctx.hidden, ctx.positions, rope="keys")
        assert torch.equal(q, ctx.project_qk(ctx.hidden, ctx.positions, rope=False)[0])
        assert torch.equal(k, ctx.project_qk(ctx.hidden, ctx.positions, rope=False)[1])
        assert torch.equal(k_rope, ctx.project_qk(ctx.hidden, ctx.positions, rope=True)[1])
    with pytest.raises(ValueError, match="rope must be True, False or 'keys'"):
        ctx.project_qk(ctx.hidden, ctx.positions, rope="queries")


@pytest.mark.parametrize("case", CASES)
def test_scores_and_selections_unchanged(case: str) -> None:
    ctx = captured_context(case)
    ref_ctx = replace(ctx, project_qk=full_projection(ctx.project_qk))
    with torch.no_grad():
        for method in (FastV(layer=1, query="last"), FastV(layer=1, query="text"), AdaptInfer(keep=0.5)):
            torch.testing.assert_close(method.scores(ctx), method.scores(ref_ctx), atol=1e-6, rtol=1e-5)
        pact = PACT(layer=1, cutoff=0.5)
        assert torch.equal(pact.scores(ctx), pact.scores(ref_ctx))
        for red, ref in zip(pact.select(ctx), pact.select(ref_ctx)):
            assert torch.equal(red.indices, ref.indices) and torch.equal(red.sizes, ref.sizes)


@pytest.mark.parametrize("case", CASES)
def test_projection_cost(case: str) -> None:
    """Calls of the projector and query rows through q_proj, per method."""
    ctx = captured_context(case)
    q_proj = ctx.layer_module.self_attn.q_proj
    calls: list[Any] = []

    def counting(hidden: torch.Tensor, pos: torch.Tensor, rope: Any = True, q_rows: torch.Tensor | None = None):
        calls.append(rope)
        return ctx.project_qk(hidden, pos, rope=rope, q_rows=q_rows)

    rows_in: list[int] = []
    hook = q_proj.register_forward_hook(lambda m, args, out: rows_in.append(args[0].shape[1]))
    counted = replace(ctx, project_qk=counting)
    n_text = int(ctx.text.sum(1).max())
    try:
        with torch.no_grad():
            expected = [(FastV(layer=1, query="last"), 1), (FastV(layer=1, query="text"), n_text), (AdaptInfer(keep=0.5), n_text)]
            for method, n_rows in expected:
                method.configure_budget(0.5, None)
                calls.clear()
                rows_in.clear()
                method.select(counted)
                assert len(calls) == 1 and rows_in == [n_rows], (method, rows_in)
            calls.clear()
            PACT(layer=1).select(counted)
            assert calls == ["keys"]
            everything = replace(counted, n_keep=(ctx.visual & ctx.valid).sum(1))
            for method in (FastV(layer=1), AdaptInfer(keep=1.0)):
                calls.clear()
                reds = method.select(everything)
                assert calls == []  # keep=1.0: nothing to prune, nothing scored
                assert [r.indices.tolist() for r in reds] == [torch.nonzero(v).squeeze(1).tolist() for v in ctx.valid]
    finally:
        hook.remove()
