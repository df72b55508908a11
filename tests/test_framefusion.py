"""FrameFusion (framefusion) against an independent re-statement of the official algorithm.

Official: thu-nics/FrameFusion@fbec1d2e6bd383361c2c87ca13e73f80a8c1a9e9, framefusion/main.py
(``FrameFusion.forward``: the merging branch with ``compute_similarity_and_token_index_by_patch``,
``merge_tokens_and_get_mask``, ``find_contigious_latter_index`` and ``_compute_pruning_ratio``; the
pruning branch with the last query's attention, ``utils.scaled_dot_product_attention(num=1)``).
:class:`OfficialFrameFusion` below re-states it for one sample (patch types, the sparsity list, the
finish flags), called once per layer boundary as the engine reduces (the documented placement
difference: the official calls it before layer 0's attention and after each layer's attention).
"""
from __future__ import annotations

import math

import pytest
import torch

import test_invariants as inv
import tiny_models as T
import vlm_prune
from reference import capture_lm_inputs, float_mask, positions_of, run_layers
from vlm_prune.methods.base import LayerContext
from vlm_prune.methods.framefusion import FrameFusion, cost_sparsity

TEXT = -1


# ---- the official algorithm, re-stated ---------------------------------------------------------------
def official_pruning_ratio(sparsity: list[float], cost: float, layers: int = 28) -> float:
    s, total = 1.0, 0.0
    for x in sparsity:
        s *= 1 - x
        total += s
    remain = layers * cost - total
    if remain < 0:
        raise ValueError("The cost is too small")
    if remain / ((layers - len(sparsity)) * s) > 1:
        return 0.0
    return 1 - remain / ((layers - len(sparsity)) * s)


def runs_end_lengths(flags: torch.Tensor) -> torch.Tensor:
    """find_contigious_latter_index: each run of ones becomes zeros with its length at its last element."""
    out = torch.zeros_like(flags)
    n, run = flags.numel(), 0
    for i in range(n):
        run = run + 1 if flags[i] else 0
        if flags[i] and (i == n - 1 or not flags[i + 1]):
            out[i] = run
    return out


class OfficialFrameFusion:
    """main.py's FrameFusion for batch 1: ``step(hidden [S, D], attention [S] | None)`` is one call."""

    def __init__(self, patch_type: torch.Tensor, patch_num: int, cost=0.3, sim=0.6, ratio_lb=0.1, target=None):
        self.patch_type, self.patch_num, self.target = patch_type.clone(), patch_num, target
        self.cost, self.sim, self.ratio_lb = cost, sim, ratio_lb
        self.sparsity: list[float] = []
        self.finish_merging = self.finish_pruning = False
        self.origin = torch.arange(patch_type.numel())  # input index of every current row
        self.longest_run = 0  # the most consecutive frames of one slot folded at once

    def step(self, hidden: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        if self.finish_merging and not self.finish_pruning:
            vis = torch.nonzero(self.patch_type != TEXT).squeeze(1)  # the contiguous image span
            ratio = official_pruning_ratio(self.sparsity, self.cost)
            top = attention[vis].topk(round(vis.numel() * (1 - ratio))).indices + vis[0]
            keep = torch.cat([torch.arange(int(vis[0])), top, torch.arange(int(vis[-1]) + 1, hidden.shape[0])]).sort().values
            self._take(keep)
            self.finish_pruning = True
            return hidden[keep]
        if self.finish_merging:
            return hidden
        frame_tokens = int((self.patch_type != TEXT).sum())
        if self.target is None:
            upper = official_pruning_ratio(self.sparsity, self.cost)
            cap = int(upper * frame_tokens)
        else:  # vlm-prune's keep / budget: the bound is the target (and the cap exactly reaches it)
            upper, cap = (frame_tokens - self.target) / frame_tokens, frame_tokens - self.target
        ptype, index = torch.where(self.patch_type == torch.arange(self.patch_num)[:, None])
        a, b = hidden[index[:-1]], hidden[index[1:]]
        sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        sim[ptype[:-1] != ptype[1:]] = -2
        sim = torch.cat([torch.tensor([-2.0]), sim])
        merge = torch.where(sim >= self.sim)[0]
        ratio = merge.numel() / frame_tokens
        if ratio < upper:
            self.sparsity.append(ratio)
            if ratio < self.ratio_lb:
                self.finish_merging = True
        else:
            merge = torch.topk(sim, cap).indices.sort().values
            self.finish_merging = self.finish_pruning = True
        if merge.numel() == 0:
            return hidden
        flags = torch.zeros(sim.numel(), dtype=torch.long)
        flags[merge] = 1
        ends = runs_end_lengths(flags)
        keep = torch.ones(hidden.shape[0], dtype=torch.bool)
        keep[index[merge]] = False
        hidden = hidden.clone()
        self.longest_run = max(self.longest_run, int(ends.max()))
        for end in torch.nonzero(ends).squeeze(1).tolist():
            m = int(ends[end])
            start = end - m  # the token just before the run, in patch order
            members = index[start + 1 : end + 1]
            hidden[index[start]] = (hidden[index[start]] + hidden[members].sum(0)) / (m + 1)
        self._take(torch.nonzero(keep).squeeze(1))
        return hidden[keep]

    def _take(self, keep: torch.Tensor) -> None:
        self.patch_type, self.origin = self.patch_type[keep], self.origin[keep]


# ---- driving the method like the engine, on synthetic layers -------------------------------------------
class Projection:
    """project_qk of a fake layer: q / k linear in the hidden states, no RoPE (H heads of size d)."""

    def __init__(self, dim: int, heads: int = 2, d: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.wq, self.wk, self.h, self.d = torch.randn(dim, heads * d, generator=g), torch.randn(dim, heads * d, generator=g), heads, d

    def __call__(self, hidden, pos, rope=True, q_rows=None):
        b, s, _ = hidden.shape
        xq = hidden if q_rows is None else torch.gather(hidden, 1, q_rows[..., None].expand(-1, -1, hidden.shape[-1]))
        q = (xq @ self.wq).view(b, xq.shape[1], self.h, self.d).transpose(1, 2)
        k = (hidden @ self.wk).view(b, s, self.h, self.d).transpose(1, 2)
        return q, k

    def last_row_attention(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S] head-mean softmax of the last row's logits over every row (the official num=1 attention)."""
        q, k = self(hidden[None], None)
        logits = (q[0, :, -1:] @ k[0].transpose(-1, -2)) / math.sqrt(self.d)
        return torch.softmax(logits.float(), -1).mean(0)[0]


class FakeLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.scaling = None


def layer_map(layer: int, dim: int):
    """A fixed nonlinear map standing in for decoder layer ``layer`` (row-wise, so merged rows stay comparable)."""
    g = torch.Generator().manual_seed(100 + layer)
    w = torch.randn(dim, dim, generator=g) * 0.3
    return lambda h: h + torch.tanh(h @ w)


def video_prompt(frames: int, per_frame: int, dim: int, copy: float, noise: float = 0.3, pre: int = 3, post: int = 4,
                 seed: int = 0):
    """(hidden [S, D], patch_type [S]): text, ``frames`` frames in which each slot, with probability
    ``copy``, repeats the same slot of the frame before up to ``noise`` times a random step (else it
    is new), text."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(per_frame, dim, generator=g)]
    for _ in range(frames - 1):
        fresh = torch.randn(per_frame, dim, generator=g)
        near = rows[-1] + noise * torch.rand(per_frame, 1, generator=g) * torch.randn(per_frame, dim, generator=g)
        rows.append(torch.where(torch.rand(per_frame, 1, generator=g) < copy, near, fresh))
    hidden = torch.cat([torch.randn(pre, dim, generator=g), *rows, torch.randn(post, dim, generator=g)])
    ptype = torch.tensor([TEXT] * pre + list(range(per_frame)) * frames + [TEXT] * post)
    return hidden, ptype


def run_method(method: FrameFusion, hidden: torch.Tensor, ptype: torch.Tensor, layers: int, proj: Projection,
               n_keep: int | None = None):
    """Drive ``method.select`` as the engine does on one sample: [(layer, input rows kept, hidden)] after each step."""
    method._num_layers = layers
    s, dim = hidden.shape
    origin = torch.arange(s)
    h = hidden[None].clone()
    memo: dict = {}
    previous = None
    trace = []
    for layer in range(layers):
        valid = torch.ones(1, h.shape[1], dtype=torch.bool)
        visual = (ptype[origin] != TEXT)[None]
        n_vis = int(visual.sum())
        extras = {"prefill_memo": memo, "frame_slots": torch.where(visual, ptype[origin][None], -1), "origin": origin[None]}
        if previous is not None:
            extras["previous_hidden"], extras["previous_project_qk"] = previous, proj
        ctx = LayerContext(layer=layer, hidden=h, valid=valid, visual=visual, text=~visual, positions=origin[None],
                           sizes=torch.ones(1, h.shape[1]), n_keep=torch.tensor([n_keep if n_keep is not None else n_vis]),
                           layer_module=FakeLayer(), project_qk=proj, extras=extras)
        reds = method.select(ctx)
        if reds is not None:
            red = reds[0]
            feats = red.features if red.features is not None else h[0, red.indices]
            h, origin = feats[None].clone(), origin[red.indices]
            trace.append((layer, origin.clone(), h[0].clone()))
        previous = h
        h = layer_map(layer, dim)(h)
    return trace


def run_official(ref: OfficialFrameFusion, hidden: torch.Tensor, layers: int, proj: Projection):
    """The official calls at each layer boundary: [(layer, input rows kept, hidden)] where something changed."""
    h = hidden.clone()
    trace, attention = [], None
    for layer in range(layers):
        n = h.shape[0]
        out = ref.step(h, attention)
        if out.shape[0] != n or not torch.equal(out, h):
            trace.append((layer, ref.origin.clone(), out.clone()))
        h = out
        attention = proj.last_row_attention(h) if ref.finish_merging and not ref.finish_pruning else None
        h = layer_map(layer, h.shape[-1])(h)
    return trace


def assert_same_trace(got, ref):
    assert [t[0] for t in got] == [t[0] for t in ref], ([t[0] for t in got], [t[0] for t in ref])
    for (layer, rows, h), (_, rows_ref, h_ref) in zip(got, ref):
        assert torch.equal(rows, rows_ref), f"layer {layer}: kept rows differ"
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


#: (copy, noise, S_th, seed, the official's steps): merges before layers 0-2 and pruning before 3; merges
#: before 0, 1, 2 (the last under 10%) and pruning before 3; runs of 2+ frames folded at once; ...
CASES = [(0.4, 1.0, 0.6, 0, [0, 1, 2, 3]), (0.2, 0.2, 0.6, 1, [0, 1, 3]), (0.6, 0.6, 0.8, 0, [0, 2]),
         (0.8, 1.0, 0.8, 0, [0, 1, 3]), (0.2, 1.0, 0.8, 1, [0, 1]), (0.8, 0.2, 0.6, 0, [0, 2]),
         (0.6, 1.0, 0.8, 0, [0, 1, 2])]


@pytest.mark.parametrize("copy, noise, sim, seed, steps", CASES)
def test_official_defaults_merge_and_prune_as_the_official(copy, noise, sim, seed, steps):
    """Without keep / budget: the same merges (runs folded into the token before them, plain means),
    the same sparsity list, the same end of merging and the same pruning by the last row's attention,
    over several layers."""
    hidden, ptype = video_prompt(frames=5, per_frame=6, dim=6, copy=copy, noise=noise, seed=seed)
    proj = Projection(6, seed=seed)
    method = FrameFusion(similarity=sim)
    got = run_method(method, hidden, ptype, layers=8, proj=proj)
    official = OfficialFrameFusion(ptype, 6, sim=sim)
    ref = run_official(official, hidden, layers=8, proj=proj)
    assert [t[0] for t in ref] == steps and official.finish_pruning
    assert official.longest_run >= (2 if copy >= 0.8 else 1)
    assert_same_trace(got, ref)


def test_the_budget_cap_merges_only_the_most_similar_and_ends():
    """A merge above the allowed share merges the int(u n) most similar tokens and ends (no pruning)."""
    hidden, ptype = video_prompt(frames=6, per_frame=4, dim=6, copy=1.0, noise=0.01, seed=3)
    proj = Projection(6)
    ref = OfficialFrameFusion(ptype, 4, sim=0.0)  # u = 0.7 at the first step; 20 of the 24 tokens are above
    ref_trace = run_official(ref, hidden, 4, proj)
    got = run_method(FrameFusion(similarity=0.0), hidden, ptype, 4, proj)
    assert ref.finish_pruning and len(ref_trace) == 1 and int((ref.patch_type != TEXT).sum()) == 24 - int(0.7 * 24)
    assert_same_trace(got, ref_trace)


def test_cost_arithmetic_equals_the_official():
    for history in ([], [0.2], [0.5, 0.3], [0.05], [0.6, 0.4, 0.2]):
        for cost in (0.1, 0.3, 0.7):
            try:
                expected = official_pruning_ratio(history, cost)
            except ValueError:
                with pytest.raises(ValueError, match="cost=.* is too small"):
                    cost_sparsity(history, cost, 28)
                continue
            assert cost_sparsity(history, cost, 28) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("target", [3, 7, 12, 20])
@pytest.mark.parametrize("copy", [0.3, 0.9])
def test_a_target_is_met_exactly(target, copy):
    """keep / budget: the video ends at exactly the target (merging capped there, or pruning to it)."""
    hidden, ptype = video_prompt(frames=5, per_frame=6, dim=6, copy=copy, seed=4)
    trace = run_method(FrameFusion(budget=target), hidden, ptype, layers=5, proj=Projection(6), n_keep=target)
    rows = trace[-1][1]
    assert int((ptype[rows] != TEXT).sum()) == target
    assert int((ptype[rows] == TEXT).sum()) == int((ptype == TEXT).sum())  # text never touched


def test_merging_ends_in_time_for_the_pruning_before_the_last_layer():
    """With a target, merging that would go on (ratio_lower_bound 0) stops at layer L - 2, and the
    pruning lands on the target before layer L - 1."""
    hidden, ptype = video_prompt(frames=6, per_frame=4, dim=6, copy=0.5, noise=0.02, seed=5)
    trace = run_method(FrameFusion(similarity=0.5, ratio_lower_bound=0.0, budget=4), hidden, ptype, layers=4,
                       proj=Projection(6), n_keep=4)
    assert trace[0][0] == 0 and len(trace[0][1]) > 4 + 7  # the first merge leaves more than the target
    assert trace[-1][0] == 3 and int((ptype[trace[-1][1]] != TEXT).sum()) == 4


# ---- in the model ---------------------------------------------------------------------------------------
def _run(model, inp, method, **kw):
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            out = model(**inp)
        return out.logits, model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("case, frames, per_frame", [("onevision_video", 4, 4), ("qwen2_vl_video", 2, 16),
                                                    ("nextvideo_video", 4, 4), ("ov15_video", 4, 4),
                                                    ("qwen3_vl_video", 2, 16)])
def test_in_the_model_slots_pair_each_token_with_the_previous_frame(case, frames, per_frame):
    """The slots the adapter hands on pair every video token with the same spatial slot of its video's
    previous frame (a temporal slice on Qwen2-VL / Qwen3-VL, whose slices sit behind their own
    timestamps there); the newline and text rows have none."""
    model, make = inv.build(case)
    inp = make()
    seen = []

    class Recording(FrameFusion):
        def select(self, ctx):
            seen.append(ctx.extras["frame_slots"].clone())
            return super().select(ctx)

    _run(model, inp, Recording(), keep=0.5)
    slots = seen[0]
    for b in range(slots.shape[0]):
        video = torch.nonzero(slots[b] >= 0).squeeze(1)
        assert video.numel() == frames * per_frame
        ids = slots[b, video].view(frames, per_frame)
        assert torch.equal(ids, ids[:1].expand(frames, -1)) and ids[0].unique().numel() == per_frame


@pytest.mark.parametrize("sim", [0.3, 0.95])
def test_in_the_model_merges_follow_the_official_on_the_layer_inputs(sim):
    """On LLaVA-OneVision video: the first merge (before layer 0) folds exactly the tokens the official
    step folds on the same input embeddings (its bound u replaced by the target's, (n - T) / n), into
    the same rows with the same means; the stage record says into which."""
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, batch=1, frames=4)
    seen = []

    class Recording(FrameFusion):
        def select(self, ctx):
            reds = super().select(ctx)
            if ctx.layer == 0:
                seen.append((ctx.hidden[0].clone(), ctx.extras["frame_slots"][0].clone(), reds))
            return reds

    _, stats = _run(model, inp, Recording(similarity=sim), keep=0.25)
    hidden, slots, reds = seen[0]
    ptype = torch.where(slots >= 0, slots - int(slots[slots >= 0].min()), TEXT)
    ref = OfficialFrameFusion(ptype, 4, sim=sim, target=4)
    out = ref.step(hidden.float(), None)
    if out.shape[0] == hidden.shape[0]:
        assert reds is None
    else:
        assert torch.equal(reds[0].indices, ref.origin)
        torch.testing.assert_close(reds[0].features.float(), out, atol=1e-6, rtol=1e-6)
        assert "merged_into" in stats["stages"][0]
    assert stats["visual_tokens_out"] == [4]


@pytest.mark.parametrize("case, merging_layers", [("onevision_video", 2), ("nextvideo_video", 3), ("ov15_video", 4),
                                                   ("qwen2_vl_video", 1)])
def test_merges_over_several_layers_equal_the_masked_reference(case, merging_layers):
    """Invariant 3 with FrameFusion's merges at several layers and its pruning: the wrapped model's
    logits equal the unwrapped decoder layers run on the whole sequence, each merged token's hidden
    state replaced by the recorded mean entering the layer it merged at and the folded / dropped rows
    hidden as keys from there on (no log-size bias: the official has no proportional attention);
    batch 2, the samples merging and pruning at different layers."""
    model, make = inv.build(case)
    inp = make()
    steps = []

    class Recording(FrameFusion):
        def select(self, ctx):
            reds = super().select(ctx)
            if reds is not None:
                steps.append((ctx.layer, ctx.extras["origin"].clone(), reds))
            return reds

    logits, rows = inv.pruned_prefill(model, Recording(similarity=0.2), inp, keep=0.3)
    layers = [layer for layer, _, reds in steps if any(r.features is not None for r in reds)]
    assert len(layers) >= merging_layers, f"the case must merge at {merging_layers} layers, merged at {layers}"
    b, s = inp["input_ids"].shape
    with torch.no_grad(), capture_lm_inputs(model) as seen:
        model(**inp)
    embeds, pos = seen[0]["inputs_embeds"], positions_of(seen[0], b, s)
    valid = inp["attention_mask"].bool()
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None] & valid[:, None, :]
    kept_from: list[tuple[int, torch.Tensor]] = []
    replace = []
    kept = valid.clone()
    for layer, origin, reds in steps:
        kept = kept.clone()
        centre = torch.zeros(b, s, dtype=torch.bool)
        feats = torch.zeros(b, s, embeds.shape[-1])
        for i, red in enumerate(reds):
            rows_now = origin[i][origin[i] >= 0]
            gone = torch.ones(rows_now.numel(), dtype=torch.bool)
            gone[red.indices - int((origin[i] < 0).sum())] = False
            kept[i, rows_now[gone]] = False
            if red.features is not None:
                o = origin[i][red.indices]
                centre[i, o] = True
                feats[i, o] = red.features.float()
        kept_from.append((layer, kept))
        if centre.any():
            replace.append((layer, lambda h, c=centre, f=feats: torch.where(c[..., None], f.to(h.dtype), h)))

    def mask(idx):
        allowed = causal
        for layer, k in kept_from:
            if layer <= idx:
                allowed = causal & k[:, None, :]
        return float_mask(allowed, embeds.dtype)

    with torch.no_grad():
        ref = run_layers(model, embeds, pos, mask, replace)
    inv.assert_kept_rows_equal(logits, rows, ref)


def test_keep_one_changes_nothing_and_writes_no_record():
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model)
    with torch.no_grad():
        ref = model(**inp).logits
    logits, stats = _run(model, inp, "framefusion", keep=1.0)
    assert torch.equal(logits, ref) and stats["stages"] == []


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"method 'framefusion' supports llava_onevision.*'llava' adapter"):
        vlm_prune.wrap(T.tiny_llava(), "framefusion", keep=0.5)
    for kw, msg in (({"cost": 0.0}, "cost .* must lie in"), ({"similarity": 1.5}, "similarity .* must lie in"),
                    ({"ratio_lower_bound": -0.1}, "ratio_lower_bound must lie in"), ({"cost_layers": 1}, "cost_layers")):
        with pytest.raises(ValueError, match=msg):
            FrameFusion(**kw)
    with pytest.raises(ValueError, match="cost=0.01 is too small.*Raise cost, or give keep="):
        cost_sparsity([0.0], 0.01, 28)
