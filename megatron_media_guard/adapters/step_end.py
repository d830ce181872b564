"""The step end: one mechanism that ends a step (``MediaGuard.on_step_end``: counters, the drop
budget) once per guard, whoever triggers it.

A step end may combine counters over the pipeline group, which must never happen inside a
forward (stages run it at different times): distributed runs end steps outside the forward,
through a :class:`StepEnd` (what ``install_from_args`` installs) or the training loop's own
``handle.step_end(step)``; a guarded call ends the previous step itself only in a single process
(``GuardHandle.auto_step_end``). All of them go through :func:`end_step`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..core.guard import MediaGuard
from .method_hook import Hook

StepProvider = Callable[[], int | None]


class Guarded(Protocol):
    guard: MediaGuard


# last step whose end ran, per guard (every trigger reads and writes it)
_closed_steps: weakref.WeakKeyDictionary[MediaGuard, int] = weakref.WeakKeyDictionary()


def end_step(guard: MediaGuard, step: int, *, again: bool = False) -> dict[str, int] | None:
    """``guard.on_step_end(step)`` unless that step (or a later one) already ended, whoever
    ended it (``again``: run it anyway, the training loop's explicit call)."""
    done = _closed_steps.get(guard)
    if not again and done is not None and done >= step:
        return None
    _closed_steps[guard] = step
    return guard.on_step_end(step)


class StepEnd:
    """The step end: ends a step once per distinct guard of ``handles``, outside the forward.

    Triggers: :meth:`on_method` hooks (the one :class:`~.method_hook.Hook`) a method every rank calls once per step outside the forward
    (Megatron's DDP ``zero_grad_buffer`` at the start of train_step: when ``step_provider()``
    changed since the last call, the previous step ends); :meth:`on_optimizer_step` after every
    torch optimizer step (no model instance has that method: torch's global, removable
    post-step hook; the current step ends, repeated steps in one iteration, chained
    optimizers, end it once; a skipped step, inf/nan gradients, folds into the next).
    """

    kind = "step_end"

    def __init__(self, handles: Sequence[Guarded], step_provider: StepProvider) -> None:
        self.guards = list({id(h.guard): h.guard for h in handles}.values())
        self.guard = self.guards[0] if self.guards else None
        self.step_provider = step_provider
        self.last_result = None
        self._seen: int | None = None
        self._hook: Hook | None = None
        self._optimizer_hook: Any = None

    def end(self, step: int) -> None:
        for g in self.guards:
            end_step(g, step)

    def _advance(self, args: tuple, kwargs: dict) -> None:
        step, prev = self.step_provider(), self._seen
        if prev is not None and step is not None and step != prev:
            self.end(prev)
        if step is not None:
            self._seen = step

    def on_method(self, target: object, name: str) -> StepEnd | None:
        """Ends the previous step when ``target.<name>()`` runs in a new step; None when
        ``target`` has no such method."""
        if not self.guards or not callable(getattr(target, name, None)):
            return None
        self._hook = Hook(target, name, self, pre=self._advance).install()
        return self

    def on_optimizer_step(self) -> StepEnd:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def ended(optimizer: object, args: object, kwargs: object) -> None:
            step = self.step_provider()
            if step is not None:
                self.end(step)

        self._optimizer_hook = register_optimizer_step_post_hook(ended)
        return self

    @property
    def installed(self) -> bool:
        return self._hook is not None or self._optimizer_hook is not None

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None

    def __repr__(self) -> str:
        how = "method" if self._hook else "optimizer" if self._optimizer_hook else "removed"
        return f"StepEnd({how})"
