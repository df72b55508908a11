"""vlm-prune: drop or merge visual tokens, frames and patches of VLMs without retraining.

    model = vlm_prune.wrap(model, "fastv", keep=0.5)
    model.vlm_prune.last_stats
    vlm_prune.unwrap(model)
"""
from vlm_prune.api import unwrap, wrap
from vlm_prune.registry import available_methods, describe_methods, register
from vlm_prune.frames.select import select_frames

__all__ = ["wrap", "unwrap", "available_methods", "describe_methods", "register", "select_frames", "__version__"]
__version__ = "0.1.0"
