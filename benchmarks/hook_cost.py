"""What the family guard's pre-hook costs on one model and batch, in CPU time of one thread.

On the shared 2-core machine wall time swings 1.5-2x minute to minute; the CPU time of the
calling thread (``time.thread_time()``, torch at one thread so every kernel runs on it) moves
far less. Plain and guarded forwards are interleaved, and the pre-hook is also timed from the
inside: its own time, and the time of the model's own calls it makes on the model's behalf
(the feature methods and towers, which the plain forward runs too; the rope index the guard
hands the forward as ``position_ids``; the token-embedding lookup; the tower's attention mask
where the spec builds it with the model's own function, freed only once the hook's time is
taken: the plain forward frees the same one), each timed at the outermost call (a feature
method calling its tower counts once). ``hook - model calls`` is the guard's own work: the
figure the <= 1 % target is about, since the tower runs in both forwards.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_media_guard.core.host import count_transfers

#: the model's own methods the pre-hook may call, by what they stand for
METHODS = {
    "encode": ("get_image_features", "get_video_features", "get_audio_features"),
    "rope": ("get_rope_index",),
}
#: towers and projectors a spec may run directly (Qwen2-Audio has no get_audio_features)
TOWERS = ("vision_tower", "visual", "vision_model", "audio_tower", "multi_modal_projector")
#: functions of a tower's modeling module that its model's forward calls before the tower and a
#: spec calls the same way (Qwen2-Audio's encode builds the tower's mask as the forward does);
#: what they return is held until the pre-hook's time is taken: its free is the model's work too
#: (Qwen2-Audio's mask is 81 MB at 36 clips: freeing it took 7-15 ms of the pre-hook's time)
MODULE_FUNCS = {"create_bidirectional_mask": "mask"}


@dataclass(frozen=True)
class HookCost:
    """Medians over the reps, ms of CPU time of one thread."""

    plain: float
    guarded: float
    hook: float
    calls: dict[str, float]  # the model's own calls inside the hook, by kind
    own: tuple[float, ...]  # hook - model calls, per rep
    transfers: Counter[str]
    reps: int
    merge: float = 0.0  # the model's merge the guarded forward skips (see :func:`_plain_merge`)

    @property
    def own_ms(self) -> float:
        return statistics.median(self.own)

    @property
    def net_ms(self) -> float:
        """The guard's own work less the merge it takes over from the plain forward (the
        guarded forward gets ``inputs_embeds`` and skips its own masks and scatter)."""
        return self.own_ms - self.merge


class _Clock:
    """Accumulates the thread time of wrapped calls made while the pre-hook runs."""

    def __init__(self) -> None:
        self.acc: Counter[str] = Counter()
        self.in_hook = False
        self.depth = 0
        self.held: list[Any] = []  # results of ``hold`` calls, freed once the hook's time is taken

    def wrap(self, kind: str, fn: Callable, hold: bool = False) -> Callable:
        def timed(*args, **kwargs):
            if not self.in_hook or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.thread_time()
            try:
                out = fn(*args, **kwargs)
                if hold:
                    self.held.append(out)
                return out
            finally:
                self.acc[kind] += time.thread_time() - t0
                self.depth -= 1

        return timed

    def hook(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.in_hook = True
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc["hook"] += time.thread_time() - t0
                self.in_hook = False
                self.held.clear()

        return timed


def _instrument(model: Any, clock: _Clock) -> list[Callable[[], None]]:
    """Instance attributes that shadow the model's methods with timed ones (and timed module
    functions of its towers' modeling modules); returns the calls that restore them."""
    owners = [model, getattr(model, "model", None)]
    undo: list[Callable[[], None]] = []

    def shadow(obj: Any, name: str, kind: str) -> None:
        fn = getattr(obj, name, None)
        if callable(fn) and name not in obj.__dict__:
            object.__setattr__(obj, name, clock.wrap(kind, fn))
            undo.append(lambda: object.__delattr__(obj, name))

    for obj in (o for o in owners if o is not None):
        for kind, names in METHODS.items():
            for name in names:
                shadow(obj, name, kind)
        for name in TOWERS:
            mod = getattr(obj, name, None)
            if not isinstance(mod, torch.nn.Module):
                continue
            shadow(mod, "forward", "encode")
            pymod = sys.modules[type(mod).__module__]
            for fname, kind in MODULE_FUNCS.items():
                fn = getattr(pymod, fname, None)
                if callable(fn) and not getattr(fn, "_timed", False):
                    timed = clock.wrap(kind, fn, hold=True)
                    timed._timed = True
                    setattr(pymod, fname, timed)
                    undo.append(lambda pymod=pymod, fname=fname, fn=fn: setattr(pymod, fname, fn))
    shadow(model.get_input_embeddings(), "forward", "embed")
    return undo


def _plain_merge(model: Any, clock: _Clock) -> list[Callable[[], None]]:
    """Times, inside a forward, the model's ``get_placeholder_mask`` and every
    ``Tensor.masked_scatter`` (the merge of transformers' VLMs; the guard's CPU scatter uses
    neither); returns the calls that restore them. Plain minus guarded is the merge the
    guarded forward skips (none where the guard rewrites the inputs: Qwen-VL)."""
    undo: list[Callable[[], None]] = []
    for obj in (model, getattr(model, "model", None)):
        fn = getattr(obj, "get_placeholder_mask", None) if obj is not None else None
        if callable(fn) and "get_placeholder_mask" not in obj.__dict__:
            object.__setattr__(obj, "get_placeholder_mask", clock.wrap("merge", fn))
            undo.append(lambda obj=obj: object.__delattr__(obj, "get_placeholder_mask"))
    for name in ("masked_scatter", "masked_scatter_"):
        fn = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, clock.wrap("merge", fn))
        undo.append(lambda name=name, fn=fn: setattr(torch.Tensor, name, fn))
    return undo


def last_token_head(model: Any):
    """A pre-hook on the vocabulary projection that keeps the last position only (the
    removable handle): logits over 150k-260k words at 4 x 8192 positions do not fit in memory,
    and the guard never touches them. Both forwards get it."""
    head = model.get_output_embeddings()
    if head is None:
        head = model.language_model.lm_head
    return head.register_forward_pre_hook(lambda _m, args: (args[0][:, -1:], *args[1:]))


def measure(model: Any, handle: Any, kwargs: dict, reps: int, items=None) -> HookCost:
    """``reps`` interleaved (plain, guarded) forwards under no_grad, torch at one thread,
    after one guarded forward that counts the device-to-host transfers (and warms both up:
    the plain forward runs the same modules). ``handle``: an installed-then-removed guard
    handle of ``model`` (``install_hooks`` / ``remove`` each guarded call); ``items``: given
    to ``handle.set_items`` before each guarded call (None: not given)."""
    clock = _Clock()
    handle._pre_hook = clock.hook(handle._pre_hook)  # install_hooks registers this one
    restore = _instrument(model, clock)
    head = last_token_head(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    merge_clock = _Clock()

    def merging(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            undo = _plain_merge(model, merge_clock)
            merge_clock.in_hook = True  # the whole forward is the scope
            try:
                fn()
            finally:
                merge_clock.in_hook = False
                for u in reversed(undo):
                    u()

        return run

    def plain() -> None:
        with torch.no_grad():
            model(**kwargs)

    def guarded() -> None:
        handle.install_hooks()
        if items is not None:
            handle.set_items(items)
        try:
            with torch.no_grad():
                model(**kwargs)
        finally:
            handle.remove()

    try:
        with count_transfers() as seen:
            guarded()
        times: dict[str, list[float]] = {"plain": [], "guarded": []}
        inside: list[Counter[str]] = []
        merges: dict[str, list[float]] = {"plain": [], "guarded": []}
        for _ in range(reps):
            for name, fn in (("plain", merging(plain)), ("guarded", merging(guarded))):
                clock.acc = Counter()
                merge_clock.acc = Counter()
                t0 = time.thread_time()
                fn()
                times[name].append((time.thread_time() - t0) * 1e3)
                merges[name].append(merge_clock.acc["merge"] * 1e3)
                if name == "guarded":
                    inside.append(Counter({k: v * 1e3 for k, v in clock.acc.items()}))
    finally:
        torch.set_num_threads(threads)
        head.remove()
        for undo in reversed(restore):
            undo()
        del handle._pre_hook
    kinds = sorted({k for c in inside for k in c if k != "hook"})
    own = tuple(c["hook"] - sum(c[k] for k in kinds) for c in inside)
    return HookCost(
        plain=statistics.median(times["plain"]),
        guarded=statistics.median(times["guarded"]),
        hook=statistics.median(c["hook"] for c in inside),
        calls={k: statistics.median(c[k] for c in inside) for k in kinds},
        own=own,
        transfers=seen,
        reps=reps,
        merge=statistics.median(merges["plain"]) - statistics.median(merges["guarded"]),
    )
