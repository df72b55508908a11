"""Kernels: every Triton kernel against its PyTorch reference, run by Triton's CPU interpreter.

The interpreter is chosen when a kernel module is imported with TRITON_INTERPRET=1, so the
module fixture below sets it, (re)imports the Triton modules, and on teardown restores the
environment and drops those modules again: other test files in the same process see neither.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vlm_prune.kernels import _dispatch

from vlm_prune import kernels as K

TRITON_MODULES = [f"vlm_prune.kernels.{m}" for m in ("attention_rows_triton", "euti_triton", "density_peaks_triton", "merge_triton")]
FAST = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])

needs_triton = pytest.mark.skipif(not _dispatch.triton_available(), reason="triton is not installed")


def _drop_triton_modules() -> None:
    for name in TRITON_MODULES:
        sys.modules.pop(name, None)
        if hasattr(K, name.rsplit(".", 1)[1]):
            delattr(K, name.rsplit(".", 1)[1])


@contextmanager
def _bfloat16_dots_by_value():
    """The interpreter keeps bfloat16 as uint16 and its ``tl.dot`` multiplies those bit patterns
    (triton-lang/triton#11584, not fixed upstream). Convert bfloat16 dot operands to float32
    first, as the GPU's tensor cores do exactly; float16 dots need no help."""
    from triton import language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (interpreter.TensorHandle(interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None)
                                         .view(np.float32), tl.float32) if t.dtype.scalar == tl.bfloat16 else t
                for t in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_dot = original


@pytest.fixture(scope="module")
def interpreted():
    """Triton kernels compiled for the CPU interpreter, for this module only."""
    if not _dispatch.triton_available():
        pytest.skip("triton is not installed")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _drop_triton_modules()
    for name in TRITON_MODULES:
        importlib.import_module(name)
    with _bfloat16_dots_by_value():
        yield
    _drop_triton_modules()
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------- dispatch


def test_unknown_backend_is_rejected():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        K.cosine_distance(x, x, backend="cuda")


def test_auto_on_cpu_runs_the_reference_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if triton were not installed
    assert not K.triton_available()
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    close(K.attention_key_scores(q, k, scale=0.5), K.attention_key_scores_torch(q, k, scale=0.5))
    with pytest.raises(ImportError, match="pip install"):
        K.attention_key_scores(q, k, scale=0.5, backend="triton")


def test_auto_uses_triton_on_ampere_and_newer_only(monkeypatch):
    """Pre-Ampere GPUs have no bfloat16 tensor cores: the kernels would spill there (kernel_report
    --arch 75), so "auto" keeps the references on them."""
    from types import SimpleNamespace

    on_gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # resolve_backend reads only these
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    for capability, expected in (((7, 5), "torch"), ((8, 0), "triton"), ((9, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert _dispatch.resolve_backend("auto", on_gpu, on_gpu) == expected
        assert _dispatch.resolve_backend("triton", on_gpu) == "triton"  # forcing still works


@needs_triton
def test_triton_on_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.euti_scores(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 1.0, backend="triton")


# ---------------------------------------------------------------- attention rows


def test_attention_to_keys_hand_checked():
    q = torch.zeros(1, 2, 2, 4)  # zero queries: uniform over the allowed keys
    k = torch.randn(1, 2, 4, 4)
    mask = torch.tensor([[[True, True, False, False], [False, False, False, False]]])
    out = K.attention_to_keys(q, k, mask, 1.0)
    assert torch.equal(out, torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]))


def test_attention_key_scores_relates_to_rows():
    g = gen(0)
    q, k = randn(g, 2, 4, 3, 8), randn(g, 2, 2, 7, 8)
    key_mask = torch.rand(2, 7, generator=g) > 0.3
    rows = K.attention_to_keys_torch(q, k, key_mask[:, None].expand(2, 3, 7), 0.3)
    close(K.attention_key_scores_torch(q, k, scale=0.3, key_mask=key_mask), rows.sum(1))
    # GQA keys equal explicitly repeated keys
    close(K.attention_key_scores_torch(q, k, scale=0.3), K.attention_key_scores_torch(q, k.repeat_interleave(2, 1), scale=0.3))


@st.composite
def attention_case(draw):
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h = hkv * draw(st.sampled_from([1, 2]))
    nq, s, d = draw(st.integers(1, 20)), draw(st.integers(1, 80)), draw(st.sampled_from([4, 8, 16]))
    return b, h, hkv, nq, s, d, draw(DTYPES), draw(st.integers(0, 2**16))


@needs_triton
@FAST
@given(case=attention_case(), broadcast=st.booleans())
def test_attention_to_keys_triton_matches_reference(interpreted, case, broadcast):
    b, h, hkv, nq, s, d, dtype, seed = case
    g = gen(seed)
    q, k = randn(g, b, h, nq, d, dtype=dtype), randn(g, b, hkv, s, d, dtype=dtype)
    mask = torch.rand(b, 1 if broadcast else nq, s, generator=g) > 0.4
    mask[0, 0] = False  # a row with no allowed key
    close(K.attention_to_keys(q, k, mask, d**-0.5, backend="triton"), K.attention_to_keys_torch(q, k, mask, d**-0.5))


@needs_triton
@FAST
@given(case=attention_case(), use_mask=st.booleans(), causal=st.booleans(), weights=st.sampled_from([None, 2, 3]),
       head_reduce=st.sampled_from(["mean", "sum"]))
def test_attention_key_scores_triton_matches_reference(interpreted, case, use_mask, causal, weights, head_reduce):
    b, h, hkv, nq, s, d, dtype, seed = case
    g = gen(seed)
    # non-contiguous q, as produced by HF attention (view + transpose)
    q = randn(g, b, nq, h, d, dtype=dtype).transpose(1, 2)
    k = randn(g, b, hkv, s, d, dtype=dtype)
    kw = {"scale": d**-0.5, "head_reduce": head_reduce}
    if use_mask:
        kw["key_mask"] = torch.rand(b, s, generator=g) > 0.3
    if causal:
        kw["q_pos"] = torch.randint(-1, s, (b, nq), generator=g)  # -1: a row that sees no key
        kw["k_pos"] = torch.arange(s).expand(b, s)
    if weights:
        kw["row_weights"] = torch.rand(*((b, nq) if weights == 2 else (b, h, nq)), generator=g)
    out = K.attention_key_scores(q, k, backend="triton", **kw)
    close(out, K.attention_key_scores_torch(q, k, **kw))
    if not weights and not use_mask and not causal:  # every row's softmax sums to one
        close(out.sum(1), torch.full((b,), float(nq * (h if head_reduce == "sum" else 1))))


# ---------------------------------------------------------------- EUTI


def test_euti_hand_checked():
    q = torch.randn(1, 2, 4, 8)
    k = torch.ones(1, 2, 4, 8)  # identical keys: uniform attention over the valid positions
    norm = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    valid = torch.tensor([[True, True, False, True]])
    close(K.euti_scores(q, k, norm, valid, 0.5), torch.tensor([[1 / 3, 2 / 3, 0.0, 4 / 3]]))


@needs_triton
@FAST
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 2]), n=st.integers(1, 90),
       d=st.sampled_from([4, 8, 16]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_euti_triton_matches_reference(interpreted, b, hkv, group, n, d, dtype, seed):
    g = gen(seed)
    q, k = randn(g, b, hkv * group, n, d, dtype=dtype), randn(g, b, hkv, n, d, dtype=dtype)
    norm = torch.rand(b, n, generator=g).to(dtype) * 10
    valid = torch.rand(b, n, generator=g) > 0.3
    valid[-1] = False  # a sample with nothing valid scores 0
    out = K.euti_scores(q, k, norm, valid, d**-0.5, backend="triton")
    close(out, K.euti_scores_torch(q, k, norm, valid, d**-0.5))
    assert torch.all(out[~valid] == 0)


# ---------------------------------------------------------------- DBDPC blocks


def test_cosine_distance_hand_checked():
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0], [-2.0, 0.0], [0.0, 0.0]])
    expected = torch.tensor([[0.0, 1.0, 2.0, 1.0], [1.0, 0.0, 1.0, 1.0], [2.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    close(K.cosine_distance(x, x), expected)


def test_density_and_rank_hand_checked():
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    valid = torch.tensor([True, True, True, False])
    e = math.exp(-0.25)  # orthogonal points: d = 1, (1/2)^2
    rho = K.density(x, 2.0, valid)
    close(rho, torch.tensor([2 + e, 2 + e, 1 + 2 * e, 0.0]))
    # equal densities: the lower index ranks higher; invalid points rank -1
    assert K.density_rank(rho, valid).tolist() == [2.0, 1.0, 0.0, -1.0]


def test_nearest_denser_hand_checked():
    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [-1.0, 0.0]])
    rho = torch.tensor([3.0, 1.0, 3.0, 2.0])  # 0 and 2 tie: 0 is denser (lower index)
    delta, parent = K.nearest_denser(x, rho)
    d01 = 1 - 1 / math.sqrt(1.01)
    close(delta, torch.tensor([float("inf"), d01, 1.0, 1.0]))
    assert parent.tolist() == [-1, 0, 0, 2]  # d(3, 0) = 2 > d(3, 2) = 1


@needs_triton
@FAST
@given(n=st.integers(1, 90), m=st.integers(1, 70), dim=st.sampled_from([3, 16, 40]), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_cosine_distance_triton_matches_reference(interpreted, n, m, dim, dtype, seed):
    g = gen(seed)
    x, y = randn(g, n, dim, dtype=dtype), randn(g, m, dim, dtype=dtype)
    x[0] = 0  # a zero vector is at distance 1
    close(K.cosine_distance(x, y, backend="triton"), K.cosine_distance_torch(x, y))


@needs_triton
@FAST
@given(n=st.integers(1, 90), dim=st.sampled_from([3, 16, 40]), dtype=DTYPES, bandwidth=st.sampled_from([2.0, 0.3]),
       ranked=st.booleans(), seed=st.integers(0, 2**16))
def test_density_and_nearest_denser_triton_match_reference(interpreted, n, dim, dtype, bandwidth, ranked, seed):
    g = gen(seed)
    x = randn(g, n, dim, dtype=dtype)
    x[n // 2] = x[0]  # duplicate points: distance 0
    valid = torch.rand(n, generator=g) > 0.2
    rho = K.density(x, bandwidth, valid, backend="triton")
    close(rho, K.density_torch(x, bandwidth, valid))
    rho = K.density_rank(rho, valid) if ranked else torch.randint(0, 3, (n,), generator=g).float()  # many ties
    delta, parent = K.nearest_denser(x, rho, valid, backend="triton")
    ref_delta, ref_parent = K.nearest_denser_torch(x, rho, valid)
    close(delta, ref_delta)
    # brute force over the full matrix: parent is a valid, denser point at distance delta
    dist = K.cosine_distance_torch(x, x)
    idx = torch.arange(n)
    denser = (rho[None, :] > rho[:, None]) | ((rho[None, :] == rho[:, None]) & (idx[None, :] < idx[:, None]))
    brute = torch.where(valid[None, :] & denser & valid[:, None], dist, float("inf")).min(1).values
    close(delta, brute)
    found = parent >= 0
    assert torch.equal(found, ref_parent >= 0) and torch.equal(found, torch.isfinite(delta))
    assert torch.all(valid[parent[found]]) and torch.all(denser[idx[found], parent[found]])
    close(dist[idx[found], parent[found]], delta[found])
    if valid.any():  # the tie rule leaves exactly one valid point without a denser one
        assert int((valid & ~found).sum()) == 1


# ---------------------------------------------------------------- gather / scatter-mean


def test_gather_rows_hand_checked_and_rejects_bad_index():
    x = torch.arange(12.0).reshape(1, 4, 3)
    index = torch.tensor([[3, 99, 0]])
    valid = torch.tensor([[True, False, True]])
    assert K.gather_rows(x, index, valid).tolist() == [[[9.0, 10.0, 11.0], [0.0, 0.0, 0.0], [0.0, 1.0, 2.0]]]
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        K.gather_rows(x, index, torch.ones(1, 3, dtype=torch.bool))


def test_scatter_mean_hand_checked():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 10.0], [7.0, 7.0]])
    assign = torch.tensor([0, 0, -1, 2])
    means, sizes = K.scatter_mean(x, assign, 3, weights=torch.tensor([1.0, 3.0, 5.0, 2.0]))
    assert means.tolist() == [[2.5, 3.5], [0.0, 0.0], [7.0, 7.0]]
    assert sizes.tolist() == [4.0, 0.0, 2.0]
    with pytest.raises(IndexError, match="-1"):
        K.scatter_mean(x, torch.tensor([0, 0, 3, 0]), 3)


@needs_triton
@FAST
@given(b=st.integers(1, 2), s=st.integers(1, 40), kk=st.integers(1, 40), dim=st.sampled_from([1, 5, 130]),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_gather_rows_triton_matches_reference(interpreted, b, s, kk, dim, dtype, seed):
    g = gen(seed)
    x = randn(g, b, s, dim, dtype=dtype)
    index = torch.randint(0, s, (b, kk), generator=g)
    valid = torch.rand(b, kk, generator=g) > 0.3
    index[~valid] = -7  # ignored
    assert torch.equal(K.gather_rows(x, index, valid, backend="triton"), K.gather_rows_torch(x, index, valid))


@needs_triton
@FAST
@given(b=st.sampled_from([None, 2]), n=st.integers(1, 80), c=st.integers(1, 12), dim=st.sampled_from([1, 7, 130]),
       weighted=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_scatter_mean_triton_matches_reference(interpreted, b, n, c, dim, weighted, dtype, seed):
    g = gen(seed)
    lead = (n,) if b is None else (b, n)
    x = randn(g, *lead, dim, dtype=dtype)
    assign = torch.randint(-1, c, lead, generator=g)
    weights = torch.rand(*lead, generator=g) if weighted else None
    means, sizes = K.scatter_mean(x, assign, c, weights, backend="triton")
    ref_means, ref_sizes = K.scatter_mean_torch(x, assign, c, weights)
    close(sizes, ref_sizes)
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output: the last bit may round either way
    close(means.float(), ref_means.float(), atol=atol)
    if b is not None:  # batched equals per sample
        for i in range(b):
            m_i, s_i = K.scatter_mean_torch(x[i], assign[i], c, None if weights is None else weights[i])
            close(ref_means[i].float(), m_i.float())
            close(ref_sizes[i], s_i)


@needs_triton
def test_edge_cases_triton(interpreted):
    """One token, everything masked, and block-boundary sizes give the reference results."""
    one_q, one_k = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 1, 8)
    for mask in (torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, 1, dtype=torch.bool)):
        out = K.attention_to_keys(one_q, one_k, mask, 0.3, backend="triton")
        assert out.tolist() == [[[1.0 if mask.all() else 0.0]]]
        scores = K.attention_key_scores(one_q, one_k, scale=0.3, key_mask=mask[:, 0], backend="triton")
        assert scores.tolist() == ([[1.0]] if mask.all() else [[0.0]])
    for valid in (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.bool)):
        out = K.euti_scores(one_q, one_k, torch.tensor([[3.0]]), valid, 0.3, backend="triton")
        assert out.tolist() == [[3.0 if valid.all() else 0.0]]
    x = torch.randn(1, 5)
    assert K.density(x, backend="triton").tolist() == [1.0]
    delta, parent = K.nearest_denser(x, torch.zeros(1), backend="triton")
    assert delta.tolist() == [float("inf")] and parent.tolist() == [-1]
    x = torch.randn(129, 33)  # a multiple of no block size: full blocks and one row more
    close(K.density(x, backend="triton"), K.density_torch(x))
    means, sizes = K.scatter_mean(x, torch.full((129,), -1), 2, backend="triton")  # everything discarded
    assert torch.all(means == 0) and torch.all(sizes == 0)
    gathered = K.gather_rows(x[None], torch.tensor([[128]]), torch.ones(1, 1, dtype=torch.bool), backend="triton")
    assert torch.equal(gathered[0, 0], x[128])
