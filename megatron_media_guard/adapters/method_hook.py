"""The one hook type of the adapters: :class:`Hook`, a pre and a post (or a body in place of
the method) around one named method of one object *instance*, an instance attribute shadowing
the class method (why a model's ``forward`` too, not torch forward hooks: docs/MEGATRON.md).

One double-install check: a method that already carries a hook (its :data:`HANDLE_ATTR`,
which ``functools.update_wrapper`` copies onto a later wrapper of it) refuses another: a silent
no-op would hide a difference between the two installs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..errors import MediaInputError

Pre = Callable[[tuple, dict], "tuple[tuple, dict] | None"]
Post = Callable[[tuple, dict, Any], Any]
Around = Callable[[Callable[..., Any], tuple, dict], Any]

#: attribute (on the installed hook) pointing back to the hook's owner (its handle)
HANDLE_ATTR = "__media_guard_handle__"
_MISSING = object()


class Hook:
    """Pre / post around the method ``name`` of one instance ``target``; installed, the hook
    itself stands in for the method on the instance. A copy of the model would still call this
    instance's method, so ``copy.deepcopy`` of it is refused.

    pre(args, kwargs): None, or the ``(args, kwargs)`` to call with; around(original, args,
    kwargs): runs in place of the method; post(args, kwargs, out): None, or the output in
    place of ``out``. ``owner``: what :func:`guarded_by` returns (a handle).
    """

    def __init__(
        self,
        target: object,
        name: str,
        owner: object,
        *,
        pre: Pre | None = None,
        post: Post | None = None,
        around: Around | None = None,
    ) -> None:
        self.target, self.name, self.owner = target, name, owner
        self.pre, self.post, self.around = pre, post, around
        self.original: Callable[..., Any] | None = None
        self._previous: object = _MISSING
        self._installed = False

    def install(self) -> Hook:
        target, name = self.target, self.name
        current = getattr(target, name, None)
        if current is None or not callable(current):
            raise MediaInputError(f"{type(target).__name__} has no method {name!r} to guard")
        other = getattr(current, HANDLE_ATTR, None)
        if other is not None:
            raise MediaInputError(
                f"{type(target).__name__}.{name} of this instance is already guarded (by a "
                f"{getattr(other, 'kind', type(other).__name__)} handle); call handle.remove() "
                "before installing again"
            )
        self._previous = target.__dict__.get(name, _MISSING)
        self.original = current
        functools.update_wrapper(self, current, updated=())
        setattr(self, HANDLE_ATTR, self.owner)
        object.__setattr__(target, name, self)
        self._installed = True
        return self

    def remove(self) -> None:
        """Restore the instance exactly as before :meth:`install` (idempotent)."""
        if not self._installed:
            return
        target, name = self.target, self.name
        if target.__dict__.get(name) is not self:
            raise MediaInputError(
                f"{type(target).__name__}.{name} was replaced after the media guard was "
                "installed; remove the later wrapper first (handles come off in reverse order)"
            )
        if self._previous is _MISSING:
            object.__delattr__(target, name)
        else:
            object.__setattr__(target, name, self._previous)
        self._installed, self._previous = False, _MISSING

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pre is not None:
            new = self.pre(args, kwargs)
            if new is not None:
                args, kwargs = new
        m = self.original
        out = m(*args, **kwargs) if self.around is None else self.around(m, args, kwargs)
        if self.post is not None:
            new = self.post(args, kwargs, out)
            if new is not None:
                out = new
        return out

    def __deepcopy__(self, memo: dict) -> Any:
        what = getattr(self, "__qualname__", self.name)
        raise MediaInputError(
            f"{what} is guarded: a copy of the model would call the original's; copy the model "
            "before installing the guard (or remove it, copy, install on each)"
        )


def guarded_by(method: object) -> Any:
    """The handle whose hook ``method`` is (None for an unguarded method)."""
    return getattr(method, HANDLE_ATTR, None)
