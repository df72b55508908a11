import importlib.util
import os
import sys

# Triton kernels run on CPU only under Triton's interpreter, which must be on before triton (or
# anything that imports it) is first imported; CPU dispatch ("auto") still picks the PyTorch
# references, so only the kernel tests that force backend="triton" are affected.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention (and xdist runs 2 workers)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def hide_module(monkeypatch):
    """``hide_module("cv2")``: ``importlib.util.find_spec`` reports that module as not installed."""
    real = importlib.util.find_spec

    def hide(module: str) -> None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))

    return hide
