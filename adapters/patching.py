"""Instance patching that unwrap can undo exactly (accelerate hooks included)."""
from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


class Patcher:
    """Records every attribute it sets on an instance and restores them in reverse order.

    Patching ``module.forward`` on a module that accelerate has hooked (it has ``_hf_hook``
    and keeps the real forward in ``_old_forward``) patches ``_old_forward`` instead, so the
    device-placement hook stays in front of our code.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        if name == "forward" and hasattr(obj, "_hf_hook") and "_old_forward" in vars(obj):
            name = "_old_forward"
        self._saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    def bind(self, obj: Any, name: str, fn: Callable[..., Any]) -> None:
        """Set ``obj.name`` to ``fn`` bound to ``obj`` (fn takes the instance first)."""
        self.set(obj, name, fn.__get__(obj, type(obj)))

    def original(self, obj: Any, name: str) -> Any:
        """The attribute as it was before this patcher first touched it (bound if a method)."""
        if name == "forward" and hasattr(obj, "_hf_hook") and "_old_forward" in vars(obj):
            name = "_old_forward"
        for o, n, old in self._saved:
            if o is obj and n == name:
                return getattr(type(obj), name).__get__(obj, type(obj)) if old is _MISSING else old
        return getattr(obj, name)

    def restore(self) -> None:
        while self._saved:
            obj, name, old = self._saved.pop()
            if old is _MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
