"""A guard as a pre and a post around one model instance's ``forward`` (the family engine):
the one hook type (:class:`~.method_hook.Hook`, its double-install check and ``remove()``), the
tower keeper between the two, and :class:`CallArgs`, the keyword view of the call the pre sees."""

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
    """A guard installed as a pre (keyword arguments) and a post around one model instance's
    ``forward`` (:meth:`GuardHandle.install`: the one hook type, on ``forward`` as on any
    method), with a :class:`~.tower.TowerKeeper` between them whose embedding hook is this
    handle's too. Subclasses define ``_pre_hook`` (torch's forward pre-hook contract: None, or
    ``(args, kwargs)``) and ``_post_hook`` (None, or the output). The double-install check
    is the hook's own, one for every method."""

    def __init__(self, model: Any, guard: MediaGuard, kind: AdapterKind, **kw: Any) -> None:
        super().__init__(model, "forward", guard, kind, **kw)
        self.sig = inspect.signature(model.forward)
        self.keeper = TowerKeeper()

    def install_hooks(self) -> ForwardHookHandle:
        m = self.module
        self.install(
            pre=lambda args, kwargs: self._pre_hook(m, args, kwargs),
            post=lambda args, kwargs, out: self._post_hook(m, args, kwargs, out),
        )
        try:
            self.keeper = TowerKeeper(input_embeddings(m), self)
        except MediaInputError:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Takes the hooks off (``forward``, the keeper's embeddings): the model is the plain
        model again (idempotent)."""
        super().remove()
        self.keeper.clear()

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        raise NotImplementedError
