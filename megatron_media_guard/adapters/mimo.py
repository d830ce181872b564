"""Guard for megatron-core ``MimoModel.align_embeddings_by_token_positions``.

The original gets ``modality_embeddings``: ``{"text": [num_text_tokens, h], "<modality>":
[n_m, h], ...}`` (text rows in token order; MIMO's forward embeds only the non-special
tokens), ``input_ids`` ``[b, s]`` with each item's placeholders already expanded, and
``special_token_ids`` (modality -> token id). It returns ``[s, b, h]`` and checks only
batch totals per modality, so errors that cancel across samples pass.

The guarded version places the text rows exactly as the original does, then merges
every modality through :meth:`MediaGuard.merge` (``seq_first`` output), per sample:

- item metadata (``handle.set_items(items)`` before the forward, consumed by it, or
  ``items_provider``): one :class:`MediaItem` per item, in token order, ``modality`` =
  the MIMO modality name, ``sample`` = the batch row, ``num_features`` = its rows in
  that modality's embeddings. Full per-sample, per-item checks.
- without metadata: a modality whose feature total equals its placeholder total gets
  one inferred item per placeholder run (catches malformed structure and NaN/Inf, not
  errors that cancel between samples); a modality whose totals differ cannot be
  assigned: each sample holding its placeholders goes to the policy, and the error
  names the totals.

MIMO's forward takes ``loss_mask`` elsewhere and returns it untouched: the training
step applies drops with ``loss_mask, labels = handle.mask_loss(loss_mask, labels)``
(or reads ``handle.last_result``, the guard's :class:`MergeResult`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..config import GuardConfig
from ..errors import MediaAlignmentError, MediaInputError
from ..grammar import Grammar
from ..host import to_host
from ..merge import MediaGuard, MergeResult
from .generic import merge_through_guard
from .hooks import GuardHandle, ItemsProvider, StepProvider

METHOD = "align_embeddings_by_token_positions"


def mimo_grammar(special_token_ids: Mapping[str, int]) -> Grammar:
    """The plain expanded grammar of MIMO's special tokens (one run per item)."""
    return Grammar(dict(special_token_ids), name="mimo")


def _check_grammar(grammar: Grammar, special: Mapping[str, int]) -> None:
    if dict(grammar.placeholders) != dict(special):
        raise MediaInputError(
            f"the guard's grammar placeholders {dict(grammar.placeholders)} differ from the "
            f"model's special_token_ids {dict(special)}; build the guard with "
            "Grammar(special_token_ids) (start/end tokens may be added)"
        )


def install_mimo(
    model: Any,
    guard: MediaGuard | None = None,
    *,
    config: GuardConfig | None = None,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    auto_step_end: bool | None = None,
) -> GuardHandle:
    """Guard ``model.align_embeddings_by_token_positions`` on this instance.

    guard: built from ``config`` and ``model.special_token_ids`` when None; a given
    guard's grammar must have the same placeholders as the model's special tokens.
    """
    special = getattr(model, "special_token_ids", None)
    if guard is None:
        if not special:
            raise MediaInputError(
                "install_mimo needs model.special_token_ids or a guard with a grammar"
            )
        guard = MediaGuard(config or GuardConfig(), mimo_grammar(special))
    elif special:
        _check_grammar(guard.grammar, special)
    handle = GuardHandle(
        model,
        METHOD,
        guard,
        "mimo",
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=auto_step_end,
    )
    return handle.install(_make_wrapper)


def _make_wrapper(handle: GuardHandle):
    sig = inspect.signature(handle.original)

    def align_embeddings_by_token_positions(*args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            ba = sig.bind(*args, **kwargs)
        except TypeError:
            return handle.original(*args, **kwargs)
        step, mb = handle.next_call()
        items = handle.take_items()
        where = handle.guard.where(step, mb)
        try:
            res = _merge(handle.guard, ba.arguments, items, step, mb)
        except MediaAlignmentError as err:
            if err.context.get("where"):
                raise
            raise err.with_context(f"MIMO media guard ({where}): ", where=where) from None
        handle.last_result = res
        return res.embeddings

    return align_embeddings_by_token_positions


def _merge(guard: MediaGuard, a: dict, items, step, mb) -> MergeResult:
    embs: Mapping[str, torch.Tensor] = a["modality_embeddings"]
    ids: torch.Tensor = a["input_ids"]
    special: Mapping[str, int] = a["special_token_ids"]
    if not embs:
        raise MediaInputError("no modality embeddings given; at least one modality is required")
    _check_grammar(guard.grammar, special)
    for name in embs:
        if name != "text" and name not in special:
            raise MediaInputError(f"no special token id for modality {name!r} ({dict(special)})")
    if ids.dim() != 2:
        raise MediaInputError(f"input_ids must be [b, s], got {tuple(ids.shape)}")
    ref = embs.get("text", next(iter(embs.values())))
    b, s = ids.shape
    base = torch.zeros((b, s, ref.size(-1)), dtype=ref.dtype, device=ref.device)
    if "text" in embs:
        text = embs["text"]
        mask = torch.ones_like(ids, dtype=torch.bool)
        for tok in special.values():
            mask &= ids != tok
        n_text = int(to_host(mask.sum(), why="MIMO text token count").item())
        if n_text != text.size(0):
            raise MediaInputError(
                f"{n_text} text tokens in input_ids, {text.size(0)} text embeddings",
                context={"text_tokens": n_text, "text_embeddings": int(text.size(0))},
            )
        # the original's own operation, so text rows land bit-identically
        base.masked_scatter_(mask.unsqueeze(-1).expand_as(base).to(base.device), text.flatten())
    media = {m: t for m, t in embs.items() if m != "text"}
    return merge_through_guard(
        guard,
        base.transpose(0, 1),
        ids,
        media,
        items,
        seq_first=True,
        step=step,
        microbatch=mb,
    )
