"""The method registry: names -> Method classes, with close-name suggestions."""
from __future__ import annotations

import difflib
from typing import Any

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
    import vlm_prune.methods  # noqa: F401  (importing registers the built-in methods)


def available_methods() -> list[str]:
    """Names accepted by ``vlm_prune.wrap``."""
    _load_builtin()
    return sorted(_METHODS)


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
    if isinstance(spec, Method):
        return spec
    if isinstance(spec, str):
        return method_class(spec)(**kwargs)
    raise TypeError(
        f"a method is a registered name (see vlm_prune.available_methods()) or a "
        f"vlm_prune.methods.Method object, got {type(spec).__name__}"
    )
