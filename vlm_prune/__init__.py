"""vlm-prune: drop or merge visual tokens, frames and patches of VLMs without retraining.

    model = vlm_prune.wrap(model, "fastv", keep=0.5)
    model.vlm_prune.last_stats
    vlm_prune.unwrap(model)
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module defining it; imported on first use, so that `import vlm_prune` (and the
# `vlm-prune --help` command) does not pay for torch until something needs it
_EXPORTS = {
    "wrap": "vlm_prune.api",
    "unwrap": "vlm_prune.api",
    "available_methods": "vlm_prune.registry",
    "register": "vlm_prune.registry",
    "describe_methods": "vlm_prune.registry",
    "select_frames": "vlm_prune.frames.select",
    "tune": "vlm_prune.eval.tune",
}
__all__ = [*_EXPORTS, "__version__"]
__version__ = "0.1.0"


def lazy_attribute(package: str, exports: dict[str, str], name: str) -> Any:
    """A package's ``__getattr__``: ``name`` from the module ``exports`` maps it to, else the
    package's submodule ``name``, both imported on first use."""
    if name in exports:
        return getattr(importlib.import_module(exports[name]), name)
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
