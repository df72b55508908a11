"""Instance patching that unwrap can undo exactly (accelerate hooks included)."""
from __future__ import annotations

import copy
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
        #: hooks registered on the model's modules (torch RemovableHandle), removed by restore()
        self._hooks: list[Any] = []

    def track(self, handle: Any) -> Any:
        """Record a hook handle (``module.register_forward_pre_hook(...)``) as part of the patch."""
        self._hooks.append(handle)
        return handle

    def installed(self) -> list[Any]:
        """Every value the patch put on the model: patched attributes and registered hooks
        (what ``copy.deepcopy`` of a wrapped model leaves out of the copy)."""
        values = [vars(obj)[name] for obj, name, _ in self._saved if name in vars(obj)]
        for handle in self._hooks:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                values.append(hooks[handle.id])
        return values

    def restore_copy(self, memo: dict[int, Any], cut: Any) -> None:
        """On a deep copy made with ``memo`` in which every :meth:`installed` value became ``cut``:
        put back what the originals held before the patch (copied) and drop the copied hooks.
        An attribute patched twice (an adapter wrapping its base class's patch) gets the value it
        held before the first patch: the one in between belongs to the original's patch."""
        first: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        for obj, name, old in self._saved:
            first.setdefault((id(obj), name), (obj, name, old))
        for obj, name, old in first.values():
            clone = memo.get(id(obj))
            if clone is None or vars(clone).get(name, None) is not cut:
                continue
            if old is _MISSING:
                delattr(clone, name)
            else:
                setattr(clone, name, copy.deepcopy(old, memo))
        for handle in self._hooks:
            hooks = handle.hooks_dict_ref()
            clone = memo.get(id(hooks)) if hooks is not None else None
            if clone is not None and clone.get(handle.id) is cut:
                del clone[handle.id]

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
        while self._hooks:
            self._hooks.pop().remove()
        while self._saved:
            obj, name, old = self._saved.pop()
            if old is _MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
