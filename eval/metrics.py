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
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable

import torch

from vlm_prune.eval import leaderboard
from vlm_prune.eval.sharding import status


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


def _accuracy(rows: list[dict[str, Any]]) -> float:
    return sum(bool(r["correct"]) for r in rows) / len(rows) if rows else math.nan


def _mean_over(field: str) -> Callable[[list[dict[str, Any]]], float]:
    def score(rows: list[dict[str, Any]]) -> float:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            groups[r.get("categories", {}).get(field, "")].append(r)
        return sum(_accuracy(g) for g in groups.values()) / len(groups) if groups else math.nan
    return score


# The harness's lenient reading of each benchmark's aggregate, over the answered questions:
# MLVU's M-Avg and MVBench's average are means over the tasks present; the others plain accuracy.
# The headline is lmms-eval's own figure (vlm_prune.eval.leaderboard).
LENIENT: dict[str, tuple[str, Callable[[list[dict[str, Any]]], float]]] = {
    "mlvu": ("M-Avg (mean over tasks)", _mean_over("task")),
    "mvbench": ("mean over tasks", _mean_over("task")),
    "videomme": ("accuracy", _accuracy),
    "nextqa": ("accuracy", _accuracy),
    "egoschema": ("accuracy", _accuracy),
}


def _reason(record: dict[str, Any]) -> str:
    """A short class of why a question was not answered: "missing media", "VideoDecodeError", ..."""
    if status(record) == "skipped":
        return "missing media" if str(record.get("reason", "")).startswith("missing") else str(record.get("reason"))
    return str(record.get("error", "error")).split(":", 1)[0]


def summarize(records: list[dict[str, Any]], dataset: str = "generic") -> dict[str, Any]:
    """Counts (questions, evaluated, skipped, failed, with reasons), the official score of the
    dataset and the accuracy over the evaluated questions (overall and per category value),
    mean tokens, decode / model seconds, FLOPs and peak memory of one run.

    official: the benchmark's leaderboard figure by lmms-eval's rules, from the records'
    ``leaderboard_*`` fields (:func:`vlm_prune.eval.leaderboard.annotate`; NaN without them);
    lenient: the same aggregate over the harness's own reading (``pred`` / ``correct``);
    read_differently: answered questions the two read as different letters. Datasets without a
    leaderboard rule: official = lenient = accuracy, read_differently None."""
    ok = [r for r in records if status(r) == "ok"]
    lost = {k: [r for r in records if status(r) == k] for k in ("skipped", "failed")}
    by_cat: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        for k, v in r.get("categories", {}).items():
            by_cat[k][v].append(bool(r["correct"]))
    lenient_name, lenient = LENIENT.get(dataset, ("accuracy", _accuracy))
    lenient_score = lenient(ok) if ok else math.nan
    ruled = dataset in leaderboard.NAMES
    headline = leaderboard.figure(dataset, ok) if ruled else lenient_score
    tokens_in = _mean(r.get("visual_tokens_in") for r in ok)
    tokens_out = _mean(r.get("visual_tokens_out") for r in ok)
    flops = _mean(r.get("prefill_flops") for r in ok)
    flops_full = _mean(r.get("prefill_flops_unpruned") for r in ok)
    return {
        "n": len(records),
        "evaluated": len(ok),
        "skipped": len(lost["skipped"]),
        "failed": len(lost["failed"]),
        "not_evaluated": {k: dict(Counter(_reason(r) for r in rows).most_common()) for k, rows in lost.items()},
        "not_evaluated_examples": [
            {"id": r["id"], "status": status(r), "why": r.get("reason") or r.get("error")}
            for r in (lost["skipped"] + lost["failed"])[:10]
        ],
        "official_name": leaderboard.NAMES.get(dataset, lenient_name),
        "official": math.nan if headline is None else headline,
        "lenient_name": f"harness {lenient_name}",
        "lenient": lenient_score,
        "read_differently": leaderboard.read_differently(ok) if ruled else None,
        "random_draws": sum(bool(r.get("leaderboard_random")) for r in ok) if ruled else None,
        # answered on a truncated video (scored on the frames that decode): counted like the lost ones
        "truncated": sum(bool(r.get("truncated")) for r in ok),
        "truncated_examples": [{"id": r["id"], **r["truncated"]} for r in ok if r.get("truncated")][:10],
        "correct": sum(bool(r["correct"]) for r in ok),
        "accuracy": _accuracy(ok),
        "unanswered": sum(r.get("pred") is None for r in ok),
        "by_category": {
            k: {v: {"n": len(x), "accuracy": sum(x) / len(x)} for v, x in sorted(vals.items())}
            for k, vals in sorted(by_cat.items())
        },
        "visual_tokens_in": tokens_in,
        "visual_tokens_out": tokens_out,
        "kept_fraction": tokens_out / tokens_in if tokens_in else None,
        "ttft_s": _mean(r.get("ttft_s") for r in ok),
        "generate_s": _mean(r.get("generate_s") for r in ok),
        "decode_s": sum(r.get("decode_s") or 0.0 for r in ok) / len(ok) if ok else None,
        "decode_wait_s": _mean(r.get("decode_wait_s") for r in ok),
        "prefill_flops": flops,
        "prefill_flops_unpruned": flops_full,
        "flops_ratio": flops / flops_full if flops and flops_full else None,
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in ok), default=0),
    }


def counts_line(row: dict[str, Any]) -> str:
    """ "evaluated 10 of 12 (skipped 1: missing media 1; failed 1: VideoDecodeError 1)" """
    parts = []
    for kind in ("skipped", "failed"):
        if row.get(kind):
            why = ", ".join(f"{k} {v}" for k, v in row["not_evaluated"][kind].items())
            parts.append(f"{kind} {row[kind]}: {why}")
    if row.get("truncated"):
        parts.append(f"{row['truncated']} of the evaluated on truncated videos (scored on the frames that decode)")
    return f"evaluated {row['evaluated']} of {row['n']}" + (f" ({'; '.join(parts)})" if parts else "")
