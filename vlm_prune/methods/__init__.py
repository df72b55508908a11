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
from vlm_prune.methods.pact import PACT
from vlm_prune.methods.adaptinfer import AdaptInfer
from vlm_prune.methods.visionzip import VisionZip
from vlm_prune.methods.divprune import DivPrune
from vlm_prune.methods.cdpruner import CDPruner

__all__ = [
    "Method", "VisionMethod", "LLMMethod", "Reduction", "VisionContext", "LayerContext",
    "Random", "Pool", "FastV",
    "PACT", "AdaptInfer", "VisionZip", "DivPrune", "CDPruner",
]
import vlm_prune.frames  # noqa: F401,E402  (registers the frames-stage methods)
from vlm_prune.methods.asvit import ASViT  # noqa: E402
from vlm_prune.methods.tome import ToMe  # noqa: E402
