"""Run metrics: accuracy breakdowns, analytic prefill FLOPs, timing and peak memory.

Prefill FLOPs are counted from the language model's config (2 FLOPs per multiply-add):
per decoder layer with T rows, the q/k/v/o projections ``2*T*H*(2*Hq + 2*Hkv)``, causal
attention scores and weighted values ``2*2*Hq*T*(T+1)/2``, the gated MLP ``2*3*T*H*I``; plus
the LM head on the last position ``2*H*V``. Pruning changes T per layer: tokens removed by a
vision or frames stage are gone from layer 0, tokens removed by an LLM stage at layer L from
layer L on. The vision tower is not counted (token pruning leaves it unchanged).
"""
from __future__ import annotations

import math
import resource
import sys
import time
from collections import defaultdict
from typing import Any, Iterable

import torch


def text_config(config: Any) -> Any:
    """The language model's config of a VLM config (or the config itself)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def layer_flops(cfg: Any, rows: int) -> float:
    """FLOPs of one decoder layer's prefill over ``rows`` tokens (causal attention)."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    hq = heads * head_dim
    hkv = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    proj = 2 * rows * h * (2 * hq + 2 * hkv)
    attn = 2 * 2 * hq * rows * (rows + 1) / 2
    mlp = 2 * 3 * rows * h * cfg.intermediate_size
    return float(proj + attn + mlp)


def prefill_flops(config: Any, rows_per_layer: list[int]) -> float:
    """Prefill FLOPs of the language model given the number of rows each layer processes."""
    cfg = text_config(config)
    if len(rows_per_layer) != cfg.num_hidden_layers:
        raise ValueError(f"rows_per_layer has {len(rows_per_layer)} entries, the model has {cfg.num_hidden_layers} layers")
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return sum(layer_flops(cfg, r) for r in rows_per_layer) + float(head)


def rows_per_layer(n_layers: int, seq_len: int, stats: dict[str, Any] | None) -> list[int]:
    """Rows each decoder layer sees for one sample of ``seq_len`` prompt tokens, from last_stats.

    ``stats`` is ``model.vlm_prune.last_stats`` of a batch of one: its ``stages`` records carry
    ``stage``, ``tokens_in``, ``tokens_out`` and, for LLM stages, ``layer``. None: unpruned.
    """
    rows = [seq_len] * n_layers
    for rec in (stats or {}).get("stages", []):
        removed = sum(rec["tokens_in"]) - sum(rec["tokens_out"])
        start = int(rec.get("layer", 0)) if rec["stage"] == "llm" else 0
        for i in range(start, n_layers):
            rows[i] -= removed
    return rows


class Timer:
    """Wall-clock seconds, synchronising CUDA first so queued kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class FirstTokenClock:
    """A generate() logits processor that notes when the first token's logits exist (TTFT).

    generate() calls logits processors once per step, the first time right after the prefill
    forward pass, so ``first - start`` is the time to first token.
    """

    def __init__(self, timer: Timer) -> None:
        self.timer = timer
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = self.timer.now()
        return scores


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated since the last reset, else the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy (overall and per category value), mean tokens, times and FLOPs of one run."""
    n = len(records)
    by_cat: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for k, v in r.get("categories", {}).items():
            by_cat[k][v].append(bool(r["correct"]))
    tokens_in = _mean(r.get("visual_tokens_in") for r in records)
    tokens_out = _mean(r.get("visual_tokens_out") for r in records)
    flops = _mean(r.get("prefill_flops") for r in records)
    flops_full = _mean(r.get("prefill_flops_unpruned") for r in records)
    return {
        "n": n,
        "correct": sum(bool(r["correct"]) for r in records),
        "accuracy": sum(bool(r["correct"]) for r in records) / n if n else math.nan,
        "unanswered": sum(r.get("pred") is None for r in records),
        "errors": sum(bool(r.get("error")) for r in records),
        "by_category": {
            k: {v: {"n": len(x), "accuracy": sum(x) / len(x)} for v, x in sorted(vals.items())}
            for k, vals in sorted(by_cat.items())
        },
        "visual_tokens_in": tokens_in,
        "visual_tokens_out": tokens_out,
        "kept_fraction": tokens_out / tokens_in if tokens_in else None,
        "ttft_s": _mean(r.get("ttft_s") for r in records),
        "generate_s": _mean(r.get("generate_s") for r in records),
        "prefill_flops": flops,
        "prefill_flops_unpruned": flops_full,
        "flops_ratio": flops / flops_full if flops and flops_full else None,
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in records), default=0),
    }
