"""Choosing between a Triton kernel and its PyTorch reference.

Every public kernel takes ``backend="auto" | "triton" | "torch"``. ``"auto"`` runs Triton when
the tensors live on a CUDA device of compute capability 8.0 or newer (Ampere, Ada, Hopper: the
kernels are built for their tensor cores and checked on sm_80 / sm_90 by
``vlm_prune.eval.kernel_report``) and Triton is installed, and the PyTorch reference otherwise.
``"triton"`` forces the kernel: on CPU tensors it needs Triton's interpreter, which Triton enables
only when ``TRITON_INTERPRET=1`` was set before the kernel modules were imported (tests do this).
Triton is an optional extra (``pip install vlm-prune[kernels]``) and is imported lazily.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")
MIN_CAPABILITY = (8, 0)


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def recent_gpu(device: torch.device) -> bool:
    """True for a CUDA device of compute capability >= ``MIN_CAPABILITY``."""
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for ``backend`` and the device of ``tensors``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() and recent_gpu(tensors[0].device) else "torch"
    if not triton_available():
        raise ImportError("backend='triton' needs Triton: pip install 'vlm-prune[kernels]', or use backend='torch'")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "importing the kernels, move the tensors to CUDA, or use backend='torch'"
        )
    return "triton"


def triton_module(name: str) -> ModuleType:
    """Import ``vlm_prune.kernels.<name>`` (a module that imports triton) on first use."""
    return importlib.import_module(f"vlm_prune.kernels.{name}")
