"""Kernels with PyTorch references; see the individual modules."""
from vlm_prune.kernels.attention_rows import attention_to_keys

__all__ = ["attention_to_keys"]
