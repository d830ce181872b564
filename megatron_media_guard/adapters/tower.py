"""Keeping a media tower in step across data-parallel ranks when a micro-batch feeds it nothing.

FSDP2 (``fully_shard`` on the tower) all-gathers the tower's parameters when its forward starts
and reduce-scatters their gradients in backward; DDP with ``find_unused_parameters=False`` and
FSDP1 reduce every parameter's gradient. So every rank must run the tower at the same point of
the forward (before the decoder) and give each of its parameters a gradient, also when its
media were all dropped or it holds none (text only). The guard then runs the tower itself in
its forward **pre**-hook on a minimal dummy input, and keeps the output in the graph with a
``-0.0`` (the exact additive identity) added to the input embeddings (a post on the embedding
module's ``forward``), else, when that module is not known or not called (``inputs_embeds``
given), to the model's output in the post-hook.

Why there: the autograd engine runs younger nodes first, so the decoder's backward runs before
the tower's, as on a rank that fed real media. And FSDP2 reduce-scatters a unit's gradients
right after its backward only when its inputs require grad: with frozen embeddings the first
decoder layer's input requires grad only through the merged features, so the anchor must enter
the embeddings. See docs/PARALLEL.md.

Contract, per installed handle: ``TowerKeeper(embeddings, handle)``; in the pre-hook, first
``keeper.clear()``, then, once the inputs are final and ``tower_due(...)``, ``keeper.run(fn)``
(``fn()`` calls the model's own tower module, the one the wrappers shard, on a minimal dummy
input); ``keeper.every_sample_dropped()`` when every sample is dropped; in the post-hook
``return keeper.attach(out)``. The dummy's gradient is exactly zero. Under ``torch.no_grad``
the tower still runs (FSDP2 all-gathers in evaluation forwards too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import KeepTower
from ..core.apply import zero_anchor
from ..errors import MediaInputError
from .method_hook import Hook


def tower_due(mode: KeepTower, *, had_media: bool, feeds_media: bool) -> bool:
    """Whether the guard runs the dummy tower call: the forward will not run the tower
    (``feeds_media`` False) and ``mode`` asks for it (``"always"``; ``"on_drop"``: the call had
    media, all dropped; ``"never"``)."""
    if feeds_media or mode == "never":
        return False
    return mode == "always" or had_media


def float_leaves(out: Any) -> list[torch.Tensor]:
    """Every floating tensor in ``out`` (tensors, mappings, lists / tuples, dataclasses such as
    transformers' ``ModelOutput``), depth first."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        vals = list(out.values())
    elif isinstance(out, (list, tuple)):
        vals = list(out)
    else:
        vals = [getattr(out, k) for k in getattr(out, "__dataclass_fields__", {})]
    return [t for v in vals if v is not None for t in float_leaves(v)]


class TowerKeeper:
    """One forward's kept tower output, between the pre-hook and the post-hook (see module doc)."""

    def __init__(self, embeddings: torch.nn.Module | None = None, handle: Any = None) -> None:
        self._anchor: torch.Tensor | None = None
        self._placed = False
        self._all_dropped = False
        self._hook: Hook | None = None
        if embeddings is not None and handle is not None:
            self._hook = handle.hook(embeddings, "forward", post=self._into_embeddings)
        elif embeddings is not None:
            self._hook = Hook(embeddings, "forward", self, post=self._into_embeddings).install()

    @property
    def pending(self) -> bool:
        return self._anchor is not None or self._all_dropped

    def clear(self) -> None:
        self._anchor, self._placed, self._all_dropped = None, False, False

    def remove(self) -> None:
        """Takes the embedding hook off (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.clear()

    def run(self, tower_call: Callable[[], Any]) -> None:
        """Runs the tower now (call it in the pre-hook) and keeps a ``-0.0`` that depends on
        every floating tensor it returned."""
        floats = float_leaves(tower_call())
        if not floats:
            raise MediaInputError("the dummy tower call returned no floating-point tensor")
        self._anchor, self._placed = zero_anchor(*floats), False

    def every_sample_dropped(self) -> None:
        self._all_dropped = True

    def _into_embeddings(self, args: tuple, kwargs: dict, out: Any) -> Any:
        if self._anchor is None or self._placed:
            return None
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        self._placed = True
        return out + self._anchor.to(out.dtype)

    def attach(self, out: Any) -> Any:
        """The model's output with the kept anchor added, unless the embeddings took it (call
        it in the post-hook); None when there is nothing to add (a forward hook returning None
        leaves the output as it is)."""
        anchor = None if self._placed else self._anchor
        all_dropped = self._all_dropped
        self.clear()
        if anchor is None and not all_dropped:
            return None
        return anchored(out, anchor, all_dropped)


def anchored(out: Any, anchor: torch.Tensor | None, all_dropped: bool) -> Any:
    """``out`` with ``anchor`` (-0.0: no bit changes) added to its ``logits`` /
    ``last_hidden_state`` / ``loss`` (a mapping such as ``ModelOutput``, in place), to a tensor,
    or to a tuple's first tensor; with ``all_dropped``, a ``loss`` next to ``logits`` becomes a
    finite zero that depends on the logits."""
    if isinstance(out, torch.Tensor):
        return out + anchor.to(out.dtype) if anchor is not None and out.is_floating_point() else out
    if isinstance(out, Mapping):
        for key in ("logits", "last_hidden_state", "loss"):
            val = out.get(key)
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                if key == "loss" and all_dropped and out.get("logits") is not None:
                    val = zero_anchor(out["logits"]).to(val.dtype).reshape(val.shape)
                if anchor is not None:
                    val = val + anchor.to(val.dtype)
                out[key] = val
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (anchored(out[0], anchor, False), *out[1:])
    return out


def input_embeddings(module: Any) -> torch.nn.Module | None:
    """The token embedding module whose output the features are merged into: transformers'
    ``get_input_embeddings()``, Megatron-Bridge's ``language_model.embedding`` (None if not
    here: a later pipeline stage, an unknown layout)."""
    get = getattr(module, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, torch.nn.Module):
            return emb
    emb = getattr(getattr(module, "language_model", None), "embedding", None)
    return emb if isinstance(emb, torch.nn.Module) else None
