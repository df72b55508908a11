"""``vlm-prune tune``: which method, budget and knobs meet a quality floor and / or a cost ceiling.

The search space is every method the model's adapter accepts (frames, vision / vit and llm
stages), at each keep of a grid, with the pruning layer of single-layer methods (FastV, PACT,
DART, ...) at a few depths, and on video models the frames x vision and frames x llm pipelines
(``max_stages=3`` adds frames x vision x llm). The search is a race (S-Race's, Zhang et al. 2015,
for two objectives: accuracy up, cost down): every setting answers the first ``RUNG`` samples of
the tuning set, and after each further ``RUNG`` samples a setting goes on only while the answers so
far cannot rule it out of the front or of the recommendation (:func:`contenders`), so the settings
left after the last rung have answered the whole set. The unpruned model's answers and every
setting's answers are cached per sample under ``--out`` (``runs/<setting>/samples.rank<r>.jsonl``,
the harness's files), so each sample is answered once per setting, a rerun resumes, and ranks
(``torchrun`` / ``accelerate launch``) share the work with :func:`vlm_prune.eval.sharding.shard`.
(Optuna's pruners and samplers do not serve here: its pruners need one objective -
``Trial.report`` refuses multi-objective studies - and its samplers draw settings rather than
race a fixed grid; the selection is the one function :func:`contenders`.)

The front is the set of surviving settings no other survivor beats on accuracy at no more cost,
all measured on the full tuning set, each with its retention (accuracy over the unpruned model's)
and the paired 95% interval of that retention. The recommendation is the cheapest front setting
whose retention's LOWER end meets ``min_retention`` and whose costs meet the ceilings (with only
ceilings: the most accurate one within them); it is written as a config file
(:mod:`vlm_prune.config`) that wrap(), ``vlm-prune eval`` and ``vlm-prune serve`` read.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from vlm_prune.config import PruneConfig, save_config

Z95 = 1.959963984540054
#: keeps searched by default (fractions of each image's / video's visual tokens)
KEEPS = (0.5, 0.25, 0.11)
QUICK_KEEPS = (0.5, 0.25)
#: depths (fractions of the decoder) where single-layer methods are tried, besides their default
LAYER_FRACTIONS = (0.1, 0.25, 0.5)
#: samples per rung (the first, and each one after it); the tuning set's default size (quick: 48)
RUNG, SAMPLES, QUICK_SAMPLES = 16, 288, 48
#: the level of the sign test that drops a setting another one beats (one-sided)
DROP_ALPHA = 0.05
#: the floor used when no goal is given
DEFAULT_MIN_RETENTION = 0.95
#: shipped toy models (vlm_prune.eval.synthetic) by name
TOY_MODELS = ("image", "video")


class TuneError(ValueError):
    """A goal, a flag or a model the tuner cannot work with; one line says what to change."""


@dataclass(frozen=True)
class Goal:
    """A floor on quality and / or ceilings on cost (any of them may be None).

    min_retention: the lower end of the paired 95% interval of accuracy / unpruned accuracy;
    max_flops: ideal prefill FLOPs over the unpruned model's; max_tokens: visual tokens per sample
    reaching the LLM's last layer; max_time: measured prefill time (TTFT on the harness) ratio.
    """

    min_retention: float | None = None
    max_flops: float | None = None
    max_tokens: float | None = None
    max_time: float | None = None

    def __post_init__(self) -> None:
        if self.min_retention is not None and not 0 < self.min_retention <= 1:
            raise TuneError(f"--min-retention must lie in (0, 1] (a fraction of the unpruned accuracy), "
                            f"got {self.min_retention:g}")
        for name in ("max_flops", "max_time"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise TuneError(f"--{name.replace('_', '-')} must lie in (0, 1] (a ratio to the unpruned model), "
                                f"got {value:g}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise TuneError(f"--max-tokens must be > 0 visual tokens, got {self.max_tokens:g}")

    def or_default(self) -> Goal:
        """This goal, or the default floor when it names nothing."""
        if any(v is not None for v in asdict(self).values()):
            return self
        return Goal(min_retention=DEFAULT_MIN_RETENTION)

    def text(self) -> str:
        parts = []
        if self.min_retention is not None:
            parts.append(f"retention >= {self.min_retention:g} (lower end of the paired 95% interval)")
        for key, label in (("max_flops", "prefill FLOPs ratio"), ("max_tokens", "visual tokens"),
                           ("max_time", "prefill time ratio")):
            if getattr(self, key) is not None:
                parts.append(f"{label} <= {getattr(self, key):g}")
        return ", ".join(parts)


# ---- the search space -------------------------------------------------------------------------------
def layer_variants(default: int, n_layers: int) -> list[int]:
    """The default pruning layer (moved inside the decoder) and LAYER_FRACTIONS of the depth, in [1, n_layers - 1]."""
    def clamp(x: float) -> int:
        return max(1, min(n_layers - 1, round(x)))

    return sorted({clamp(default)} | {clamp(f * n_layers) for f in LAYER_FRACTIONS})


def base_knobs(name: str, n_layers: int) -> dict[str, Any]:
    """The knobs that fit method ``name`` into an ``n_layers`` decoder (bench.fit_layer), as config values."""
    from vlm_prune.eval.bench import fit_layer
    from vlm_prune.registry import method_class, method_knobs

    fitted, _ = fit_layer(name, n_layers)
    default = method_class(name)()
    return {k: getattr(fitted, k) for k in method_knobs(name)
            if hasattr(fitted, k) and getattr(fitted, k) != getattr(default, k)}


def method_variants(name: str, n_layers: int) -> list[tuple[tuple[str, Any], ...]]:
    """Knob settings searched for ``name``: its fitted defaults, and for a method with one pruning
    layer (``layer``: FastV, PACT, DART, ...) that layer at :func:`layer_variants`."""
    from vlm_prune.registry import method_knobs

    knobs = base_knobs(name, n_layers)
    default_layer = method_knobs(name).get("layer")
    if not isinstance(default_layer, int) or isinstance(default_layer, bool):
        return [tuple(sorted(knobs.items()))]
    return [tuple(sorted({**knobs, "layer": layer}.items())) for layer in layer_variants(default_layer, n_layers)]


@dataclass
class Space:
    """Candidates (configs) and what was left out, with why."""

    candidates: list[PruneConfig]
    skipped: list[dict[str, str]] = field(default_factory=list)


def search_space(model: Any, processor: Any, keeps: Sequence[float], methods: Sequence[str] | None = None,
                 max_stages: int = 2, seed: int = 0) -> Space:
    """Every method (``methods``: these only) the model's adapter accepts, at each keep with its knob
    variants; on models with a frames stage the pipelines of up to ``max_stages`` stages (frames
    first, one single-stage method per stage, default knobs). Each candidate is wrapped and unwrapped once here:
    what wrap() refuses is listed as skipped."""
    import vlm_prune
    from vlm_prune.adapters import find_adapter
    from vlm_prune.api import build_pipeline
    from vlm_prune.eval import metrics
    from vlm_prune.eval.bench import has_token
    from vlm_prune.registry import available_methods, method_class, method_stages

    adapter = find_adapter(model)
    n_layers = metrics.text_config(model.config).num_hidden_layers
    space = Space([])
    names = []
    for name in (methods or available_methods()):
        cls = method_class(name)
        refusal = cls.refusal(adapter.family, adapter.stages)
        if refusal:
            space.skipped.append({"method": name, "reason": refusal})
        elif name == "quota" and not has_token(getattr(processor, "tokenizer", processor), "A"):
            space.skipped.append({"method": name, "reason": "the tokenizer has no 'A' for QuoTA's default scorer "
                                  "(a custom scorer cannot be written in a config file)"})
        else:
            names.append(cls.name)
    if not names:
        raise TuneError(f"no method applies to this {adapter.family} model"
                        + (f" among --methods {','.join(methods)}" if methods else "")
                        + "; see `vlm-prune methods` for the families each method runs on")
    pipelines: list[tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]] = [
        ((n, kv),) for n in names for kv in method_variants(n, n_layers)]
    if "frames" in adapter.stages and max_stages > 1:
        by_stage: dict[str, list[str]] = {}
        for n in names:  # methods spanning stages (HoliTom, PruneVid) take no partner
            stages = method_stages(n)
            if len(stages) == 1:
                by_stage.setdefault(stages[0], []).append(n)
        order = [s for s in ("frames", "vision", "vit", "llm") if s in by_stage]
        for k in range(2, max_stages + 1):
            for stages in itertools.combinations(order, k):
                if stages[0] != "frames":
                    continue
                for combo in itertools.product(*(by_stage[s] for s in stages)):
                    pipelines.append(tuple((n, tuple(sorted(base_knobs(n, n_layers).items()))) for n in combo))
    for pipe in pipelines:
        label = "+".join(n for n, _ in pipe)
        try:
            cfg = PruneConfig(pipe, keep=keeps[0], seed=seed)
            build_pipeline(cfg.build(), keep=cfg.keep)
            vlm_prune.wrap(model, config=cfg, processor=processor)
            vlm_prune.unwrap(model)
        except (ValueError, TypeError, ImportError) as err:
            space.skipped.append({"method": label, "reason": str(err).splitlines()[0]})
            continue
        space.candidates += [PruneConfig(pipe, keep=k, seed=seed) for k in keeps]
    return space


# ---- evaluating settings on samples ----------------------------------------------------------------
BASELINE = "none"


class SyntheticBackend:
    """Greedy answers of a model on synthetic samples (``vlm_prune.eval.synthetic``), batched.

    A record per sample: correct (first word equals the answer), prefill FLOPs pruned and unpruned
    (``vlm_prune.eval.metrics``), visual tokens in / out.
    """

    def __init__(self, model: Any, processor: Any, samples: Sequence[Any], batch_size: int = 16) -> None:
        self.model, self.processor, self.batch_size = model, processor, batch_size
        self.samples = {str(i): s for i, s in enumerate(samples)}
        self.ids = list(self.samples)

    def group(self, sample_id: str) -> str:
        return sample_id

    def run(self, cfg: PruneConfig | None, ids: list[str]) -> Iterable[dict[str, Any]]:
        import torch

        import vlm_prune
        from vlm_prune.eval.bench import first_word, sample_flops, to_device
        from vlm_prune.eval.synthetic import encode

        tok = self.processor.tokenizer
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start:start + self.batch_size]
            samples = [self.samples[i] for i in chunk]
            try:
                inputs = to_device(encode(self.processor, samples), self.model)
                if cfg is not None:
                    vlm_prune.wrap(self.model, config=cfg, processor=self.processor)
                try:
                    with torch.no_grad():
                        out = self.model.generate(**inputs, max_new_tokens=3, do_sample=False)
                    stats = self.model.vlm_prune.last_stats if cfg is not None else None
                finally:
                    if cfg is not None:
                        vlm_prune.unwrap(self.model)
            except Exception as err:  # noqa: BLE001 - a failing setting is counted, the search goes on
                for i in chunk:
                    yield {"id": i, "status": "failed", "correct": False, "error": f"{type(err).__name__}: {err}"[:500]}
                continue
            texts = tok.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            lengths = inputs["attention_mask"].sum(1).tolist()
            for j, (i, s, text) in enumerate(zip(chunk, samples, texts)):
                rec = {"id": i, "status": "ok", "correct": first_word(text) == s.answer.lower(),
                       "flops": sample_flops(self.model.config, lengths[j], stats, j),
                       "flops_full": sample_flops(self.model.config, lengths[j], None, j)}
                if stats is not None:
                    rec.update(tokens_in=stats["visual_tokens_in"][j], tokens_out=stats["visual_tokens_out"][j])
                yield rec

    def time_ratio(self, cfg: PruneConfig, repeats: int = 3) -> float:
        """Measured prefill time pruned / unpruned (process CPU time on CPU, median of ``repeats``,
        interleaved: ``vlm_prune.eval.bench.time_pair``) on the first batch of the tuning set."""
        import vlm_prune
        from vlm_prune.eval.bench import time_pair, to_device
        from vlm_prune.eval.synthetic import encode

        batch = to_device(encode(self.processor, [self.samples[i] for i in self.ids[:self.batch_size]]), self.model)
        t = time_pair(self.model, lambda m: vlm_prune.wrap(m, config=cfg, processor=self.processor), [batch], repeats)
        key = "cpu" if self.model.device.type == "cpu" else "wall"
        return t[key] / t[f"{key}_full"]


class HarnessBackend:
    """Answers of a checkpoint on a dataset the harness reads (``vlm-prune eval``'s loaders and
    :class:`vlm_prune.eval.runner.Predictor`); each video is decoded once per batch of settings."""

    def __init__(self, model: Any, processor: Any, samples: Sequence[Any], frames: int | str = 32,
                 max_new_tokens: int = 16) -> None:
        from vlm_prune.eval.runner import Predictor

        self.predictor = Predictor(model, processor, max_new_tokens)
        self.processor, self.frames = processor, frames
        self.samples = {s.id: s for s in samples}
        self.ids = list(self.samples)

    def group(self, sample_id: str) -> tuple[str, ...]:
        return tuple(self.samples[sample_id].media)

    def run_many(self, work: list[tuple[PruneConfig | None, list[str]]]) -> Iterable[tuple[int, dict[str, Any]]]:
        """(index into ``work``, record) for every (setting, sample) of ``work``, sample by sample."""
        import vlm_prune
        from vlm_prune.eval.answers import format_prompt, score
        from vlm_prune.eval.runner import load_visuals

        wanted: dict[str, list[int]] = {}
        for k, (_, ids) in enumerate(work):
            for i in ids:
                wanted.setdefault(i, []).append(k)
        for i, ks in wanted.items():
            sample = self.samples[i]
            try:
                visuals = load_visuals(sample, self.frames)
            except Exception as err:  # noqa: BLE001 - a broken video is a counted failure
                for k in ks:
                    yield k, {"id": i, "status": "failed", "correct": False, "stage": "decode",
                              "error": f"{type(err).__name__}: {err}"[:500]}
                continue
            for k in ks:
                cfg = work[k][0]
                try:
                    if cfg is not None:
                        vlm_prune.wrap(self.predictor.model, config=cfg, processor=self.processor)
                    try:
                        gen = self.predictor.generate(format_prompt(sample), visuals.items, sample.media_type,
                                                      times=visuals.times)
                    finally:
                        if cfg is not None:
                            vlm_prune.unwrap(self.predictor.model)
                except Exception as err:  # noqa: BLE001
                    yield k, {"id": i, "status": "failed", "correct": False, "stage": "model",
                              "error": f"{type(err).__name__}: {err}"[:500]}
                    continue
                _, correct = score(sample, gen.text)
                yield k, {"id": i, "status": "ok", "correct": bool(correct), "flops": gen.prefill_flops,
                          "flops_full": gen.prefill_flops_unpruned, "tokens_in": gen.visual_tokens_in,
                          "tokens_out": gen.visual_tokens_out, "ttft_s": gen.ttft_s}


def _run_many(backend: Any, work: list[tuple[PruneConfig | None, list[str]]]) -> Iterable[tuple[int, dict[str, Any]]]:
    if hasattr(backend, "run_many"):
        yield from backend.run_many(work)
        return
    for k, (cfg, ids) in enumerate(work):
        for rec in backend.run(cfg, ids):
            yield k, rec


# ---- statistics --------------------------------------------------------------------------------------
@dataclass
class Point:
    """One setting measured on ``n`` samples."""

    label: str
    config: PruneConfig | None
    ids: list[str]
    scores: np.ndarray  # per-sample correctness (failed: 0)
    failed: int
    flops: float  # prefill FLOPs ratio to the unpruned model
    tokens: float | None  # visual tokens per sample at the LLM's last layer

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def accuracy(self) -> float:
        return float(self.scores.mean())


def point(label: str, cfg: PruneConfig | None, records: dict[str, dict[str, Any]], ids: Sequence[str]) -> Point:
    recs = [records[i] for i in ids]
    ok = [r for r in recs if r.get("status") == "ok"]
    flops = sum(r["flops"] for r in ok) / sum(r["flops_full"] for r in ok) if ok else 1.0
    toks = [r["tokens_out"] for r in ok if r.get("tokens_out") is not None]
    return Point(label, cfg, list(ids), np.asarray([float(bool(r.get("correct"))) for r in recs]),
                 len(recs) - len(ok), flops, float(np.mean(toks)) if toks else None)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of a - b and the half-width of its normal 95% interval (0 for fewer than 2 samples)."""
    d = a - b
    if d.size < 2:
        return float(d.mean()) if d.size else 0.0, math.inf
    return float(d.mean()), Z95 * float(d.std(ddof=1)) / math.sqrt(d.size)


def cost(p: Point, axis: str) -> float:
    return p.tokens if axis == "tokens" and p.tokens is not None else p.flops


def paired_bounds(a: np.ndarray, b: np.ndarray, z: float) -> tuple[float, float]:
    """Lower and upper z-bounds of mean(a - b) for per-sample 0/1 scores answered on the same samples:
    the matched-pairs interval with half a count added to each cell of the 2x2 table (Agresti & Min
    2005), which stays honest on few samples where the plain normal interval collapses to a point
    (two settings that agree on every sample of a rung)."""
    n = a.size
    up = (float(np.sum((a > b))) + 0.5) / (n + 2)  # a right, b wrong
    down = (float(np.sum((a < b))) + 0.5) / (n + 2)
    diff = up - down
    half = z * math.sqrt(max(up + down - diff * diff, 0.0) / (n + 2))
    return diff - half, diff + half


def sign_test(a: np.ndarray, b: np.ndarray) -> float:
    """One-sided p-value of "a is more accurate than b" from per-sample 0/1 scores on the same
    samples: the exact sign test on the samples where they differ (McNemar's exact test)."""
    return _sign_tail(int(np.sum(a > b)), int(np.sum(a < b)))


@functools.lru_cache(maxsize=None)
def _sign_tail(up: int, down: int) -> float:
    m = up + down
    return sum(math.comb(m, k) for k in range(up, m + 1)) / 2 ** m


def contenders(points: list[Point], base: Point, axis: str, min_retention: float | None,
               alpha: float = DROP_ALPHA) -> list[Point]:
    """The settings that answer the next rung's samples: those the answers so far do not rule out.

    A setting is dropped when another live one rules it out:

    - beaten: it costs no more and is more accurate, by the exact one-sided sign test on the
      samples where the two differ at level ``alpha`` (the race's test). The loser cannot be on
      the front; a setting the data cannot yet tell from the best at its cost goes on, so
      near-ties reach the full tuning set and the front among them is the grid's.
    - below the floor and dominated (with ``min_retention``): the upper end of its retention's
      paired 95% interval is under the floor, so it is ruled out as the recommendation, and
      another setting is at least as accurate for no more cost on these samples. Such a setting
      matters only as a front point below the goal, where a wrong drop costs a displayed point,
      so the point estimate is enough.
    - past the floor (with ``min_retention``): a cheaper setting's retention meets the floor at
      the lower end of its paired 95% interval, the recommendation's own test, so it cannot be the
      recommendation (the cheapest front setting that meets the floor). Settings at that cheapest
      cost go on: one of them may be the best there. This gives up the front above the
      recommendation (costlier than the goal asks): such points keep the samples they answered.

    Retention intervals here are :func:`paired_bounds` (safe on a rung's few samples). Nothing is
    dropped for ranking low alone: how much of the grid the race answers follows how separable the
    settings are. Each look tests at ``alpha``; over many looks a wrong drop is likelier than
    ``alpha``, which is why the final front is re-measured and the benchmark counts what the race
    missed against the grid.
    """
    def c(p: Point) -> float:
        return cost(p, axis)

    def beaten(p: Point, q: Point) -> bool:
        return c(q) <= c(p) and q.accuracy > p.accuracy and sign_test(q.scores, p.scores) < alpha

    def dominated(p: Point, q: Point) -> bool:
        return c(q) <= c(p) and q.accuracy >= p.accuracy and (c(q) < c(p) or q.accuracy > p.accuracy)

    acc0 = base.accuracy

    def retention_bounds(p: Point) -> tuple[float, float]:
        lo, hi = paired_bounds(p.scores, base.scores, Z95)
        return (acc0 + lo) / acc0, (acc0 + hi) / acc0

    if min_retention is None or acc0 == 0:
        return [p for p in points if not any(beaten(p, q) for q in points if q is not p)]
    bounds = {id(p): retention_bounds(p) for p in points}
    alive = [p for p in points if not any(
        beaten(p, q) or (bounds[id(p)][1] < min_retention and dominated(p, q)) for q in points if q is not p)]
    meeting = [c(q) for q in alive if bounds[id(q)][0] >= min_retention]
    return [p for p in alive if not meeting or c(p) <= min(meeting)]


def racing_floor(goal: Goal, axis: str) -> float | None:
    """The floor :func:`contenders` may drop settings past: the goal's ``min_retention`` when its other
    terms cap the cost axis itself or are absent (then a cheaper setting that meets the floor also
    meets them); None otherwise (a time ceiling, or a FLOPs ceiling on the tokens axis, is checked
    only on the front)."""
    off_axis = [goal.max_time, goal.max_flops if axis == "tokens" else goal.max_tokens]
    return goal.min_retention if all(v is None for v in off_axis) else None


def pareto(points: list[Point], axis: str) -> list[Point]:
    """Points no other point dominates (accuracy at least as high at no more cost, one of them strictly),
    cheapest first."""
    front = [p for p in points if not any(
        q is not p and q.accuracy >= p.accuracy and cost(q, axis) <= cost(p, axis)
        and (q.accuracy > p.accuracy or cost(q, axis) < cost(p, axis)) for q in points)]
    return sorted(front, key=lambda p: (cost(p, axis), -p.accuracy, p.label))


def rung_sizes(total: int, rung: int) -> list[int]:
    """Samples answered after each rung: rung, 2 * rung, ..., ending at ``total``."""
    return list(range(rung, total, rung)) + [total]


# ---- the search ----------------------------------------------------------------------------------------
@dataclass
class TuneResult:
    """What ``tune`` found; ``to_json`` is what tune.json holds."""

    goal: Goal
    axis: str
    baseline: dict[str, Any]
    front: list[dict[str, Any]]
    recommended: dict[str, Any] | None
    closest: list[dict[str, Any]]
    config_path: str | None
    compositions: list[dict[str, Any]]
    rungs: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    cost: dict[str, Any]
    candidates: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goal": asdict(self.goal)}


class Searcher:
    """Successive rungs over ``candidates`` (:func:`contenders` goes on) with the records cached under
    ``out/runs``.

    floor: the goal's retention floor when the recommendation depends on it alone among the goal's
    terms off the cost axis (:func:`racing_floor`); on_record: called after each new record is
    written (tests stop a run there).
    """

    def __init__(self, backend: Any, candidates: list[PruneConfig], out: str, axis: str = "flops",
                 dist: Any = None, on_record: Callable[[], None] | None = None,
                 sync_timeout_min: float | None = None, floor: float | None = None) -> None:
        from vlm_prune.eval import sharding

        self.backend, self.candidates, self.axis, self.floor = backend, candidates, axis, floor
        self.runs = os.path.join(out, "runs")
        self.dist = dist or sharding.current()
        self.on_record = on_record
        self.sync_timeout_min = sync_timeout_min or sharding.SYNC_TIMEOUT_MIN
        self.calls = 0  # (setting, sample) answers computed by this process
        self.records: dict[str, dict[str, dict[str, Any]]] = {}

    def label(self, cfg: PruneConfig | None) -> str:
        return BASELINE if cfg is None else cfg.label()

    def measure(self, settings: list[PruneConfig | None], ids: list[str], desc: str, front_text: Callable[[], str]) -> None:
        """Every setting answers every id of ``ids`` (what is cached is read, this rank's share of the
        rest is computed, the other ranks' share awaited)."""
        from tqdm.auto import tqdm

        from vlm_prune.eval import sharding

        work = []
        for cfg in settings:
            label = self.label(cfg)
            done = sharding.read_records(os.path.join(self.runs, label))
            # shard every id, then skip the answered ones: each rank reads the others' files while they
            # write, so a shard of what is missing would differ between ranks and leave ids to no one
            mine = [i for i in sharding.shard(ids, self.dist, key=self.backend.group)
                    if i not in done or sharding.is_failed(done[i])]
            work.append((cfg, mine))
        total = sum(len(ids) for _, ids in work)
        writers: dict[int, Any] = {}
        try:
            with tqdm(total=total, desc=desc, dynamic_ncols=True, position=self.dist.rank, leave=False,
                      disable=total == 0) as bar:
                bar.set_postfix_str(front_text())
                for k, rec in _run_many(self.backend, work):
                    if k not in writers:
                        writers[k] = sharding.RankWriter(os.path.join(self.runs, self.label(work[k][0])), self.dist)
                    writers[k].write(rec)
                    self.calls += 1
                    bar.update(1)
                    if self.on_record is not None:
                        self.on_record()
        finally:
            for w in writers.values():
                w.close()
        for cfg in settings:
            label = self.label(cfg)
            path = os.path.join(self.runs, label)
            if self.dist.world_size > 1:
                self.records[label] = sharding.wait_for(path, ids, timeout_min=self.sync_timeout_min)
            else:
                self.records[label] = sharding.read_records(path)

    def point(self, cfg: PruneConfig | None, ids: Sequence[str]) -> Point:
        return point(self.label(cfg), cfg, self.records[self.label(cfg)], ids)

    def search(self, sizes: list[int]) -> tuple[list[Point], Point, list[dict[str, Any]]]:
        """(points of the settings alive after the last rung, measured on every tuning sample; the
        unpruned point; one entry per rung: samples, settings measured, settings kept)."""
        alive = list(self.candidates)
        rungs = []
        last: list[Point] = []
        for r, n in enumerate(sizes):
            ids = self.backend.ids[:n]

            def text() -> str:
                front = pareto(last, self.axis)[:3]
                return "front " + (", ".join(f"{p.label} {p.accuracy:.2f}@{cost(p, self.axis):.2f}" for p in front)
                                   or "-")

            self.measure([None] + alive, ids, f"tune rung {r + 1}/{len(sizes)} ({len(alive)} settings x {n} samples)",
                         text)
            points = [self.point(cfg, ids) for cfg in alive]
            kept = contenders(points, self.point(None, ids), self.axis, self.floor) if r + 1 < len(sizes) else points
            rungs.append({"samples": n, "settings": len(alive), "kept": len(kept)})
            alive = [p.config for p in kept]
            last = kept
        return last, self.point(None, self.backend.ids[:sizes[-1]]), rungs


# ---- front, recommendation, compositions ---------------------------------------------------------------
def row(p: Point, base: Point, axis: str) -> dict[str, Any]:
    """A front entry: accuracy, retention with its paired 95% interval (``base``: the unpruned point on
    the same samples), costs, the config."""
    diff, half = paired(p.scores, base.scores)
    acc0 = base.accuracy
    ret = p.accuracy / acc0 if acc0 else None
    lo = (acc0 + diff - half) / acc0 if acc0 else None
    hi = (acc0 + diff + half) / acc0 if acc0 else None
    return {"setting": p.label, "pipeline": p.config.pipeline if p.config else BASELINE,
            "keep": p.config.keep if p.config else 1.0, "n": p.n, "failed": p.failed, "accuracy": p.accuracy,
            "retention": ret, "retention_lower": lo, "retention_upper": hi, "flops_ratio": p.flops,
            "visual_tokens": p.tokens, "cost": cost(p, axis), "time_ratio": None,
            "config": p.config.to_dict() if p.config else None}


def meets(entry: dict[str, Any], goal: Goal) -> bool:
    if goal.min_retention is not None and (entry["retention_lower"] is None
                                           or entry["retention_lower"] < goal.min_retention - 1e-12):
        return False
    if goal.max_flops is not None and entry["flops_ratio"] > goal.max_flops + 1e-12:
        return False
    if goal.max_tokens is not None and (entry["visual_tokens"] is None or entry["visual_tokens"] > goal.max_tokens):
        return False
    return goal.max_time is None or (entry["time_ratio"] is not None and entry["time_ratio"] <= goal.max_time)


def shortfall(entry: dict[str, Any], goal: Goal) -> float:
    """How far ``entry`` misses ``goal`` (relative, summed over the goal's terms; 0 when it meets it)."""
    gap = 0.0
    if goal.min_retention is not None:
        gap += max(0.0, goal.min_retention - (entry["retention_lower"] or 0.0)) / goal.min_retention
    for key, limit in (("flops_ratio", goal.max_flops), ("visual_tokens", goal.max_tokens),
                       ("time_ratio", goal.max_time)):
        if limit is not None:
            value = entry[key] if entry[key] is not None else math.inf
            gap += max(0.0, value - limit) / limit
    return gap


def recommend(front: list[dict[str, Any]], goal: Goal) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the chosen front entry or None, the three closest entries when none meets the goal)."""
    ok = [e for e in front if meets(e, goal)]
    if ok:
        if goal.min_retention is not None:
            return min(ok, key=lambda e: (e["cost"], -e["accuracy"])), []
        return max(ok, key=lambda e: (e["accuracy"], -e["cost"])), []
    return None, sorted(front, key=lambda e: (shortfall(e, goal), e["cost"]))[:3]


def compositions(points: list[Point], searcher: Searcher) -> list[dict[str, Any]]:
    """Per keep: the best pipeline of several stages against the best single method, paired 95%
    interval on the samples both answered (the most either reached)."""
    out = []
    keeps = sorted({p.config.keep for p in points if p.config is not None}, reverse=True)
    for keep in keeps:
        at = [p for p in points if p.config is not None and p.config.keep == keep]
        singles = [p for p in at if len(p.config.methods) == 1]
        pipes = [p for p in at if len(p.config.methods) > 1]
        if not singles or not pipes:
            continue
        best_s = max(singles, key=lambda p: p.accuracy)
        best_p = max(pipes, key=lambda p: p.accuracy)
        diff, half = paired(best_p.scores, best_s.scores)
        verdict = "beats" if diff - half > 0 else "loses to" if diff + half < 0 else "is not shown different from"
        out.append({"keep": keep, "composition": best_p.label, "single": best_s.label, "n": best_p.n,
                    "diff": diff, "ci": half, "verdict": verdict})
    return out


def final_points(searcher: Searcher, n: int) -> list[Point]:
    """Every candidate measured on (at least) the first ``n`` tuning samples, on those samples; a
    candidate dropped earlier on the samples it answered."""
    out = []
    for cfg in searcher.candidates:
        recs = searcher.records.get(searcher.label(cfg), {})
        ids = [i for i in searcher.backend.ids[:n] if i in recs]
        if ids:
            out.append(point(searcher.label(cfg), cfg, recs, ids))
    return out


# ---- output --------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def retention_text(e: dict[str, Any]) -> str:
    """"0.981 [0.962, 1.000]", or "-" when the unpruned model answered nothing right (no ratio)."""
    if e["retention"] is None:
        return "-"
    return f"{e['retention']:.3f} [{e['retention_lower']:.3f}, {e['retention_upper']:.3f}]"


def front_table(result: TuneResult) -> str:
    """The front as Markdown, the unpruned model first, the recommendation marked."""
    b = result.baseline
    head = ("| setting | accuracy | retention (95% paired) | FLOPs ratio | visual tokens | time ratio | meets goal |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head, f"| unpruned | {b['accuracy']:.3f} | 1 | 1 | {_fmt(b.get('visual_tokens'), '.0f')} | 1 | |"]
    chosen = result.recommended["setting"] if result.recommended else None
    for e in result.front:
        ret = retention_text(e)
        mark = "**recommended**" if e["setting"] == chosen else ("yes" if meets(e, result.goal) else "no")
        lines.append(f"| {e['setting']} | {e['accuracy']:.3f} | {ret} | {e['flops_ratio']:.3f} | "
                     f"{_fmt(e['visual_tokens'], '.1f')} | {_fmt(e['time_ratio'], '.3f')} | {mark} |")
    return "\n".join(lines)


def front_plot(result: TuneResult, all_points: list[dict[str, Any]], path: str) -> list[str]:
    """Accuracy against the cost axis: every setting measured (grey, on the samples it answered),
    the front (line), the recommendation (star), the goal (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vlm_prune.eval.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = "visual_tokens" if result.axis == "tokens" else "flops_ratio"
    xs = [p[key] for p in all_points if p[key] is not None]
    ax.scatter(xs, [p["accuracy"] for p in all_points if p[key] is not None], s=12, c="0.7",
               label="settings (on the samples they answered)")
    fx = [e[key] for e in result.front]
    ax.plot(fx, [e["accuracy"] for e in result.front], "o-", c="#0072B2", label="front (full tuning set)")
    ax.axhline(result.baseline["accuracy"], c="k", lw=0.8, ls=":", label="unpruned")
    if result.goal.min_retention is not None:
        ax.axhline(result.goal.min_retention * result.baseline["accuracy"], c="#D55E00", ls="--", lw=0.8,
                   label="retention floor")
    limit = result.goal.max_tokens if result.axis == "tokens" else result.goal.max_flops
    if limit is not None:
        ax.axvline(limit, c="#D55E00", ls="-.", lw=0.8, label="cost ceiling")
    if result.recommended:
        ax.plot([result.recommended[key]], [result.recommended["accuracy"]], "*", ms=16, c="#009E73",
                label=f"recommended: {result.recommended['setting']}")
    ax.set_xlabel("visual tokens per sample" if result.axis == "tokens" else "prefill FLOPs / unpruned")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths = save_figure(fig, path)
    plt.close(fig)
    return paths


def summary_text(result: TuneResult) -> str:
    """What the command prints: the goal, the front, the recommendation or the closest settings."""
    lines = [f"goal: {result.goal.text()}", "", front_table(result), ""]
    if result.recommended:
        r = result.recommended
        lines.append(f"recommended: {r['setting']}  accuracy {r['accuracy']:.3f}, retention {retention_text(r)} "
                     f"(paired 95% interval, {r['n']} samples), prefill FLOPs ratio {r['flops_ratio']:.3f}")
        lines.append(f"config: {result.config_path}")
    else:
        lines.append("no setting on the front meets the goal; the closest:")
        for e in result.closest:
            lines.append(f"  {e['setting']}: accuracy {e['accuracy']:.3f}, retention {retention_text(e)}, "
                         f"FLOPs ratio {e['flops_ratio']:.3f}")
    for c in result.compositions:
        lines.append(f"keep {c['keep']:g}: the best pipeline {c['composition']} {c['verdict']} the best single method "
                     f"{c['single']} ({100 * c['diff']:+.1f} +- {100 * c['ci']:.1f} points, {c['n']} samples)")
    failed = sum(e["failed"] for e in result.front)
    lines.append(f"{result.cost['calls']} answers computed ({result.cost['grid_calls']} for the full grid), "
                 f"{result.candidates} settings, {len(result.skipped)} methods or pipelines skipped"
                 + (f", {failed} failed answers on the front" if failed else ""))
    return "\n".join(lines)


# ---- the entry point ----------------------------------------------------------------------------------
def check_methods(model: str, methods: Sequence[str] | None) -> None:
    """Before the model loads: some method of ``methods`` runs on the checkpoint's family (its
    config.json's class; a checkpoint without a known class is left to the loader)."""
    if not methods:
        return
    from transformers import AutoConfig

    from vlm_prune.adapters import FAMILY_STAGES, family_of
    from vlm_prune.eval import synthetic
    from vlm_prune.registry import method_class

    try:
        architectures = AutoConfig.from_pretrained(
            str(synthetic.model_path(model)) if model in TOY_MODELS else model).architectures or []
    except (OSError, ValueError):
        return
    family = next(filter(None, map(family_of, architectures)), None)
    if family is not None and all(method_class(m).refusal(family, FAMILY_STAGES[family]) for m in methods):
        raise TuneError(f"no method applies to this {family} model among --methods {','.join(methods)}; see "
                        "`vlm-prune methods` for the families each method runs on")


def synthetic_identity(model: str, split: str, n: int, data_seed: int | None) -> dict[str, Any]:
    """What names a synthetic tuning set (the run folder's check and the config's ``about``)."""
    seed = "" if data_seed is None else f"-seed{data_seed}"
    return {"model": model, "data": f"synthetic-{split}{seed}", "n": n}


def load_target(model: str, data: str | None, dataset: str | None, n: int, split: str, frames: int | str,
                max_new_tokens: int, dist: Any, data_seed: int | None = None) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model, processor, backend, identity) for ``model`` (a shipped toy model name, a folder or a
    hub id) on ``data`` (a harness layout) or, without data, the synthetic set of the model's kind
    (drawn with ``data_seed``)."""
    from vlm_prune.eval import synthetic

    if data is not None and data_seed is not None:
        raise TuneError("data_seed draws the synthetic set; drop it with --data")
    if model in TOY_MODELS:
        if data is not None:
            raise TuneError(f"the shipped {model} model answers the synthetic {model} set; drop --data, or give "
                            "--model a checkpoint for your data")
        net, processor = synthetic.load(model, 0)
        samples = synthetic.make_dataset(model, split, n, seed=data_seed, qtypes=synthetic.trained_qtypes(model, 0))
        return net, processor, SyntheticBackend(net, processor, samples), synthetic_identity(model, split, n, data_seed)
    from vlm_prune.eval.runner import EvalConfig, EvalConfigError, load_model

    try:
        net, processor = load_model(EvalConfig(model=model, data=data or "", dataset=dataset or "", out=""), dist)
    except EvalConfigError as err:
        raise TuneError(str(err)) from None
    if data is None:
        from vlm_prune.adapters import find_adapter
        from vlm_prune.eval.bench import processor_size, render_for

        kind = "video" if "frames" in find_adapter(net).stages else "image"
        samples = render_for(synthetic.make_dataset(kind, split, n, seed=data_seed), processor_size(processor),
                             with_options=True)
        return net, processor, SyntheticBackend(net, processor, samples), synthetic_identity(model, split, n, data_seed)
    from vlm_prune.eval.datasets import DatasetLayoutError, load_samples
    from vlm_prune.eval.runner import spread

    if dataset is None:
        raise TuneError("--data needs --dataset (its layout: see vlm-prune eval --help)")
    try:
        samples = spread(load_samples(dataset, data, split=None if split in ("val", "test") else split), n)
    except DatasetLayoutError as err:
        raise TuneError(str(err)) from None
    backend = HarnessBackend(net, processor, samples, frames, max_new_tokens)
    return net, processor, backend, {"model": model, "data": os.path.abspath(data), "dataset": dataset, "n": n,
                                     "frames": frames, "max_new_tokens": max_new_tokens}


def tune(out: str, model: str = "image", *, data: str | None = None, dataset: str | None = None,
         min_retention: float | None = None, max_flops: float | None = None, max_tokens: float | None = None,
         max_time: float | None = None, methods: Sequence[str] | None = None, keeps: Sequence[float] | None = None,
         max_stages: int = 2, quick: bool = False, samples: int | None = None, split: str = "val",
         frames: int | str = 32, max_new_tokens: int = 16, seed: int = 0, data_seed: int | None = None, grid: bool = False,
         on_record: Callable[[], None] | None = None, loaded: tuple[Any, Any] | None = None) -> TuneResult | None:
    """Search methods x budgets x knobs for the goal; write tune.json, front.md, front.png and the
    recommended config (recommended.json) under ``out``; rank 0 returns the result (others None).

    model: "image" / "video" (the shipped toy models, on the synthetic set) or a checkpoint;
    data / dataset: a harness layout (``vlm-prune eval``'s); samples: the tuning set's size
    (default 288; quick: 48), spread over the data; data_seed: the synthetic set's seed (default:
    the published one; another draws fresh samples); grid: every setting on every sample instead
    of the search (what the benchmark compares with); loaded: (model, processor) already loaded
    for ``model`` (tests).
    """
    from vlm_prune.eval import sharding
    from vlm_prune.eval.runner import _check_run_dir

    goal = Goal(min_retention, max_flops, max_tokens, max_time).or_default()
    if max_stages < 1:
        raise TuneError(f"--max-stages must be at least 1, got {max_stages}")
    total = samples or (QUICK_SAMPLES if quick else SAMPLES)
    keeps = tuple(keeps or (QUICK_KEEPS if quick else KEEPS))
    if any(not 0 < k <= 1 for k in keeps):
        raise TuneError(f"--keeps must lie in (0, 1], got {','.join(map(str, keeps))}")
    dist = sharding.current()
    check_methods(model, methods)
    start_cpu = time.process_time()
    if loaded is not None:
        from vlm_prune.eval import synthetic

        net, processor = loaded
        tuning = synthetic.make_dataset(model, split, total, seed=data_seed, qtypes=synthetic.trained_qtypes(model, 0))
        backend = SyntheticBackend(net, processor, tuning)
        identity = synthetic_identity(model, split, total, data_seed)
    else:
        net, processor, backend, identity = load_target(model, data, dataset, total, split, frames, max_new_tokens,
                                                        dist, data_seed)
    total = len(backend.ids)
    # a fixed shuffle, so every rung's prefix spreads over the question families
    order = np.random.default_rng(seed).permutation(total)
    backend.ids = [backend.ids[i] for i in order]
    space = search_space(net, processor, keeps, methods, max_stages, seed)
    axis = "tokens" if goal.max_tokens is not None else "flops"
    os.makedirs(out, exist_ok=True)
    _check_run_dir(out, {**identity, "seed": seed, "order": "permutation"}, dist)
    searcher = Searcher(backend, space.candidates, out, axis, dist, on_record, floor=racing_floor(goal, axis))
    sizes = [total] if grid else rung_sizes(total, RUNG)
    last, base, rungs = searcher.search(sizes)
    if not dist.is_main:
        return None
    front_points = pareto(last, axis)
    front = [row(p, base, axis) for p in front_points]
    if isinstance(backend, SyntheticBackend):
        for e, p in zip(front, front_points):
            e["time_ratio"] = backend.time_ratio(p.config)
    else:
        t0 = sum(searcher.records[BASELINE][i].get("ttft_s", 0.0) for i in backend.ids)
        for e, p in zip(front, front_points):
            recs = searcher.records[p.label]
            e["time_ratio"] = sum(recs[i].get("ttft_s", 0.0) for i in backend.ids) / t0 if t0 else None
    chosen, closest = recommend(front, goal)
    config_path = None
    if chosen is not None:
        from vlm_prune.eval.synthetic import model_path

        checkpoint = str(model_path(model)) if model in TOY_MODELS else model
        about = {"written_by": "vlm-prune tune", "model": checkpoint, "data": identity["data"],
                 "goal": goal.text(), "samples": chosen["n"], "accuracy": chosen["accuracy"],
                 "retention": chosen["retention"], "retention_interval": [chosen["retention_lower"], chosen["retention_upper"]],
                 "flops_ratio": chosen["flops_ratio"], "time_ratio": chosen["time_ratio"]}
        config_path = save_config(chosen_config(chosen), os.path.join(out, "recommended.json"), about)
    everything = [row(p, searcher.point(None, p.ids), axis) for p in final_points(searcher, total)]
    result = TuneResult(
        goal=goal, axis=axis, baseline=row(base, base, axis), front=front, recommended=chosen, closest=closest,
        config_path=config_path, compositions=compositions(last, searcher), rungs=rungs, skipped=space.skipped,
        cost={"calls": sum(len(r) for r in searcher.records.values()), "calls_this_run": searcher.calls,
              "grid_calls": (len(space.candidates) + 1) * total, "cpu_s_this_run": time.process_time() - start_cpu},
        candidates=len(space.candidates),
    )
    with open(os.path.join(out, "tune.json"), "w", encoding="utf-8") as f:
        json.dump({**result.to_json(), "settings": everything}, f, indent=1)
    with open(os.path.join(out, "front.md"), "w", encoding="utf-8") as f:
        f.write(summary_text(result) + "\n")
    front_plot(result, everything, os.path.join(out, "front.png"))
    return result


def chosen_config(entry: dict[str, Any]) -> PruneConfig:
    from vlm_prune.config import load_config

    return load_config(entry["config"])
