"""Built-in methods. Importing this package registers them all."""
from vlm_prune.methods.base import (
    LayerContext,
    LLMMethod,
    Method,
    Reduction,
    VisionContext,
    VisionMethod,
)
from vlm_prune.methods.simple import Pool, Random
from vlm_prune.methods.fastv import FastV

__all__ = [
    "Method", "VisionMethod", "LLMMethod", "Reduction", "VisionContext", "LayerContext",
    "Random", "Pool", "FastV",
]
