"""Keeping a media tower in step across data-parallel ranks when a micro-batch feeds it nothing
(why and the measurements: docs/PARALLEL.md, ``keep_tower``): the model's own tower runs in the
forward **pre**-hook on a minimal dummy input, and a ``-0.0`` that depends on its output goes
into the input embeddings (else the model's output); its gradient is exactly zero. The keeper's
protocol: :class:`~.forward_hook.ForwardHookHandle`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import KeepTower
from ..core.apply import zero_anchor
from ..errors import MediaInputError


def tower_due(mode: KeepTower, *, had_media: bool, feeds_media: bool) -> bool:
    """Whether the guard runs the dummy tower call: the forward will not run the tower and
    ``mode`` asks for it (``"always"``; ``"on_drop"``: the call had media, all dropped)."""
    if feeds_media or mode == "never":
        return False
    return mode == "always" or had_media


def float_leaves(out: Any) -> list[torch.Tensor]:
    """Every floating tensor in ``out`` (tensors, mappings, sequences, dataclasses), depth first."""
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
    """One forward's kept tower output, between the pre-hook and the post-hook (or
    :meth:`into_embeddings`, a post on the embedding module's forward, where it runs)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._anchor: torch.Tensor | None = None
        self._placed = False
        self._all_dropped = False

    def run(self, tower_call: Callable[[], Any]) -> None:
        """Runs the tower now and keeps a ``-0.0`` that depends on every float it returned."""
        floats = float_leaves(tower_call())
        if not floats:
            raise MediaInputError("the dummy tower call returned no floating-point tensor")
        self._anchor, self._placed = zero_anchor(*floats), False

    def planned(self, actions) -> None:
        """The call's plan: where it drops every sample, :meth:`attach` makes a ``loss``
        beside ``logits`` a zero that depends on them."""
        self._all_dropped = bool(actions) and all(a == "drop" for a in actions)

    def into_embeddings(self, args: tuple, kwargs: dict, out: Any) -> Any:
        if self._anchor is None or self._placed:
            return None
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        self._placed = True
        return out + self._anchor.to(out.dtype)

    def attach(self, out: Any) -> Any:
        """The model's output with the kept anchor added, unless the embeddings took it; None
        when there is nothing to add (the output as it is)."""
        anchor = None if self._placed else self._anchor
        all_dropped = self._all_dropped
        self.clear()
        if anchor is None and not all_dropped:
            return None
        return anchored(out, anchor, all_dropped)


def anchored(out: Any, anchor: torch.Tensor | None, all_dropped: bool) -> Any:
    """``out`` with ``anchor`` (-0.0: no bit changes) added to its ``logits`` /
    ``last_hidden_state`` / ``loss`` (a mapping, in place), to a tensor, or to a tuple's first;
    with ``all_dropped``, a ``loss`` next to ``logits`` becomes a zero that depends on them."""
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
    """The token embedding module: transformers' ``get_input_embeddings()``, Megatron-Bridge's
    ``language_model.embedding``; None if not here (a later pipeline stage, another layout)."""
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
