"""Base class of all adapters."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_prune.adapters.patching import Patcher


class Adapter:
    """Knows where things are in one model family and patches one model instance.

    Subclasses set ``family`` (short name used by methods' ``supported``), ``model_classes``
    (class names it handles) and ``stages`` (the method stages it can run), and implement
    ``attach``. ``detach`` undoes every patch made through ``self.patches``.
    """

    family: ClassVar[str] = ""
    model_classes: ClassVar[tuple[str, ...]] = ()
    stages: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: torch.nn.Module, state: Any) -> None:
        self.model = model
        self.state = state
        self.patches = Patcher()

    def check_methods(self) -> None:
        for stage, method in self.state.methods.items():
            if stage not in self.stages:
                raise ValueError(
                    f"method {method.name!r} works in the {stage!r} stage, which the {self.family} "
                    f"adapter ({type(self.model).__name__}) does not offer; it offers: {', '.join(self.stages)}"
                )
            if getattr(method, "needs_processor", False) and self.state.processor is None:
                raise ValueError(
                    f"method {method.name!r} prompts the model, so it needs the model's processor: "
                    f"vlm_prune.wrap(model, {method.name!r}, ..., processor=processor)"
                )

    def attach(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def detach(self) -> None:
        self.patches.restore()
