"""A guard installed as a forward pre-hook and post-forward hook on one model instance (the
Qwen-VL adapter and the family engine): install / remove, the mark that refuses a second
install, the tower keeper between the two hooks, and :class:`CallArgs`, the keyword view of
the call the pre-hook sees."""

from __future__ import annotations

import inspect
from typing import Any

from ..core.guard import MediaGuard
from ..errors import MediaInputError
from .hooks import AdapterKind, GuardHandle
from .tower import TowerKeeper, input_embeddings


class CallArgs:
    """The keyword view of one forward call (positional arguments bound by the signature);
    ``set`` writes back, :meth:`rebuild` gives ``(args, kwargs)`` for the model."""

    def __init__(self, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
        self.bound = sig.bind(*args, **kwargs)
        self.varkw = next(
            (p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )
        self.names = {
            p.name
            for p in sig.parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
        self.changed = False

    def _extra(self) -> dict:
        return self.bound.arguments.get(self.varkw, {}) if self.varkw else {}

    def get(self, name: str) -> Any:
        a = self.bound.arguments
        return a[name] if name in a else self._extra().get(name)

    def given(self, name: str) -> bool:
        return name in self.bound.arguments or name in self._extra()

    def set(self, name: str, value: Any) -> None:
        self.changed = True
        if name in self.names:
            self.bound.arguments[name] = value
        elif self.varkw:
            self.bound.arguments.setdefault(self.varkw, {})[name] = value
        else:
            raise MediaInputError(f"the model's forward takes no {name!r}")

    def rebuild(self) -> tuple[tuple, dict]:
        return tuple(self.bound.args), dict(self.bound.kwargs)


class ForwardHookHandle(GuardHandle):
    """A guard installed as a forward pre-hook (keyword arguments) and a post-forward hook on
    one model instance, with a :class:`~.tower.TowerKeeper` between them (the Qwen-VL adapter
    and the family engine). Subclasses set ``MARK`` (the instance attribute that refuses a
    second install) and define ``_pre_hook`` / ``_post_hook``."""

    MARK = "_media_guard_hook"

    def __init__(self, model: Any, guard: MediaGuard, kind: AdapterKind, **kw: Any) -> None:
        super().__init__(model, "forward", guard, kind, **kw)
        self.sig = inspect.signature(model.forward)
        self._hooks: list[Any] = []
        self.keeper = TowerKeeper()

    @property
    def installed(self) -> bool:
        return bool(self._hooks)

    def install_hooks(self) -> ForwardHookHandle:
        m = self.module
        if m.__dict__.get(self.MARK) is not None:
            raise MediaInputError(
                f"this {type(m).__name__} is already guarded (by a {self.kind} handle); call "
                "handle.remove() before installing again"
            )
        self._hooks = [
            m.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            m.register_forward_hook(self._post_hook, with_kwargs=True),
        ]
        self.keeper = TowerKeeper(input_embeddings(m))
        object.__setattr__(m, self.MARK, self)
        return self

    def remove(self) -> None:
        """Takes both hooks off: the model is the plain model again (idempotent)."""
        for h in self._hooks:
            h.remove()
        self.keeper.remove()
        if self._hooks:
            self.module.__dict__.pop(self.MARK, None)
        self._hooks = []

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        raise NotImplementedError
