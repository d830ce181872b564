"""Install / remove machinery shared by the adapters (accelerate-hooks style).

An adapter wraps one method of one model *instance*: the wrapper is stored as an
instance attribute that shadows the class method, so other instances and the class
are untouched. ``handle.remove()`` restores the instance exactly as it was (deleting
the shadowing attribute, or putting back an instance attribute that was there).

Installing a second guard on the same method of the same instance is an error
(:class:`~megatron_media_guard.errors.MediaInputError`): a silent no-op would hide a
configuration difference between the two installs. Remove the first handle, then
install again.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import torch

from ..core.apply import kept_tokens, mask_dropped
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import MergeResult
from ..core.runs import TokenLayout
from ..errors import MediaGuardError, MediaInputError
from ..ranks.consensus import dist_ready

AdapterKind = Literal["llava", "mimo", "generic", "qwen_vl", "vlm", "step_end"]
ItemsProvider = Callable[[], Sequence[MediaItem] | None]
StepProvider = Callable[[], int | None]
T = TypeVar("T")

#: attribute (on the wrapper function) pointing back to its handle
HANDLE_ATTR = "__media_guard_handle__"
_MISSING = object()

# last step for which ``guard.on_step_end`` was called, per guard (shared by handles)
_closed_steps: weakref.WeakKeyDictionary[MediaGuard, int] = weakref.WeakKeyDictionary()


class GuardHandle:
    """One installed guard on one method of one model instance.

    items: the training step calls :meth:`set_items` before the forward (consumed by
        the next guarded call), or passes ``items_provider`` (called on every guarded call).
    step / microbatch: :meth:`set_step`, or ``step_provider`` (e.g. Megatron-LM's
        ``args.curr_iteration``). The microbatch (unless :meth:`set_step` gives it) is the
        index of the guarded call in its step, from 0: a step begins when the step changes
        or the guard's previous step ended (``on_step_end``, whoever called it). Knowing
        neither (no step, no step ended yet), the handle names no microbatch.
        With ``auto_step_end`` the handle calls
        ``guard.on_step_end(previous_step)`` on the first call of a new step (the drop
        budget is checked there) unless the training loop already did. Default (None):
        only while torch.distributed is not initialized, because a distributed step end
        may combine counters over the pipeline group, which must never happen inside a
        forward (stages run it at different times). Distributed runs close steps from
        outside the forward: :meth:`step_end`, or :func:`install_step_end` (what
        ``install_from_args`` does).
    last_result: what the last guarded call produced (a MergeResult for MIMO/generic, an
        ``LlavaResult`` for LLaVA); ``mask_loss`` applies its drops to a loss mask.

    Every guarded call runs through :meth:`call`: an error on this rank before the stage's
    collective (an adapter's own check, bad input, out of memory) still joins it as this
    rank's fatal outcome, so the other ranks raise naming this one instead of hanging.
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
        self._wrapper: Callable[..., Any] | None = None
        self._previous: object = _MISSING
        self._pending_items: Sequence[MediaItem] | None = None
        self._step: int | None = None
        self._explicit_step = False
        self._microbatch: int | None = None
        self._calls_in_step = 0
        self._seen_step: object = _MISSING
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
            auto = self.auto_step_end
            if auto is None:
                auto = not dist_ready()
            if auto and isinstance(prev, int) and step is not None:
                self._close_step(prev)
            self._seen_ends = self.guard.steps_ended
        elif self.guard.steps_ended != self._seen_ends:  # the step ended since the last call
            self._seen_ends, self._calls_in_step = self.guard.steps_ended, 0
        mb = self._microbatch if self._explicit_step and self._microbatch is not None else None
        if mb is None and (step is not None or self.guard.steps_ended):
            mb = self._calls_in_step
        self._calls_in_step += 1
        return step, mb

    def _close_step(self, step: int) -> None:
        done = _closed_steps.get(self.guard)
        if done is not None and done >= step:
            return
        _closed_steps[self.guard] = step
        self.guard.on_step_end(step)

    def step_end(self, step: int) -> dict[str, int]:
        """Call from the training loop at the end of ``step`` (once per guard)."""
        _closed_steps[self.guard] = step
        return self.guard.on_step_end(step)

    # ---- one guarded call ---------------------------------------------------------

    def call(self, label: str, body: Callable[[int | None, int | None], T]) -> T:
        """Runs ``body(step, microbatch)`` as one guarded call.

        The guard's round starts (:meth:`MediaGuard.begin`) before the adapter's own checks;
        ``body`` must end in ``guard.merge`` / ``guard.settle``, which join the stage's
        collective. An exception before that joins it as this rank's fatal outcome
        (:meth:`MediaGuard.fail`) and is re-raised here; a :class:`MediaGuardError`
        without a where-context gets ``"<label> (rank r, step s, microbatch m): "`` once.
        """
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
        """Stores the call's result (``last_result``) and, for a :class:`MergeResult`, the token
        ids it was computed on, so :meth:`mask_loss` can find the dropped samples' tokens."""
        self.last_result = result
        self._last_tokens = None if input_ids is None else (input_ids, cu_seqlens)

    # ---- results ----------------------------------------------------------------

    def dropped_samples(self) -> tuple[int, ...]:
        res = self.last_result
        if res is None:
            return ()
        report = getattr(res, "report", res)
        return tuple(getattr(report, "dropped", ()))

    def mask_loss(
        self,
        loss_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        *,
        return_count: bool = False,
    ) -> tuple:
        """Zero the loss mask and ignore the labels of the samples the last guarded call
        dropped; returns new tensors (the inputs are not modified; None stays None).

        return_count: return ``(loss_mask, labels, kept)``, ``kept`` the tokens the loss still
        trains on (:func:`~megatron_media_guard.core.apply.kept_tokens`, no host transfer), for
        a per-token loss across data-parallel ranks (docs/CONSENSUS.md, loss normalization).
        """
        out = self._masked(loss_mask, labels)
        if not return_count:
            return out
        return (*out, kept_tokens(out[0], out[1], self.guard.config.ignore_index))

    def _masked(
        self, loss_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`mask_loss`'s tensors.

        MIMO / generic (a :class:`MergeResult`): ``[b, s]`` like the call's ``input_ids``; a
        sample is that call's sample (a row, or a packed sample of ``cu_seqlens``), masked
        token by token with :func:`megatron_media_guard.core.apply.mask_dropped`, as the merge
        masks its own ``loss_mask``. LLaVA: ``[b, S]`` in the expanded output layout, where
        rows are samples (:func:`mask_rows`).
        """
        dropped = self.dropped_samples()
        if not dropped or (loss_mask is None and labels is None):
            return loss_mask, labels
        ignore = self.guard.config.ignore_index
        res = self.last_result
        if not isinstance(res, MergeResult):
            return mask_rows(dropped, getattr(res, "num_samples", None), loss_mask, labels, ignore)
        if self._last_tokens is None:
            raise MediaInputError(
                "mask_loss: the last guarded call did not record its token ids (call "
                "handle.record(result, input_ids, cu_seqlens) when driving the guard yourself)"
            )
        ids, cu = self._last_tokens
        lay = TokenLayout(ids, self.guard.grammar, cu)
        for name, t in (("loss_mask", loss_mask), ("labels", labels)):
            if t is not None and tuple(t.shape) != (lay.batch, lay.row_length):
                raise MediaInputError(
                    f"mask_loss: {name} must be [b, s] = {(lay.batch, lay.row_length)} like the "
                    f"guarded call's input_ids, got {tuple(t.shape)}"
                )
        keep = torch.tensor(
            [a in ("keep", "repair") for a in res.report.actions], device=lay.device
        )
        new_mask, labels = mask_dropped(lay, keep, loss_mask, labels, ignore)
        return (new_mask if loss_mask is not None else None), labels

    # ---- install / remove -----------------------------------------------------------

    @property
    def installed(self) -> bool:
        return self._wrapper is not None

    def install(self, make_wrapper: Callable[[GuardHandle], Callable[..., Any]]) -> GuardHandle:
        module, name = self.module, self.method_name
        current = getattr(module, name, None)
        if current is None or not callable(current):
            raise MediaInputError(f"{type(module).__name__} has no method {name!r} to guard")
        other = getattr(current, HANDLE_ATTR, None)
        if other is not None:
            raise MediaInputError(
                f"{type(module).__name__}.{name} of this instance is already guarded "
                f"(by a {other.kind} handle); call handle.remove() before installing again"
            )
        self._previous = module.__dict__.get(name, _MISSING)
        self.original = current
        wrapper = make_wrapper(self)
        functools.update_wrapper(wrapper, current)
        wrapper.__wrapped__ = current  # type: ignore[attr-defined]
        setattr(wrapper, HANDLE_ATTR, self)
        object.__setattr__(module, name, wrapper)
        self._wrapper = wrapper
        return self

    def remove(self) -> None:
        """Restore the instance exactly as before :meth:`install` (idempotent)."""
        if self._wrapper is None:
            return
        module, name = self.module, self.method_name
        if module.__dict__.get(name) is not self._wrapper:
            raise MediaInputError(
                f"{type(module).__name__}.{name} was replaced after the media guard was "
                "installed; remove the later wrapper first (handles come off in reverse order)"
            )
        if self._previous is _MISSING:
            object.__delattr__(module, name)
        else:
            object.__setattr__(module, name, self._previous)
        self._wrapper = None
        self._previous = _MISSING

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
            if _closed_steps.get(h.guard, -1) < step:
                h.step_end(step)

    def __enter__(self) -> HandleGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def guarded_by(method: object) -> GuardHandle | None:
    """The handle whose wrapper ``method`` is (None for an unguarded method)."""
    return getattr(method, HANDLE_ATTR, None)


def iter_handles(handles: GuardHandle | Iterable[GuardHandle]) -> list[GuardHandle]:
    return [handles] if isinstance(handles, GuardHandle) else list(handles)


def mask_rows(
    rows: Sequence[int],
    num_rows: int | None,
    loss_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    ignore_index: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``loss_mask`` zeroed and ``labels`` set to ``ignore_index`` in the given rows of
    ``[b, S]`` tensors whose rows are the samples (LLaVA's expanded output). Out of place.

    num_rows: the call's sample count; the tensors must have that many rows (None: any).
    """
    ref = loss_mask if loss_mask is not None else labels
    if ref is None or not rows:
        return loss_mask, labels
    for name, t in (("loss_mask", loss_mask), ("labels", labels)):
        if t is not None and (t.dim() < 1 or (num_rows is not None and t.shape[0] != num_rows)):
            raise MediaInputError(
                f"{name} must have one row per sample ({num_rows}), got {tuple(t.shape)}"
            )
    if max(rows) >= ref.shape[0]:
        raise MediaInputError(f"dropped rows {sorted(rows)} outside {tuple(ref.shape)}")
    sel = torch.zeros(ref.shape[0], dtype=torch.bool)
    sel[list(rows)] = True
    sel = sel.to(ref.device, non_blocking=True)
    if loss_mask is not None:
        loss_mask = loss_mask.masked_fill(sel.view(-1, *([1] * (loss_mask.dim() - 1))), 0)
    if labels is not None:
        labels = labels.masked_fill(sel.view(-1, *([1] * (labels.dim() - 1))), ignore_index)
    return loss_mask, labels


def install_step_end(
    module: object,
    method_name: str,
    handles: Sequence[GuardHandle],
    step_provider: StepProvider,
) -> GuardHandle | None:
    """Close steps from a method every rank calls once per step outside the forward
    (Megatron's ``DistributedDataParallel.zero_grad_buffer`` at the start of train_step):
    when ``step_provider()`` changed since the last call, ``step_end(previous)`` runs
    for every distinct guard of ``handles``. Returns None when there is no such method."""
    if not handles or not callable(getattr(module, method_name, None)):
        return None
    state: dict[str, int | None] = {"seen": None}
    group = HandleGroup(handles)

    def make(h: GuardHandle) -> Callable[..., Any]:
        def hook(*args: Any, **kwargs: Any) -> Any:
            step = step_provider()
            prev = state["seen"]
            if prev is not None and step is not None and step != prev:
                group.step_end(prev)
            if step is not None:
                state["seen"] = step
            return h.original(*args, **kwargs)

        return hook

    h = GuardHandle(module, method_name, handles[0].guard, "step_end", step_provider=step_provider)
    return h.install(make)


class OptimizerStepEnd:
    """Closes the current step after every torch optimizer step (a global, removable
    ``torch.optim`` post-step hook): every rank runs the optimizer step once per train
    step, outside the forward. Repeated steps in one iteration (chained optimizers) close
    it once; a skipped step (inf/nan gradients) folds its counters into the next."""

    kind: AdapterKind = "step_end"

    def __init__(self, handles: Sequence[GuardHandle], step_provider: StepProvider) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        group = HandleGroup(handles)
        self.guard = handles[0].guard if handles else None
        self.last_result = None

        def hook(optimizer: object, args: object, kwargs: object) -> None:
            step = step_provider()
            if step is not None:
                group.step_end(step)

        self._hook = register_optimizer_step_post_hook(hook)
        self.installed = True

    def remove(self) -> None:
        if self.installed:
            self._hook.remove()
            self.installed = False

    def __repr__(self) -> str:
        return f"OptimizerStepEnd({'installed' if self.installed else 'removed'})"
