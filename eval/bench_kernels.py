"""Time and measure the kernels of :mod:`vlm_prune.kernels` against their PyTorch references and
against the dense computation they replace.

    python -m vlm_prune.eval.bench_kernels                 # CPU: small shapes, references only
    python -m vlm_prune.eval.bench_kernels --device cuda   # real sizes, Triton vs reference vs dense

"dense" is what a method would do without the kernel: eager attention weights softmax(QK^T) over
all S x S positions (attention rows, EUTI), or the full N x N distance matrix (DBDPC blocks, as the
official PACT code does). Ratios are times of the dense (or reference) computation divided by the
kernel's. Peak memory is the extra memory of one call: torch.cuda.max_memory_allocated on CUDA,
and on CPU the bytes of tensors alive at once, tracked through PyTorch's dispatcher.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from vlm_prune import kernels as K

SHAPES = {
    # attention rows: B, H, Hkv, text query rows Q, sequence S, head dim d;  DBDPC: points N, features D
    "cpu": {"b": 1, "h": 8, "hkv": 2, "q": 32, "s": 1024, "d": 64, "n": 512, "feat": 256, "c": 128},
    # Qwen2-7B-like layer at 8k tokens; DBDPC on 4k kept visual tokens, 4 KV heads x 128 flattened
    "cuda": {"b": 1, "h": 28, "hkv": 4, "q": 64, "s": 8192, "d": 128, "n": 4096, "feat": 512, "c": 1024},
}


@dataclass
class Row:
    kernel: str
    shape: str
    torch_ms: float
    triton_ms: float | None
    dense_ms: float | None
    torch_mb: float
    triton_mb: float | None
    dense_mb: float | None
    max_abs_diff: float | None


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors created under this mode and alive at the same time (CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def _release(self, ptr: int, nbytes: int) -> None:
        self.seen.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if ptr not in self.seen and nbytes:
                    self.seen.add(ptr)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._release, ptr, nbytes)
        return out


def measure(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float, object]:
    """Median milliseconds over ``repeats`` calls (after one warm-up), peak extra MB, last output."""
    out = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    del out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with _LiveBytes() as mode:
            out = fn()
        peak = mode.peak
    return statistics.median(times), peak / 2**20, out


def eager_weights(q_all: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """What eager attention materialises: causal softmax(Q K^T * scale) over all S x S, [B, H, S, S]."""
    k = k.repeat_interleave(q_all.shape[1] // k.shape[1], dim=1)
    s = q_all.shape[2]
    logits = torch.matmul(q_all, k.transpose(2, 3)) * scale
    causal = torch.full((s, s), float("-inf"), device=q_all.device, dtype=logits.dtype).triu(1)
    return torch.softmax(logits + causal, dim=-1, dtype=torch.float32).to(q_all.dtype)


def cases(shape: dict, device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, dict]]:
    """(name, shape text, {"torch": fn, "triton": fn, "dense": fn or None}) for every kernel."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    b, h, hkv, nq, s, d = (shape[k] for k in ("b", "h", "hkv", "q", "s", "d"))
    n, feat, c = shape["n"], shape["feat"], shape["c"]
    scale = d**-0.5
    q_all, k = rnd(b, h, s, d), rnd(b, hkv, s, d)
    q_rows = q_all[:, :, s - nq :]  # the last Q rows (text query), causal
    q_pos = torch.arange(s - nq, s, device=device).expand(b, nq)
    k_pos = torch.arange(s, device=device).expand(b, s)
    rows_mask = (k_pos[:, None, :] <= q_pos[:, :, None])
    hidden_norm = rnd(b, s).abs().float()
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    x = rnd(n, feat)
    rho = K.density_rank(K.density_torch(x))
    hidden = rnd(b, s, 4 * d)
    index = torch.sort(torch.randperm(s, generator=g)[: s // 2]).values.to(device).expand(b, -1)
    assign = torch.randint(-1, c, (n,), generator=g).to(device)

    def both(fn: Callable, *args, **kw) -> dict:
        return {be: (lambda be=be: fn(*args, backend=be, **kw)) for be in ("torch", "triton")}

    def dense_dist() -> torch.Tensor:
        return K.cosine_distance_torch(x, x)

    def dense_nearest():
        dist = dense_dist()
        idx = torch.arange(n, device=device)
        denser = (rho[None, :] > rho[:, None]) | ((rho[None, :] == rho[:, None]) & (idx[None, :] < idx[:, None]))
        return torch.where(denser, dist, float("inf")).min(1)

    att = f"B{b} H{h}/{hkv} Q{nq} S{s} d{d}"
    return [
        ("attention_to_keys", att, {**both(K.attention_to_keys, q_rows, k, rows_mask, scale),
                                    "dense": lambda: eager_weights(q_all, k, scale)[:, :, s - nq :].float().mean(1)}),
        ("attention_key_scores", att, {**both(K.attention_key_scores, q_rows, k, scale=scale, q_pos=q_pos, k_pos=k_pos),
                                       "dense": lambda: eager_weights(q_all, k, scale)[:, :, s - nq :].float().sum(2).mean(1)}),
        ("euti_scores", f"B{b} H{h}/{hkv} N{s} d{d}", {**both(K.euti_scores, q_all, k, hidden_norm, valid, scale),
                                                        "dense": lambda: eager_weights(q_all, k, scale).float().mean((1, 2)) * hidden_norm}),
        ("cosine_distance", f"N{n} D{feat}", {**both(K.cosine_distance, x, x), "dense": None}),
        ("density", f"N{n} D{feat}", {**both(K.density, x), "dense": lambda: torch.exp(-((dense_dist() / 2) ** 2)).sum(1)}),
        ("nearest_denser", f"N{n} D{feat}", {**both(K.nearest_denser, x, rho), "dense": dense_nearest}),
        ("gather_rows", f"B{b} S{s} K{s // 2} D{4 * d}", {**both(K.gather_rows, hidden, index, torch.ones_like(index, dtype=torch.bool)), "dense": None}),
        ("scatter_mean", f"N{n} C{c} D{feat}", {**both(K.scatter_mean, x, assign, c), "dense": None}),
    ]


def _max_diff(a, b) -> float:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    diffs = []
    for u, v in zip(a, b):
        u, v = u.float(), v.float()
        same_inf = torch.isinf(u) & torch.isinf(v)
        diffs.append(float(torch.where(same_inf, 0.0, (u - v).abs()).max()) if u.numel() else 0.0)
    return max(diffs)


def run(device: torch.device, dtype: torch.dtype, repeats: int, use_triton: bool) -> list[Row]:
    shape = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    rows = []
    for name, text, fns in tqdm(cases(shape, device, dtype), desc="kernels", leave=False):
        t_ms, t_mb, ref = measure(fns["torch"], device, repeats)
        tr_ms = tr_mb = diff = dn_ms = dn_mb = None
        if use_triton:
            tr_ms, tr_mb, out = measure(fns["triton"], device, repeats)
            diff = _max_diff(out, ref)
        if fns["dense"] is not None:
            dn_ms, dn_mb, _ = measure(fns["dense"], device, repeats)
        rows.append(Row(name, text, t_ms, tr_ms, dn_ms, t_mb, tr_mb, dn_mb, diff))
    return rows


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None or den == 0 else f"{num / den:.1f}x"


def table(rows: list[Row]) -> str:
    head = ["kernel", "shape", "torch ms", "triton ms", "dense ms", "torch/triton", "dense/triton", "dense/torch",
            "MB torch", "MB triton", "MB dense", "max|diff|"]
    body = [[r.kernel, r.shape, _fmt(r.torch_ms), _fmt(r.triton_ms), _fmt(r.dense_ms), _ratio(r.torch_ms, r.triton_ms),
             _ratio(r.dense_ms, r.triton_ms), _ratio(r.dense_ms, r.torch_ms), _fmt(r.torch_mb, ".1f"),
             _fmt(r.triton_mb, ".1f"), _fmt(r.dense_mb, ".1f"), _fmt(r.max_abs_diff, ".1e")] for r in rows]
    return text_table(head, body)


def text_table(head: list[str], body: list[list[str]]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [" | ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (small shapes, references only) or cuda (real sizes)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 3 on CPU, 10 on CUDA)")
    p.add_argument("--json", default=None, help="also write the rows and their provenance to this JSON file (a result "
                                                "file of kind 'kernels' for the results page)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; run without --device for the CPU run")
    use_triton = device.type == "cuda" and K.triton_available()
    repeats = args.repeats or (10 if device.type == "cuda" else 3)
    if device.type == "cuda":
        print(f"CUDA run on {torch.cuda.get_device_name(device)}, {args.dtype}, median of {repeats}"
              + ("" if use_triton else " - Triton is not installed, references only"), flush=True)
    else:
        print(f"CPU run (small shapes, {args.dtype}, median of {repeats}): Triton kernels need CUDA, "
              "so only the PyTorch references and the dense computations are timed", flush=True)
    rows = run(device, getattr(torch, args.dtype), repeats, use_triton)
    print(table(rows))
    if args.json:
        from vlm_prune.eval.bench import meta

        with open(args.json, "w") as f:
            json.dump({"meta": meta("kernels", args, "python -m vlm_prune.eval.bench_kernels"),
                       "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
