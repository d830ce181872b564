"""The one step end (``MediaGuard.on_step_end``: counters, the drop budget), once per guard
whoever triggers it (:func:`end_step`). It may combine counters over the pipeline group, never
inside a forward: distributed runs end steps through a :class:`StepEnd` or the loop's
``handle.step_end(step)``; a guarded call ends the previous step only in a single process.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..core.guard import MediaGuard
from .method_hook import Hook

# last step whose end ran, per guard (every trigger reads and writes it)
_ended: weakref.WeakKeyDictionary[MediaGuard, int] = weakref.WeakKeyDictionary()


def end_step(guard: MediaGuard, step: int, *, again: bool = False) -> dict[str, int] | None:
    """``guard.on_step_end(step)`` unless that step (or a later one) already ended
    (``again``: run it anyway, the training loop's explicit call)."""
    done = _ended.get(guard)
    if not again and done is not None and done >= step:
        return None
    _ended[guard] = step
    return guard.on_step_end(step)


class StepEnd:
    """Ends steps of ``guards`` from outside the forward, on every rank (docs/MEGATRON.md,
    Launcher, 5.): :meth:`on_method` hooks a method every rank calls once per step (Megatron's
    DDP ``zero_grad_buffer``) and ends the previous step when ``step_provider()`` changed;
    :meth:`on_optimizer_step` ends the current one after every torch optimizer step (a global
    post-step hook: ``install_from_args`` may run before any optimizer exists).
    """

    kind = "step_end"

    def __init__(
        self, guards: Sequence[MediaGuard], step_provider: Callable[[], int | None]
    ) -> None:
        self.guards = list({id(g): g for g in guards}.values())
        self.step_provider = step_provider
        self._seen: int | None = None
        self._triggers: list[tuple[str, Any]] = []  # ("method", Hook), ("optimizer", torch's)

    def end(self, step: int) -> None:
        for g in self.guards:
            end_step(g, step)

    def _new_step(self, *_: Any) -> None:
        step, prev = self.step_provider(), self._seen
        if prev is not None and step is not None and step != prev:
            self.end(prev)
        self._seen = step if step is not None else prev

    def _optimizer_stepped(self, *_: Any) -> None:
        step = self.step_provider()
        if step is not None:
            self.end(step)

    def on_method(self, target: object, name: str) -> StepEnd | None:
        """None when ``target`` has no method ``name``."""
        if not self.guards or not callable(getattr(target, name, None)):
            return None
        self._triggers.append(("method", Hook(target, name, self, pre=self._new_step).install()))
        return self

    def on_optimizer_step(self) -> StepEnd:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._triggers.append(
            ("optimizer", register_optimizer_step_post_hook(self._optimizer_stepped))
        )
        return self

    @property
    def installed(self) -> bool:
        return bool(self._triggers)

    def remove(self) -> None:
        while self._triggers:
            self._triggers.pop()[1].remove()

    def __repr__(self) -> str:
        return f"StepEnd({', '.join(how for how, _ in self._triggers) or 'removed'})"
