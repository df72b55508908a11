"""Triton kernels behind :mod:`vlm_prune.kernels.attention_rows` (imported only when used).

Pass 1 (``_row_stats``): one program per (batch*head, block of query rows) streams over the keys
and keeps a running max ``m`` and normaliser ``l`` per row (online softmax).
Pass 2 recomputes each logits tile and turns it into probabilities exp(x - m) / l:
``_rows_out`` writes the head mean per (row, key), ``_keys_out`` sums rows and heads per key.
The dots take q and k in their own dtype and accumulate in float32: bfloat16 / float16 inputs run
on tensor cores (their products are exact in float32, so results match the float32 reference up
to summation order); float32 inputs use exact IEEE float32 dots (no TF32) on smaller tiles.
Block sizes were chosen so no launch spills registers on sm_80 or sm_90
(``python -m vlm_prune.eval.kernel_report``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scores_tile(q_tile, qp, k_base, mask_base, kpos_base, offs_q, offs_s, offs_d, Q, S, D,
                 sks, skd, smq, sms, skps, scale, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """Logits [BLOCK_Q, BLOCK_S] (-inf where not allowed) and the allowed mask."""
    k_tile = tl.load(k_base + offs_s[:, None] * sks + offs_d[None, :] * skd,
                     mask=(offs_s[:, None] < S) & (offs_d[None, :] < D), other=0.0)
    logits = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * scale
    allowed = (offs_q[:, None] < Q) & (offs_s[None, :] < S)
    if HAS_MASK:
        m = tl.load(mask_base + offs_q[:, None] * smq + offs_s[None, :] * sms, mask=allowed, other=0)
        allowed = allowed & (m != 0)
    if CAUSAL:
        kp = tl.load(kpos_base + offs_s * skps, mask=offs_s < S, other=0)
        allowed = allowed & (kp[None, :] <= qp[:, None])
    return tl.where(allowed, logits, float("-inf")), allowed


@triton.jit
def _row_stats(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr,
               H, Q, S, D, GROUP, scale,
               sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms, sqpb, sqpq, skpb, skps,
               HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_tile = tl.load(q_ptr + b * sqb + h * sqh + offs_q[:, None] * sqq + offs_d[None, :] * sqd,
                     mask=(offs_q[:, None] < Q) & (offs_d[None, :] < D), other=0.0)
    qp = tl.load(qpos_ptr + b * sqpb + offs_q * sqpq, mask=offs_q < Q, other=0) if CAUSAL else offs_q
    k_base = k_ptr + b * skb + (h // GROUP) * skh
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        logits, _ = _scores_tile(q_tile, qp, k_base, mask_ptr + b * smb, kpos_ptr + b * skpb, offs_q, offs_s,
                                       offs_d, Q, S, D, sks, skd, smq, sms, skps, scale, HAS_MASK, CAUSAL)
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(p, axis=1)
        m_i = m_new
    out = pid_bh * Q + offs_q
    tl.store(m_ptr + out, tl.where(m_i == float("-inf"), 0.0, m_i), mask=offs_q < Q)
    tl.store(l_ptr + out, l_i, mask=offs_q < Q)


@triton.jit
def _prob_tile(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, b, h, pid_bh, offs_q, offs_s, offs_d,
               Q, S, D, GROUP, scale, sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms, sqpb, sqpq, skpb, skps,
               HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """Normalised probabilities [BLOCK_Q, BLOCK_S] of head h (0 where not allowed)."""
    q_tile = tl.load(q_ptr + b * sqb + h * sqh + offs_q[:, None] * sqq + offs_d[None, :] * sqd,
                     mask=(offs_q[:, None] < Q) & (offs_d[None, :] < D), other=0.0)
    qp = tl.load(qpos_ptr + b * sqpb + offs_q * sqpq, mask=offs_q < Q, other=0) if CAUSAL else offs_q
    logits, allowed = _scores_tile(q_tile, qp, k_ptr + b * skb + (h // GROUP) * skh, mask_ptr + b * smb,
                                   kpos_ptr + b * skpb, offs_q, offs_s, offs_d, Q, S, D, sks, skd, smq, sms, skps,
                                   scale, HAS_MASK, CAUSAL)
    m_i = tl.load(m_ptr + pid_bh * Q + offs_q, mask=offs_q < Q, other=0.0)
    l_i = tl.load(l_ptr + pid_bh * Q + offs_q, mask=offs_q < Q, other=0.0)
    inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    return tl.where(allowed, tl.exp(logits - m_i[:, None]) * inv_l[:, None], 0.0)


@triton.jit
def _rows_out(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, out_ptr,
              H, Q, S, D, GROUP, scale,
              sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms, sqpb, sqpq, skpb, skps,
              HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_Q, BLOCK_S], tl.float32)
    for h in range(H):
        acc += _prob_tile(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, b, h, b * H + h, offs_q, offs_s,
                          offs_d, Q, S, D, GROUP, scale, sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms,
                          sqpb, sqpq, skpb, skps, HAS_MASK, CAUSAL)
    tl.store(out_ptr + b * Q * S + offs_q[:, None] * S + offs_s[None, :], acc / H,
             mask=(offs_q[:, None] < Q) & (offs_s[None, :] < S))


@triton.jit
def _keys_out(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, w_ptr, out_ptr,
              H, Q, S, D, GROUP, scale, head_scale,
              sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms, sqpb, sqpq, skpb, skps, swb, swh, swq,
              HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_W: tl.constexpr,
              BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_S], tl.float32)
    for h in range(H):
        for q0 in range(0, Q, BLOCK_Q):
            offs_q = q0 + tl.arange(0, BLOCK_Q)
            p = _prob_tile(q_ptr, k_ptr, mask_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, b, h, b * H + h, offs_q, offs_s,
                           offs_d, Q, S, D, GROUP, scale, sqb, sqh, sqq, sqd, skb, skh, sks, skd, smb, smq, sms,
                           sqpb, sqpq, skpb, skps, HAS_MASK, CAUSAL)
            if HAS_W:
                w = tl.load(w_ptr + b * swb + h * swh + offs_q * swq, mask=offs_q < Q, other=0.0).to(tl.float32)
                p = p * w[:, None]
            acc += tl.sum(p, axis=0)
    tl.store(out_ptr + b * S + offs_s, acc * head_scale, mask=offs_s < S)


def _launch_config(q: torch.Tensor) -> tuple[tuple[int, int, int], dict]:
    """((BLOCK_Q, BLOCK_S, BLOCK_D), launch options) for q's dtype (see the module docstring)."""
    nq, d = q.shape[2], q.shape[3]
    bd = max(16, triton.next_power_of_2(d))
    if q.dtype == torch.float32:
        return (min(32, max(16, triton.next_power_of_2(nq))), 64, bd), {"num_warps": 8, "num_stages": 2}
    return (min(64, max(16, triton.next_power_of_2(nq))), 64, bd), {"num_warps": 8, "num_stages": 3}


def _same_dtype(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dot needs one operand dtype: mixed inputs are both computed in float32."""
    return (q, k) if q.dtype == k.dtype else (q.float(), k.float())


def _common(q, k, mask, q_pos, k_pos):
    """Kernel arguments shared by both passes; mask is [B, Qm, S] bool with Qm = 1 or Q."""
    _, h, nq, d = q.shape
    s = k.shape[2]
    dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    if mask is not None:
        mask = mask.view(torch.uint8)
        mstr = (mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2))
    else:
        mask, mstr = dummy, (0, 0, 0)
    qpos, kpos = (q_pos, k_pos) if q_pos is not None else (dummy, dummy)
    pstr = (qpos.stride(0), qpos.stride(1), kpos.stride(0), kpos.stride(1)) if q_pos is not None else (0, 0, 0, 0)
    ptrs = (q, k, mask, qpos, kpos)
    sizes = (h, nq, s, d, h // k.shape[1])
    strides = (*q.stride(), *k.stride(), *mstr, *pstr)
    return ptrs, sizes, strides, {"HAS_MASK": mask is not dummy, "CAUSAL": q_pos is not None}


def _stats(q, k, scale, ptrs, sizes, strides, flags, config):
    b, h, nq, _ = q.shape
    m = torch.empty(b, h, nq, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    (bq, bs, bd), options = config
    _row_stats[(b * h, triton.cdiv(nq, bq))](*ptrs, m, l, *sizes, scale, *strides, **flags,
                                            BLOCK_Q=bq, BLOCK_S=bs, BLOCK_D=bd, **options)
    return m, l


def attention_to_keys_triton(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.attention_to_keys` (arguments checked there)."""
    q, k = _same_dtype(q, k)
    b, _, nq, _ = q.shape
    s = k.shape[2]
    ptrs, sizes, strides, flags = _common(q, k, key_mask, None, None)
    config = _launch_config(q)
    m, l = _stats(q, k, scale, ptrs, sizes, strides, flags, config)
    out = torch.empty(b, nq, s, dtype=torch.float32, device=q.device)
    (bq, bs, bd), options = config
    _rows_out[(b, triton.cdiv(nq, bq), triton.cdiv(s, bs))](*ptrs, m, l, out, *sizes, scale, *strides, **flags,
                                                            BLOCK_Q=bq, BLOCK_S=bs, BLOCK_D=bd, **options)
    return out


def attention_key_scores_triton(q, k, *, scale, key_mask=None, q_pos=None, k_pos=None, row_weights=None,
                                head_reduce="mean") -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.attention_key_scores` (arguments checked there)."""
    q, k = _same_dtype(q, k)
    b, h = q.shape[:2]
    s = k.shape[2]
    ptrs, sizes, strides, flags = _common(q, k, None if key_mask is None else key_mask[:, None, :], q_pos, k_pos)
    config = _launch_config(q)
    m, l = _stats(q, k, scale, ptrs, sizes, strides, flags, config)
    if row_weights is None:
        w, wstr = m, (0, 0, 0)
    elif row_weights.dim() == 2:
        w, wstr = row_weights, (row_weights.stride(0), 0, row_weights.stride(1))
    else:
        w, wstr = row_weights, row_weights.stride()
    out = torch.empty(b, s, dtype=torch.float32, device=q.device)
    (bq, bs, bd), options = config
    head_scale = 1.0 / h if head_reduce == "mean" else 1.0
    _keys_out[(b, triton.cdiv(s, bs))](*ptrs, m, l, w, out, *sizes, scale, head_scale, *strides, *wstr, **flags,
                                       HAS_W=row_weights is not None, BLOCK_Q=bq, BLOCK_S=bs, BLOCK_D=bd, **options)
    return out
