"""Built-in methods: the base classes, and every method class by name (see ``BUILTIN``)."""
import importlib
from typing import Any

from vlm_prune import lazy_attribute
from vlm_prune.methods.base import (
    FramesMethod,
    LayerContext,
    LLMMethod,
    Method,
    Reduction,
    VisionContext,
    VisionMethod,
)

# built-in method classes -> the module defining (and registering) each; imported on first use or
# by the registry, so that importing one method module never has to import all the others first
BUILTIN = {
    "Random": "vlm_prune.methods.simple",
    "Pool": "vlm_prune.methods.simple",
    "FastV": "vlm_prune.methods.fastv",
    "PACT": "vlm_prune.methods.pact",
    "AdaptInfer": "vlm_prune.methods.adaptinfer",
    "VisionZip": "vlm_prune.methods.visionzip",
    "DivPrune": "vlm_prune.methods.divprune",
    "CDPruner": "vlm_prune.methods.cdpruner",
    "ASViT": "vlm_prune.methods.asvit",
    "ToMe": "vlm_prune.methods.tome",
    "FasterVLM": "vlm_prune.methods.fastervlm",
    "VisPruner": "vlm_prune.methods.vispruner",
    "DART": "vlm_prune.methods.dart",
    "PyramidDrop": "vlm_prune.methods.pdrop",
    "HiRED": "vlm_prune.methods.hired",
    "PruMerge": "vlm_prune.methods.prumerge",
    "FrameFusion": "vlm_prune.methods.framefusion",
    "SparseVLM": "vlm_prune.methods.sparsevlm",
    "MustDrop": "vlm_prune.methods.mustdrop",
    "KeyScore": "vlm_prune.frames.keyscore",
    "QuoTA": "vlm_prune.frames.quota",
    "Uniform": "vlm_prune.frames.uniform",
    "VidCom2": "vlm_prune.frames.vidcom2",
    "FastVID": "vlm_prune.frames.fastvid",
    "HoliTom": "vlm_prune.frames.holitom",
    "DyCoke": "vlm_prune.frames.dycoke",
    "PruneVid": "vlm_prune.frames.prunevid",
}


def load_builtin() -> None:
    """Import (and so register) every built-in method."""
    for module in dict.fromkeys(BUILTIN.values()):
        importlib.import_module(module)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, BUILTIN, name)


__all__ = [
    "Method", "VisionMethod", "LLMMethod", "FramesMethod", "Reduction", "VisionContext", "LayerContext",
    "Random", "Pool", "FastV", "PACT", "AdaptInfer", "VisionZip", "DivPrune", "CDPruner",
    "ASViT", "ToMe", "QuoTA", "KeyScore", "Uniform",
    "VidCom2", "FastVID", "HoliTom", "DyCoke", "PruneVid",
    "FasterVLM", "VisPruner", "DART", "PyramidDrop", "HiRED", "PruMerge", "FrameFusion", "SparseVLM", "MustDrop",
]
