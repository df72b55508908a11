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
}
__all__ = [*_EXPORTS, "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'vlm_prune' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
