"""Base class of all adapters."""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from typing import Any, ClassVar, Generic, Iterator, TypeVar

import torch

from vlm_prune.adapters.patching import Patcher

T = TypeVar("T")
_slot_ids = itertools.count()


class PerThread:
    """An instance attribute (default None) whose value belongs to the calling thread: state that
    one forward pass leaves for the next step of the same thread (a ViT run from block to block)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(_threads_of(obj), self.name, None)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(_threads_of(obj), self.name, value)


def _threads_of(obj: Any) -> threading.local:
    return obj.__dict__.setdefault("_vlm_prune_per_thread", threading.local())


class ContextSlot(Generic[T]):
    """A value local to the calling thread (and asyncio task): the per-request state of a model
    that several threads may call at once.

    ``with slot.use(value):`` sets it for the block and restores the previous value when the
    block ends, also when it raises, so a failed request leaves nothing behind.
    """

    def __init__(self, name: str, default: T) -> None:
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(f"vlm_prune.{name}.{next(_slot_ids)}")
        self._default = default

    def get(self) -> T:
        return self._var.get(self._default)

    @contextlib.contextmanager
    def use(self, value: T) -> Iterator[T]:
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)


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
        for method in self.state.methods.values():
            refusal = method.refusal(self.family, self.stages)
            if refusal:
                raise ValueError(refusal)
            if getattr(method, "needs_processor", False) and self.state.processor is None:
                raise ValueError(
                    f"method {method.name!r} prompts the model, so it needs the model's processor: "
                    f"vlm_prune.wrap(model, {method.name!r}, ..., processor=processor)"
                )

    def attach(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def detach(self) -> None:
        self.patches.restore()
