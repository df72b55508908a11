"""Statistics of ``vlm-prune bench``: seeds pooled, paired 95% intervals, matched budgets.

Every bench row keeps its per-sample correctness (``correct``, a string of 0/1 over the model's
test samples). Rows of the same (model, method, keep) trained with different model seeds are
pooled: the mean accuracy over seeds, their spread (min and max), and per-sample scores
concatenated seed after seed, so two methods are always compared on the same (seed, sample) pairs.

Matched budgets: a method's accuracy at a target x (fraction of visual tokens at the end of the
LLM, fraction averaged over decoder layers, or prefill FLOPs ratio) is interpolated linearly
between its two runs that bracket x, per sample (score = w * correct_lo + (1 - w) * correct_hi),
with the unpruned run as the point x = 1. A method whose runs do not reach x has no value there:
nothing is extrapolated. Paired intervals: the mean per-sample difference +- 1.96 standard errors.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

#: the token fractions the matched view reports (25%, 11% and 5% of the visual tokens)
MATCHED_FRACTIONS = (0.25, 0.11, 0.05)
#: x axes of the matched view: row key -> column label
AXES = {"kept_fraction": "final tokens", "layer_avg_fraction": "layer-avg tokens", "flops_ratio": "FLOPs"}
Z95 = 1.959963984540054
#: the rows every method is compared with at each matched target, those a model has: the required
#: saturation baseline and the frames / vision methods the video and image records stand against
REFERENCES = ("saturation", "quota", "keyscore", "divprune")


def scores(row: dict[str, Any]) -> np.ndarray:
    """Per-sample correctness of a (pooled) row as floats."""
    return np.frombuffer(row["correct"].encode(), dtype=np.uint8).astype(np.float64) - ord("0")


def mean_ci(x: np.ndarray) -> tuple[float, float]:
    """Mean and the half-width of its normal 95% interval."""
    if x.size < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), Z95 * float(x.std(ddof=1)) / math.sqrt(x.size)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of a - b over paired samples and the half-width of its 95% interval."""
    if a.shape != b.shape:
        raise ValueError(f"paired comparison needs the same samples, got {a.shape} and {b.shape}")
    return mean_ci(a - b)


def chance_retention(accuracy: float, base: float, chance: float) -> float | None:
    """(accuracy - chance) / (unpruned - chance): 1 = nothing lost, 0 = no better than guessing."""
    return None if base - chance <= 1e-9 else (accuracy - chance) / (base - chance)


def pool_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, method, keep): means over seeds, spread, pooled per-sample scores."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["method"], r["keep"])].append(r)
    out = []
    for (model, method, keep), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.get("seed", 0))
        accs = [r["accuracy"] for r in rs]
        pooled = {"model": model, "method": method, "keep": keep, "seeds": [r.get("seed", 0) for r in rs],
                  "n": sum(r["n"] for r in rs), "correct": "".join(r["correct"] for r in rs),
                  "accuracy": float(np.mean(accs)), "accuracy_min": min(accs), "accuracy_max": max(accs),
                  "notes": rs[0].get("notes", "")}
        pooled["accuracy_ci"] = mean_ci(scores(pooled))[1]
        for key in ("visual_tokens_in", "visual_tokens_out", "visual_tokens_layer_avg", "kept_fraction",
                    "layer_avg_fraction", "flops_ratio", "prefill_ratio", "prefill_cpu_ratio", "chance",
                    "retention", "chance_retention"):
            values = [r.get(key) for r in rs]
            pooled[key] = None if any(v is None for v in values) else float(np.mean(values))
        families = sorted({f for r in rs for f in r.get("by_family", {})})
        pooled["by_family"] = {f: float(np.mean([r["by_family"][f] for r in rs if f in r.get("by_family", {})]))
                               for f in families}
        out.append(pooled)
    return out


def interpolate(points: list[tuple[float, np.ndarray]], x: float) -> np.ndarray | None:
    """Per-sample scores at ``x`` from (x_i, scores_i) points, linear between the bracketing pair.

    Points at the same x are averaged. None when x lies outside the points' range.
    """
    by_x: dict[float, list[np.ndarray]] = defaultdict(list)
    for px, s in points:
        by_x[round(px, 9)].append(s)
    xs = sorted(by_x)
    if not xs or x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return None
    merged = {k: np.mean(by_x[k], axis=0) for k in xs}
    for lo, hi in zip(xs, xs[1:] + [xs[-1]]):
        if lo - 1e-9 <= x <= hi + 1e-9:
            if hi - lo < 1e-9:
                return merged[lo]
            w = (hi - x) / (hi - lo)
            return w * merged[lo] + (1 - w) * merged[hi]
    return merged[xs[-1]]


def family_mask(qtypes: list[str], seeds: int, family: str | None) -> np.ndarray:
    """Boolean mask over pooled (seed-major) samples of one family (all when None)."""
    one = np.ones(len(qtypes), bool) if family is None else np.asarray([q == family for q in qtypes])
    return np.tile(one, seeds)


def flops_targets(pooled: list[dict[str, Any]], model: str, fractions: tuple[float, ...] = MATCHED_FRACTIONS) -> list[float | None]:
    """The FLOPs ratios of pruning ``fractions`` of the visual tokens before the LLM: the random
    baseline's FLOPs ratio interpolated at those kept fractions (None without a random row there)."""
    rows = sorted((r for r in pooled if r["model"] == model and r["method"] == "random" and r["kept_fraction"] is not None),
                  key=lambda r: r["kept_fraction"])
    if not rows:
        return [None] * len(fractions)
    xs = [1.0] + [r["kept_fraction"] for r in rows]
    ys = [1.0] + [r["flops_ratio"] for r in rows]
    order = np.argsort(xs)
    xs, ys = np.asarray(xs)[order], np.asarray(ys)[order]
    return [float(np.interp(f, xs, ys)) if xs[0] - 1e-9 <= f else None for f in fractions]


def matched(pooled: list[dict[str, Any]], qtypes: dict[str, list[str]],
            fractions: tuple[float, ...] = MATCHED_FRACTIONS) -> list[dict[str, Any]]:
    """The matched view: every (model, family, axis, target, method) with its interpolated accuracy.

    Entries: model, family ("all" or a question type), axis (a key of AXES), target, method,
    accuracy (None when the method does not reach the target) with ``ci`` (its 95% half-width),
    per family the best method with paired 95% intervals against the runner-up, the saturation
    baseline and random, and ``vs_references``: every method against each of :data:`REFERENCES`
    the model has at the target (method -> reference -> {diff, ci}, paired).
    """
    out = []
    for model in dict.fromkeys(r["model"] for r in pooled):
        mine = [r for r in pooled if r["model"] == model]
        base = next((r for r in mine if r["method"] == "none"), None)
        if base is None:
            continue
        n_seeds = len(base["seeds"])
        methods = [m for m in dict.fromkeys(r["method"] for r in mine) if m != "none"]
        targets = {"kept_fraction": list(fractions), "layer_avg_fraction": list(fractions),
                   "flops_ratio": flops_targets(pooled, model, fractions)}
        for family in [None] + sorted(set(qtypes[model])):
            mask = family_mask(qtypes[model], n_seeds, family)
            for axis, values in targets.items():
                for frac, target in zip(fractions, values):
                    if target is None:
                        continue
                    at: dict[str, np.ndarray | None] = {}
                    for m in methods:
                        pts = [(1.0, scores(base))] + [(r[axis], scores(r)) for r in mine
                                                       if r["method"] == m and r.get(axis) is not None]
                        s = interpolate(pts, target)
                        at[m] = None if s is None or s.shape != mask.shape else s[mask]
                    out.append(_compare(model, family or "all", axis, frac, target, at))
    return out


def _compare(model: str, family: str, axis: str, frac: float, target: float, at: dict[str, np.ndarray | None]) -> dict[str, Any]:
    acc = {m: (None if s is None else float(s.mean())) for m, s in at.items()}
    ranked = sorted((m for m in acc if acc[m] is not None), key=lambda m: -acc[m])
    refs = [r for r in REFERENCES if at.get(r) is not None]
    entry: dict[str, Any] = {
        "model": model, "family": family, "axis": axis, "fraction": frac, "target": target, "accuracy": acc,
        "ci": {m: (None if s is None else mean_ci(s)[1]) for m, s in at.items()},
        "best": ranked[0] if ranked else None,
        "vs_references": {m: {r: dict(zip(("diff", "ci"), paired(s, at[r]))) for r in refs if r != m}
                          for m, s in at.items() if s is not None},
    }
    if ranked:
        best = at[ranked[0]]
        for label, other in (("runner_up", ranked[1] if len(ranked) > 1 else None), ("saturation", "saturation"),
                             ("random", "random")):
            if other is not None and other != ranked[0] and at.get(other) is not None:
                d, h = paired(best, at[other])
                entry[f"vs_{label}"] = {"method": other, "diff": d, "ci": h}
    return entry
