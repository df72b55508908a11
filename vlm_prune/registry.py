"""The method registry: names -> Method classes, with close-name suggestions."""
from __future__ import annotations

import difflib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the methods package imports this module to register itself
    from vlm_prune.methods.base import Method

_METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` available to ``wrap()`` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name' to be registered")
    if cls.name in _METHODS and _METHODS[cls.name] is not cls:
        raise ValueError(f"method name '{cls.name}' is already registered by {_METHODS[cls.name].__name__}")
    _METHODS[cls.name] = cls
    return cls


def _load_builtin() -> None:
    from vlm_prune.methods import load_builtin

    load_builtin()


def available_methods() -> list[str]:
    """Names accepted by ``vlm_prune.wrap``."""
    _load_builtin()
    return sorted(_METHODS)


def method_knobs(name: str) -> dict[str, Any]:
    """The method's own arguments and their defaults (``keep`` / ``budget`` are wrap()'s target,
    the same for every method, so they are left out), e.g. {"layer": 2, "query": "last"}."""
    params = inspect.signature(method_class(name).__init__).parameters
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in list(params.values())[1:]
        if p.name not in ("keep", "budget") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def method_families(name: str) -> list[str]:
    """The adapter families whose models wrap() accepts method ``name`` on (``Method.refusal``
    against each family's stages), in ``vlm_prune.adapters.FAMILY_STAGES`` order."""
    from vlm_prune.adapters import FAMILY_STAGES

    cls = method_class(name)
    return [family for family, stages in FAMILY_STAGES.items() if cls.refusal(family, stages) is None]


def method_stages(name: str) -> tuple[str, ...]:
    """The stages method ``name`` runs in: its own, or every stage of a method that spans several
    (``needs_stages``: PruneVid's frames-stage merge and llm-stage selection)."""
    cls = method_class(name)
    return tuple(getattr(cls, "needs_stages", None) or (cls.stage,))


def describe_methods() -> list[dict[str, Any]]:
    """One plain dict per registered method: name, stage, paper, ``supported``: the model families
    wrap() accepts it on (:func:`method_families`) and ``family_notes`` (limits within a family),
    whether it runs without keep / budget (its own defaults), its knobs with defaults, and
    ``budget_note``: how keep / budget relate to the paper's own target, where they differ."""
    out = []
    for name in available_methods():
        cls = method_class(name)
        out.append({
            "name": name, "stage": "+".join(method_stages(name)), "paper": cls.paper,
            "supported": method_families(name), "family_notes": {f: n for f in method_families(name) if (n := cls.note_on(f))},
            "own_defaults": bool(cls.own_schedule), "knobs": method_knobs(name),
            "budget_note": getattr(cls, "budget_note", None),
        })
    return out


def method_class(name: str) -> type[Method]:
    _load_builtin()
    key = name.strip().lower().replace("-", "_")
    if key not in _METHODS:
        close = difflib.get_close_matches(key, list(_METHODS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown method {name!r}.{hint} Available: {', '.join(sorted(_METHODS))}."
        )
    return _METHODS[key]


def make_method(spec: str | Method, **kwargs: Any) -> Method:
    """A configured Method from a registered name (defaults) or a Method object as is."""
    from vlm_prune.methods.base import Method

    if isinstance(spec, Method):
        return spec
    if isinstance(spec, str):
        return method_class(spec)(**kwargs)
    raise TypeError(
        f"a method is a registered name (see vlm_prune.available_methods()) or a "
        f"vlm_prune.methods.Method object, got {type(spec).__name__}"
    )
