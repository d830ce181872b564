"""The handle every adapter builds on: :class:`GuardHandle` (one guard on one method of one
model instance, through :class:`~.method_hook.Hook`) and :class:`HandleGroup` (one model's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch

from ..core.apply import kept_tokens, mask_dropped
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import MergeResult
from ..core.runs import TokenLayout
from ..errors import MediaGuardError, MediaInputError
from ..ranks.consensus import dist_ready
from .method_hook import Hook
from .step_end import end_step

AdapterKind = Literal["llava", "mimo", "generic", "vlm", "step_end"]
ItemsProvider = Callable[[], Sequence[MediaItem] | None]
StepProvider = Callable[[], int | None]
T = TypeVar("T")
_UNSEEN = object()


class GuardHandle:
    """One installed guard on one method of one model instance: its :class:`Hook` (and any
    more it installs, :meth:`hook`), the guard, the call's items and step (members:
    docs/MEGATRON.md, Handles). ``auto_step_end``: the first call of a new step ends the
    previous one unless the loop did; default (None) only while torch.distributed is not
    initialized (a distributed step end is never inside a forward).

    Every guarded call runs through :meth:`call`: an error before the stage's collective still
    joins it as this rank's fatal outcome, so the peers raise naming this rank, not hang.
    """

    def __init__(
        self,
        module: object,
        method_name: str,
        guard: MediaGuard,
        kind: AdapterKind,
        *,
        items_provider: ItemsProvider | None = None,
        step_provider: StepProvider | None = None,
        auto_step_end: bool | None = None,
    ) -> None:
        self.module = module
        self.method_name = method_name
        self.guard = guard
        self.kind = kind
        self.items_provider = items_provider
        self.step_provider = step_provider
        self.auto_step_end = auto_step_end
        self.last_result: Any = None
        self._last_tokens: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.original: Callable[..., Any] | None = None
        self.hooks: list[Hook] = []
        self._pending_items: Sequence[MediaItem] | None = None
        self._step: int | None = None
        self._explicit_step = False
        self._microbatch: int | None = None
        self._calls_in_step = 0
        self._seen_step: object = _UNSEEN
        self._seen_ends = guard.steps_ended

    # ---- per-call inputs ------------------------------------------------------

    def set_items(self, items: Sequence[MediaItem] | None) -> None:
        """Item metadata for the next guarded call (in feature order); consumed by it."""
        if items is not None:
            items = tuple(items)
            for it in items:
                if not isinstance(it, MediaItem):
                    raise MediaInputError(
                        f"set_items expects MediaItem objects, got {type(it).__name__}"
                    )
        self._pending_items = items

    def set_step(self, step: int | None, microbatch: int | None = None) -> None:
        """Step (and optionally microbatch) for the records of the following calls."""
        self._step, self._microbatch, self._explicit_step = step, microbatch, True

    def take_items(self) -> Sequence[MediaItem] | None:
        items, self._pending_items = self._pending_items, None
        if items is None and self.items_provider is not None:
            items = self.items_provider()
        return None if items is None else tuple(items)

    def next_call(self) -> tuple[int | None, int | None]:
        """``(step, microbatch)`` for the call starting now; closes the previous step."""
        if self._explicit_step:
            step = self._step
        else:
            step = self.step_provider() if self.step_provider is not None else None
        if step != self._seen_step:
            prev = self._seen_step
            self._seen_step, self._calls_in_step = step, 0
            auto = not dist_ready() if self.auto_step_end is None else self.auto_step_end
            if auto and isinstance(prev, int) and step is not None:
                end_step(self.guard, prev)
            self._seen_ends = self.guard.steps_ended
        elif self.guard.steps_ended != self._seen_ends:  # the step ended since the last call
            self._seen_ends, self._calls_in_step = self.guard.steps_ended, 0
        mb = self._microbatch if self._explicit_step and self._microbatch is not None else None
        if mb is None and (step is not None or self.guard.steps_ended):
            mb = self._calls_in_step
        self._calls_in_step += 1
        return step, mb

    def step_end(self, step: int) -> dict[str, int]:
        """Call from the training loop at the end of ``step`` (once per guard)."""
        return end_step(self.guard, step, again=True)

    # ---- one guarded call ---------------------------------------------------------

    def call(self, label: str, body: Callable[[int | None, int | None], T]) -> T:
        """Runs ``body(step, microbatch)`` as one guarded call: the guard's round begins,
        ``body`` ends in ``guard.merge`` / ``guard.settle`` (the stage's collective); an
        exception before that joins it as this rank's fatal outcome (:meth:`MediaGuard.fail`)
        and is re-raised, a :class:`MediaGuardError` without a where-context prefixed once
        with ``"<label> (rank r, step s, microbatch m): "``."""
        step, mb = self.next_call()
        guard = self.guard
        guard.begin()
        try:
            return body(step, mb)
        except MediaGuardError as err:
            if not err.context.get("where"):
                where = guard.where(step, mb)
                err = err.with_context(f"{label} ({where}): ", where=where)
            guard.fail(err, step, mb)
            raise err from None
        except Exception as err:  # the adapter's own code, OOM, ...: the peers must not hang
            guard.fail(err, step, mb)
            raise

    def record(
        self,
        result: Any,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> None:
        """Stores ``last_result`` and the token ids it was computed on (for :meth:`mask_loss`)."""
        self.last_result = result
        self._last_tokens = None if input_ids is None else (input_ids, cu_seqlens)

    # ---- results ----------------------------------------------------------------

    def dropped_samples(self) -> tuple[int, ...]:
        res = self.last_result
        return () if res is None else tuple(res.report.dropped)

    def mask_loss(
        self,
        loss_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        *,
        return_count: bool = False,
    ) -> tuple:
        """Zero the loss mask and ignore the labels of the samples the last guarded call
        dropped (:func:`~..core.apply.mask_dropped`, as the merge masks its own, on the call's
        token layout; LLaVA's expanded ``[b, S]`` from its result's ``layout``); returns new
        tensors (None stays None). return_count: also ``kept``, the tokens the loss still
        trains on (:func:`~..core.apply.kept_tokens`, no host transfer; docs/CONSENSUS.md)."""
        ignore = self.guard.config.ignore_index
        res = self.last_result
        if not self.dropped_samples() or (loss_mask is None and labels is None):
            out = loss_mask, labels
            return (*out, kept_tokens(*out, ignore)) if return_count else out
        if not isinstance(res, MergeResult):
            lay = res.layout(loss_mask if loss_mask is not None else labels)
        elif self._last_tokens is None:
            raise MediaInputError(
                "mask_loss: the last guarded call did not record its token ids (call "
                "handle.record(result, input_ids, cu_seqlens) when driving the guard yourself)"
            )
        else:
            lay = TokenLayout(self._last_tokens[0], self.guard.grammar, self._last_tokens[1])
            for name, t in (("loss_mask", loss_mask), ("labels", labels)):
                if t is not None and tuple(t.shape) != (lay.batch, lay.row_length):
                    raise MediaInputError(
                        f"mask_loss: {name} must be [b, s] = {(lay.batch, lay.row_length)} like "
                        f"the guarded call's input_ids, got {tuple(t.shape)}"
                    )
        keep = torch.tensor([a in ("keep", "repair") for a in res.report.actions])
        new_mask, labels = mask_dropped(lay, keep.to(lay.device), loss_mask, labels, ignore)
        out = (new_mask if loss_mask is not None else None), labels
        return (*out, kept_tokens(*out, ignore)) if return_count else out

    # ---- install / remove -----------------------------------------------------------

    @property
    def installed(self) -> bool:
        return bool(self.hooks)

    def install(self, around: Any = None, **parts: Any) -> GuardHandle:
        """Hooks the guarded method (``self.module.<method_name>``; ``around``, ``pre``, ``post``
        as :class:`Hook` takes them); ``original`` is the method it wraps."""
        self.original = self.hook(self.module, self.method_name, around=around, **parts).original
        return self

    def hook(self, target: object, name: str, **parts: Any) -> Hook:
        """Installs one more :class:`Hook` owned by this handle (removed with it, in reverse
        order)."""
        self.hooks.append(Hook(target, name, self, **parts).install())
        return self.hooks[-1]

    def remove(self) -> None:
        """Restore the instance exactly as before :meth:`install` (idempotent)."""
        while self.hooks:
            self.hooks[-1].remove()
            self.hooks.pop()

    def __enter__(self) -> GuardHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "installed" if self.installed else "removed"
        return f"GuardHandle({self.kind}, {type(self.module).__name__}.{self.method_name}, {state})"


class HandleGroup(list):
    """The handles installed on the chunks of one model; ``remove()`` takes all off."""

    def remove(self) -> None:
        for h in reversed(self):
            h.remove()

    @property
    def merges(self) -> list[GuardHandle]:
        """The handles that guard a merge (not the step-end hook)."""
        return [h for h in self if h.kind != "step_end"]

    def set_items(self, items: Sequence[MediaItem] | None) -> None:
        for h in self.merges:
            h.set_items(items)

    def set_step(self, step: int | None, microbatch: int | None = None) -> None:
        for h in self.merges:
            h.set_step(step, microbatch)

    def step_end(self, step: int) -> None:
        """End ``step`` once per distinct guard (call it outside the forward)."""
        for h in self.merges:
            end_step(h.guard, step)

    def __enter__(self) -> HandleGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
