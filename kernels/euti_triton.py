"""Triton kernels behind :func:`vlm_prune.kernels.euti_scores` (imported only when used).

``_euti_stats``: one program per (batch, head) computes the valid-mean query qbar, then streams
over the keys once for the softmax max and normaliser. ``_euti_out``: one program per block of
positions sums exp(qbar . k - m) / l over the heads and multiplies by the hidden-state norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _euti_stats(q_ptr, k_ptr, valid_ptr, qbar_ptr, m_ptr, l_ptr, H, N, D, GROUP, scale,
                sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svn,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    count = tl.zeros([BLOCK_N], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = tl.load(valid_ptr + b * svb + offs_n * svn, mask=offs_n < N, other=0) != 0
        qt = tl.load(q_ptr + b * sqb + h * sqh + offs_n[:, None] * sqn + offs_d[None, :] * sqd,
                     mask=ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        acc += tl.sum(qt, axis=0)
        count += ok.to(tl.float32)
    qbar = acc / tl.maximum(tl.sum(count, axis=0), 1.0)
    tl.store(qbar_ptr + pid * D + offs_d, qbar, mask=offs_d < D)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = tl.load(valid_ptr + b * svb + offs_n * svn, mask=offs_n < N, other=0) != 0
        kt = tl.load(k_ptr + b * skb + (h // GROUP) * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                     mask=ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        logits = tl.where(ok, tl.sum(kt * qbar[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe), axis=0)
        m_i = m_new
    tl.store(m_ptr + pid, tl.where(m_i == float("-inf"), 0.0, m_i))
    tl.store(l_ptr + pid, l_i)


@triton.jit
def _euti_out(k_ptr, valid_ptr, norm_ptr, qbar_ptr, m_ptr, l_ptr, out_ptr, H, N, D, GROUP, scale,
              skb, skh, skn, skd, svb, svn, snb, snn,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    ok = tl.load(valid_ptr + b * svb + offs_n * svn, mask=offs_n < N, other=0) != 0
    acc = tl.zeros([BLOCK_N], tl.float32)
    for h in range(H):
        qbar = tl.load(qbar_ptr + (b * H + h) * D + offs_d, mask=offs_d < D, other=0.0)
        m_i = tl.load(m_ptr + b * H + h)
        l_i = tl.load(l_ptr + b * H + h)
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        kt = tl.load(k_ptr + b * skb + (h // GROUP) * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                     mask=ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        logits = tl.sum(kt * qbar[None, :], axis=1) * scale
        acc += tl.where(ok, tl.exp(logits - m_i) * inv_l, 0.0)
    hn = tl.load(norm_ptr + b * snb + offs_n * snn, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * N + offs_n, tl.where(ok, acc / H * hn, 0.0), mask=offs_n < N)


def euti_scores_triton(q: torch.Tensor, k: torch.Tensor, hidden_norm: torch.Tensor, valid: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.euti_scores` (arguments checked there)."""
    b, h, n, d = q.shape
    valid = valid.view(torch.uint8)
    qbar = torch.empty(b, h, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, h, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty(b, n, dtype=torch.float32, device=q.device)
    group = h // k.shape[1]
    bn, bd = 64, triton.next_power_of_2(d)
    _euti_stats[(b * h,)](q, k, valid, qbar, m, l, h, n, d, group, scale, *q.stride(), *k.stride(), *valid.stride(),
                          BLOCK_N=bn, BLOCK_D=bd)
    _euti_out[(b, triton.cdiv(n, bn))](k, valid, hidden_norm, qbar, m, l, out, h, n, d, group, scale, *k.stride(),
                                       *valid.stride(), *hidden_norm.stride(), BLOCK_N=bn, BLOCK_D=bd)
    return out
