"""On a CUDA GPU: the Triton kernels against their references at real sizes, and the methods
with Triton kernels against the same methods with the PyTorch references, on the same GPU.

Skipped without CUDA (CI has none); ``scripts/gpu_checks.sh`` runs this file on a lent GPU, with
TRITON_INTERPRET=0 (conftest.py turns Triton's CPU interpreter on unless told otherwise).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune import kernels as K
from vlm_prune.kernels import _dispatch

pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() and _dispatch.triton_available()),
                       reason="needs a CUDA GPU and Triton (scripts/gpu_checks.sh)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="runs the compiled kernels: set TRITON_INTERPRET=0 (scripts/gpu_checks.sh does)"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, H, Hkv, Q, S, d): a Qwen2-7B-like layer at 8k tokens, and sizes that fill no block
ATTENTION_SHAPES = [(1, 28, 4, 64, 8192, 128), (2, 6, 3, 7, 1001, 80)]


def tolerance(dtype: torch.dtype) -> dict:
    """Half-precision products are exact in float32: only the summation order differs."""
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-4, "rtol": 1e-3}


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


@pytest.fixture(autouse=True)
def exact_float32():
    """Float32 matmuls and convolutions in full precision, as on CPU (no TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_kernels_match_reference(shape, dtype):
    b, h, hkv, nq, s, d = shape
    q, k = rand(b, nq, h, d, dtype=dtype).transpose(1, 2), rand(b, hkv, s, d, dtype=dtype, seed=1)
    q_pos = torch.arange(s - nq, s, device="cuda").expand(b, nq)
    k_pos = torch.arange(s, device="cuda").expand(b, s)
    key_mask = torch.rand(b, s, device="cuda") > 0.1
    weights = torch.rand(b, h, nq, device="cuda")
    for kw in ({"q_pos": q_pos, "k_pos": k_pos}, {"key_mask": key_mask, "row_weights": weights, "head_reduce": "sum"}):
        torch.testing.assert_close(K.attention_key_scores(q, k, scale=d**-0.5, backend="triton", **kw),
                                   K.attention_key_scores_torch(q, k, scale=d**-0.5, **kw), **tolerance(dtype))
    rows_mask = key_mask[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    torch.testing.assert_close(K.attention_to_keys(q, k, rows_mask, d**-0.5, backend="triton"),
                               K.attention_to_keys_torch(q, k, rows_mask, d**-0.5), **tolerance(dtype))
    q_all = rand(b, h, s, d, dtype=dtype, seed=2)
    norm = torch.rand(b, s, device="cuda")
    torch.testing.assert_close(K.euti_scores(q_all, k, norm, key_mask, d**-0.5, backend="triton"),
                               K.euti_scores_torch(q_all, k, norm, key_mask, d**-0.5), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, dim", [(4096, 512), (1001, 96)])
def test_dbdpc_kernels_match_reference(n, dim, dtype):
    x = rand(n, dim, dtype=dtype)
    valid = torch.rand(n, device="cuda") > 0.1
    tol = tolerance(dtype)
    torch.testing.assert_close(K.cosine_distance(x[:300], x, backend="triton"), K.cosine_distance_torch(x[:300], x), **tol)
    rho = K.density(x, 2.0, valid, backend="triton")
    torch.testing.assert_close(rho, K.density_torch(x, 2.0, valid), **tol)
    ranks = K.density_rank(rho, valid)
    delta, parent = K.nearest_denser(x, ranks, valid, backend="triton")
    ref_delta, ref_parent = K.nearest_denser_torch(x, ranks, valid)
    torch.testing.assert_close(delta, ref_delta, **tol)
    found = parent >= 0
    assert torch.equal(found, ref_parent >= 0)
    # equal distances may pick another parent: the parent's distance is delta either way
    dist = K.cosine_distance_torch(x[found], x[parent[found]]).diagonal()
    torch.testing.assert_close(dist, delta[found], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_kernels_match_reference(dtype):
    hidden = rand(2, 3000, 512, dtype=dtype)
    index = torch.stack([torch.randperm(3000, device="cuda")[:1000].sort().values for _ in range(2)])
    valid = torch.rand(2, 1000, device="cuda") > 0.2
    assert torch.equal(K.gather_rows(hidden, index, valid, backend="triton"), K.gather_rows_torch(hidden, index, valid))
    assign = torch.randint(-1, 300, (2, 3000), device="cuda")
    weights = torch.rand(2, 3000, device="cuda")
    means, sizes = K.scatter_mean(hidden, assign, 300, weights, backend="triton")
    ref_means, ref_sizes = K.scatter_mean_torch(hidden, assign, 300, weights)
    torch.testing.assert_close(means.float(), ref_means.float(), **tolerance(dtype))
    torch.testing.assert_close(sizes, ref_sizes, **tolerance(torch.float32))


MODELS = {
    "llava": (T.tiny_llava, lambda m: T.llava_inputs()),
    "onevision_video": (T.tiny_onevision, T.onevision_video_inputs),
    "qwen2_vl_image": (T.tiny_qwen2_vl, T.qwen2_vl_inputs),
}


def _prefill(model, method, inputs, keep: float):
    vlm_prune.wrap(model, method, keep=keep)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
            gen = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        return logits, model.vlm_prune.last_rows, gen
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("case", list(MODELS))
@pytest.mark.parametrize("method", ["fastv", "pact", "adaptinfer", "divprune", "cdpruner", "pdrop", "sparsevlm"])
def test_methods_with_triton_equal_methods_with_references(case, method, monkeypatch):
    """Same GPU, same weights: a method using the Triton kernels keeps the same tokens and gives
    the same logits and generation as with the PyTorch references."""
    make, make_inputs = MODELS[case]
    model = make().cuda()
    inputs = {k: v.cuda() for k, v in make_inputs(model).items()}
    logits, rows, gen = _prefill(model, method, inputs, keep=0.4)
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)  # "auto" now picks the references
    ref_logits, ref_rows, ref_gen = _prefill(model, method, inputs, keep=0.4)
    assert all(torch.equal(r, q) for r, q in zip(rows, ref_rows)), (case, method)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(gen, ref_gen)


@pytest.mark.parametrize("case", list(MODELS))
def test_everything_kept_equals_unwrapped_on_cuda(case):
    """Invariant 1 on the GPU (SDPA): keep=1.0 gives the unwrapped model's logits and generation."""
    make, make_inputs = MODELS[case]
    model = make().cuda()
    inputs = {k: v.cuda() for k, v in make_inputs(model).items()}
    valid = inputs["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**inputs).logits
        ref_gen = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    logits, _, gen = _prefill(copy.deepcopy(model), "fastv", inputs, keep=1.0)
    torch.testing.assert_close(logits[valid], ref[valid], atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)
