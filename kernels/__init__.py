"""Kernels with PyTorch references (same arguments, ``*_torch``) and Triton implementations.

Every public function takes ``backend="auto" | "triton" | "torch"``: ``auto`` uses Triton for
CUDA tensors when Triton is installed (the ``kernels`` extra) and the reference otherwise.
Triton is imported only when a Triton kernel runs. See the individual modules for shapes,
dtypes and memory costs.
"""
if __name__ != "vlm_prune.kernels":  # imported as the bare `kernels` from the checkout root: see vlm_prune/_bare_names.py
    from vlm_prune._bare_names import hand_over

    hand_over(__name__, __file__)
else:
    from vlm_prune.kernels._dispatch import triton_available
    from vlm_prune.kernels.attention_rows import (
        attention_key_scores,
        attention_key_scores_torch,
        attention_to_keys,
        attention_to_keys_torch,
    )
    from vlm_prune.kernels.density_peaks import (
        cosine_distance,
        cosine_distance_torch,
        density,
        density_rank,
        density_torch,
        nearest_denser,
        nearest_denser_torch,
    )
    from vlm_prune.kernels.euti import euti_scores, euti_scores_torch
    from vlm_prune.kernels.merge import gather_rows, gather_rows_torch, scatter_mean, scatter_mean_torch

    __all__ = [
        "attention_key_scores",
        "attention_key_scores_torch",
        "attention_to_keys",
        "attention_to_keys_torch",
        "cosine_distance",
        "cosine_distance_torch",
        "density",
        "density_rank",
        "density_torch",
        "euti_scores",
        "euti_scores_torch",
        "gather_rows",
        "gather_rows_torch",
        "nearest_denser",
        "nearest_denser_torch",
        "scatter_mean",
        "scatter_mean_torch",
        "triton_available",
    ]
