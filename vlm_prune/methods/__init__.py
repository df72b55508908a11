"""Built-in methods. Importing this package registers them all."""
from vlm_prune.methods.base import (
    FramesMethod,
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
from vlm_prune.methods.asvit import ASViT
from vlm_prune.methods.tome import ToMe
from vlm_prune.frames.keyscore import KeyScore
from vlm_prune.frames.quota import QuoTA
from vlm_prune.frames.uniform import Uniform

__all__ = [
    "Method", "VisionMethod", "LLMMethod", "FramesMethod", "Reduction", "VisionContext", "LayerContext",
    "Random", "Pool", "FastV", "PACT", "AdaptInfer", "VisionZip", "DivPrune", "CDPruner",
    "ASViT", "ToMe", "QuoTA", "KeyScore", "Uniform",
]
