"""Public API: wrap / unwrap a model with one or more pruning methods."""
from __future__ import annotations

import copy
import difflib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from vlm_prune.methods.base import STAGES, BudgetWarning, Method, validate_budget, validate_seed
from vlm_prune.registry import make_method



@dataclass
class WrapState:
    """What ``wrap`` attaches to the model as ``model.vlm_prune``."""

    adapter: Any
    methods: dict[str, Method]
    processor: Any = None
    seed: int = 0
    #: budget targets this model cannot reach, with the reachable value (warned once by wrap())
    budget_notes: list[str] = field(default_factory=list)
    #: the calling thread's last request (see last_stats / last_rows)
    _last: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    @property
    def last_stats(self) -> dict[str, Any]:
        """Visual tokens in / out per sample and per stage, seconds spent scoring: the last
        request (prefill) of the calling thread."""
        return getattr(self._last, "stats", {})

    @last_stats.setter
    def last_stats(self, value: dict[str, Any]) -> None:
        self._last.stats = value

    @property
    def last_rows(self) -> torch.Tensor | None:
        """[B, S_out] index in the model input of each row the calling thread's last prefill
        returned (-1: padding)."""
        return getattr(self._last, "rows", None)

    @last_rows.setter
    def last_rows(self, value: torch.Tensor | None) -> None:
        self._last.rows = value

    @property
    def pipeline(self) -> list[Method]:
        """The configured methods in stage order (frames -> vision/vit -> llm)."""
        return [self.methods[s] for s in STAGES if s in self.methods]

    def summary(self) -> str:
        """The calling thread's last request (:attr:`last_stats`) on one screen: visual tokens in -> out
        per sample with the kept fraction and the layer average (what prefill FLOPs follow), one line per
        stage (method, where it acted, tokens in -> out, kept fraction, scoring time) and the notes.

        Example (a tiny LLaVA, two samples of 16 image tokens)::

            >>> model = vlm_prune.wrap(model, ["random", "fastv"], keep=0.25)
            >>> model.generate(**inputs, max_new_tokens=8)
            >>> print(model.vlm_prune.summary())
            vlm_prune on llava: random (vision) -> fastv (llm)
            visual tokens per sample: 16, 16 -> 4, 4 (25.0% kept); layer average 5.3, 5.3
              vision  random    images           16, 16 -> 8, 8    50.0%       1.5 ms
              llm     fastv     layer 2          8, 8 -> 4, 4      50.0%     185.5 ms
            scoring: 187.0 ms (43.9 ms CPU)
        """
        stats = self.last_stats
        head = f"vlm_prune on {self.adapter.family}: " + " -> ".join(f"{m.name} ({m.stage})" for m in self.pipeline)
        if not stats:
            return f"{head}\nno request yet in this thread (last_stats is empty)"
        lines = [head, f"visual tokens per sample: {_counts(stats['visual_tokens_in'])} -> "
                       f"{_counts(stats['visual_tokens_out'])} ({_kept(stats['visual_tokens_in'], stats['visual_tokens_out'])} "
                       f"kept); layer average {_counts(stats['visual_tokens_layer_avg'])}"]
        for r in stats["stages"]:
            where = f"layer {r['layer']}" if "layer" in r else f"{r.get('modality', 'rows')}s"
            where = f"skipped ({r['skipped']})" if "skipped" in r else where
            moved = f"{_counts(r['tokens_in'])} -> {_counts(r['tokens_out'])}"
            lines.append(f"  {r['stage']:<7} {r['method']:<9} {where:<16} {moved:<16} {_kept(r['tokens_in'], r['tokens_out']):>6}"
                         f" {1000 * r.get('seconds', 0.0):>9.1f} ms")
        decode = stats.get("decode")
        if decode:
            lines.append(f"  decode  {decode['method']:<9} from layer {decode['from_layer']}: visual keys at the last "
                         f"layer {_counts(decode['visual_keys_per_layer'][-1])}")
        lines.append(f"scoring: {1000 * stats.get('seconds', 0.0):.1f} ms ({1000 * stats.get('cpu_seconds', 0.0):.1f} ms CPU)")
        lines += [f"note: {note}" for note in [*stats.get("budget_notes", []), *stats.get("notes", [])]]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"WrapState(adapter={self.adapter.family!r}, pipeline={self.pipeline!r})"


def _counts(values: Sequence[float]) -> str:
    """Per-sample (or per-item) counts, one decimal where fractional; their sum beyond six."""
    if len(values) > 6:
        total = sum(values)
        return f"{total:g} in {len(values)}" if float(total).is_integer() else f"{total:.1f} in {len(values)}"
    return ", ".join(f"{v:g}" if float(v).is_integer() else f"{v:.1f}" for v in values)


def _kept(before: Sequence[float], after: Sequence[float]) -> str:
    total = sum(before)
    return f"{100 * sum(after) / total:.1f}%" if total else "-"


def _as_list(method: Any) -> list[Any]:
    if method is None:
        return []
    if isinstance(method, (list, tuple)):
        return list(method)
    return [method]


def build_pipeline(
    method: Any = None,
    *,
    frames: Any = None,
    tokens: Any = None,
    keep: float | None = None,
    budget: int | None = None,
) -> dict[str, Method]:
    """Resolve names / objects into configured methods keyed by stage, validating budgets."""
    keep, budget = validate_budget(keep, budget, required=False)
    specs = _as_list(method) + _as_list(frames) + _as_list(tokens)
    if not specs:
        raise ValueError(
            "no method given: wrap(model, 'fastv', keep=0.5), or see vlm_prune.available_methods()"
        )
    by_stage: dict[str, Method] = {}
    for spec in specs:
        # a copy: the object the user configured is never changed by wrap()
        m = copy.copy(make_method(spec))
        if m.stage not in STAGES:
            raise ValueError(f"method {m.name!r} declares unknown stage {m.stage!r}; stages are {STAGES}")
        if m.stage in by_stage:
            raise ValueError(
                f"methods {by_stage[m.stage].name!r} and {m.name!r} both act in the {m.stage!r} "
                f"stage; a pipeline takes at most one method per stage (frames -> vision -> llm)"
            )
        by_stage[m.stage] = m
    for m in list(by_stage.values()):  # methods that span stages bring their other stages' parts
        for part in m.companions({s: o for s, o in by_stage.items() if o is not m}):
            if part.stage in by_stage:
                raise ValueError(
                    f"method {m.name!r} also works in the {part.stage!r} stage, where {by_stage[part.stage].name!r} "
                    f"was given; a pipeline takes at most one method per stage: drop {by_stage[part.stage].name!r}"
                )
            by_stage[part.stage] = part
    # one target, the final count: every stage gets it; stage i of m keeps an even share of the
    # reduction (Method.n_keep), so the last stage lands on the target
    ordered = [by_stage[s] for s in STAGES if s in by_stage]
    for i, m in enumerate(ordered, start=1):
        m._share = (i, len(ordered))
        m.configure_budget(keep, budget)
    frames_m, vision_m = by_stage.get("frames"), by_stage.get("vision")
    if getattr(frames_m, "resizes_frames", False) and getattr(vision_m, "needs_tower_attention", False):
        raise ValueError(
            f"{vision_m.name!r} reads the vision tower's attention to each token, which the frames "
            f"{frames_m.name!r} resizes or merges away; after {frames_m.name!r} use random, pool, divprune or cdpruner, "
            f"or put {vision_m.name!r} after uniform or keyscore"
        )
    if "vision" in by_stage and "vit" in by_stage:
        raise ValueError(
            f"methods {by_stage['vit'].name!r} (inside the ViT) and {by_stage['vision'].name!r} "
            "(after the projector) both reduce image tokens; choose one of them"
        )
    return by_stage


def wrap(
    model: torch.nn.Module,
    method: Any = None,
    *,
    keep: float | None = None,
    budget: int | None = None,
    frames: Any = None,
    tokens: Any = None,
    processor: Any = None,
    seed: int = 0,
    config: Any = None,
    **knobs: Any,
) -> torch.nn.Module:
    """Patch ``model`` (this instance only) to prune visual tokens; returns the same object.

    Args:
        model: a supported Hugging Face VLM or timm ViT (see ``vlm_prune.adapters``).
        method: a registered name (``"fastv"``), a configured object
            (``vlm_prune.methods.FastV(layer=2)``), or a list of them, at most one per stage.
        keep: fraction of each image's visual tokens (each video's, for frames methods) that
            reach the language model's last layer, in (0, 1]; 1.0 changes nothing.
        budget: the same as a count per image (per video for frames methods). Give exactly one
            of keep / budget unless the method has its own defaults (fastv, pact, adaptinfer).
            In a pipeline it is the final count: stage i of m keeps an even share of the
            reduction and the last stage lands on it (per video when the pipeline has a frames
            method: its vision stage shares the count over the frames the frames stage kept). A target the model cannot reach (e.g.
            ToMe's half per block) is warned once (``BudgetWarning``) with the reachable value.
        frames: the frames-stage method; ``frames=f, tokens=t`` is another spelling of
            ``method=[f, t]``.
        tokens: the token-stage (vision, vit or llm) method that follows ``frames``.
        processor: the model's processor (tokenizer, image processor); frame methods that
            prompt the model (QuoTA) need it.
        seed: seed of methods that sample (random).
        config: a config file (path), its dict, or a ``vlm_prune.config.PruneConfig``: methods with
            their knobs, keep / budget and seed in one place (docs/config.md; what ``vlm-prune tune``
            writes). It replaces method, frames, tokens, keep, budget and seed.

    A method's own knobs go to its object, not to wrap(): ``wrap(model, FastV(layer=2), keep=0.3)``;
    any other keyword raises a TypeError that says so and names the closest knob.
    """
    from vlm_prune.adapters import find_adapter

    if knobs:
        raise _misplaced_knobs(knobs, _as_list(method) + _as_list(frames) + _as_list(tokens))
    if config is not None:
        given = [k for k, v in (("method", method), ("frames", frames), ("tokens", tokens), ("keep", keep),
                                ("budget", budget)) if v is not None] + (["seed"] if seed != 0 else [])
        if given:
            raise ValueError(f"wrap(config=...) takes the methods, budget and seed from the config; "
                             f"drop {', '.join(given)} or leave out config")
        from vlm_prune.config import load_config

        cfg = load_config(config)
        method, keep, budget, seed = cfg.build(), cfg.keep, cfg.budget, cfg.seed

    if getattr(model, "vlm_prune", None) is not None:
        raise RuntimeError(
            "this model is already wrapped by vlm_prune; call vlm_prune.unwrap(model) before wrapping it again"
        )
    find_adapter(model)
    methods = build_pipeline(method, frames=frames, tokens=tokens, keep=keep, budget=budget)
    return _attach(model, WrapState(adapter=None, methods=methods, processor=processor, seed=validate_seed(seed)))


_WRAP_KEYWORDS = ("keep", "budget", "frames", "tokens", "processor", "seed", "config")


def _misplaced_knobs(knobs: dict[str, Any], specs: list[Any]) -> TypeError:
    """The error for keywords wrap() does not take: a method's knobs belong to the method object
    (``FastV(layer=2)``); names the closest knob of the named methods or of wrap() itself."""
    from vlm_prune.registry import method_class, method_knobs

    named = [spec for spec in specs if isinstance(spec, str)]
    owners = {}  # knob -> class name of the first named method that takes it
    for name in named:
        for knob in method_knobs(name):
            owners.setdefault(knob, method_class(name).__name__)
    key = next(iter(knobs))
    close = difflib.get_close_matches(key, [*owners, *_WRAP_KEYWORDS], n=1, cutoff=0.6)
    guess = close[0] if close else key
    hint = f" (did you mean {guess!r}?)" if close and guess != key else ""
    if guess in owners:
        example = f"vlm_prune.wrap(model, vlm_prune.methods.{owners[guess]}({guess}={knobs[key]!r}), ...)"
    else:
        cls = method_class(named[0]).__name__ if named else "FastV"
        example = f"vlm_prune.wrap(model, vlm_prune.methods.{cls}(<knob>=...), ...)"
    listed = "; ".join(f"{name}: {', '.join(method_knobs(name)) or '(none)'}" for name in named)
    return TypeError(
        f"wrap() got an unexpected keyword argument {key!r}{hint}. A method's knobs go to the method object: "
        f"{example}" + (f" (knobs of {listed})" if listed else "") + f"; wrap() itself takes {', '.join(_WRAP_KEYWORDS)}"
    )


def _attach(model: torch.nn.Module, state: WrapState) -> torch.nn.Module:
    """Check ``state``'s methods against the model, patch it and set ``model.vlm_prune``."""
    from vlm_prune.adapters import find_adapter

    adapter_cls = find_adapter(model)
    family = getattr(adapter_cls, "family", "")
    state.methods = {s: m for s, m in state.methods.items() if m.skipped_on(family) is None}
    adapter = adapter_cls(model, state)
    adapter.check_methods()
    for m in state.methods.values():
        m.check_model(adapter)
        note = m.budget_warning(adapter)
        if note:
            state.budget_notes.append(note)
            warnings.warn(note, BudgetWarning, stacklevel=2)
    state.adapter = adapter
    try:
        adapter.attach()
    except BaseException:  # a refusal during attach leaves the model as it was
        adapter.detach()
        raise
    adapter.patches.set(model, "__deepcopy__", lambda memo: _deepcopy(model, memo))
    model.vlm_prune = state
    return model


def _deepcopy(model: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of a wrapped model: an independent model wrapped with copies of the methods.

    The original is never touched (other threads may be generating with it): everything ``wrap()``
    put on it (patched attributes, hooks, ``model.vlm_prune``) is left out of the copy through the
    memo and replaced there by what the model held before ``wrap()``; the copy is then wrapped anew."""
    state = model.vlm_prune
    cut = object()  # what the copy holds, for a moment, where the original holds wrap()'s patches
    for value in [state, *state.adapter.patches.installed()]:
        memo[id(value)] = cut
    # the default copy of an object (this model's own __deepcopy__ is one of the patches)
    clone = copy._reconstruct(model, memo, *model.__reduce_ex__(4))  # type: ignore[attr-defined]
    state.adapter.patches.restore_copy(memo, cut)
    if vars(clone).get("vlm_prune") is cut:
        del clone.vlm_prune
    methods = {stage: copy.deepcopy(m, memo) for stage, m in state.methods.items()}
    return _attach(clone, WrapState(adapter=None, methods=methods, processor=state.processor, seed=state.seed))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Remove every patch ``wrap`` made; the model behaves bit-identically to before."""
    state = getattr(model, "vlm_prune", None)
    if state is None:
        raise ValueError("this model is not wrapped by vlm_prune; nothing to unwrap")
    state.adapter.detach()
    del model.vlm_prune
    return model


def is_wrapped(model: torch.nn.Module) -> bool:
    return getattr(model, "vlm_prune", None) is not None
