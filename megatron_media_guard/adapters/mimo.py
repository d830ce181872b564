"""Guard for megatron-core ``MimoModel.align_embeddings_by_token_positions`` (docs/MEGATRON.md,
MIMO): the guarded version places the text rows as the original does (same bits, no sync) and
merges every modality through :meth:`MediaGuard.merge` per sample, with the items given
(``handle.set_items``, token order, ``modality`` the MIMO name) or inferred
(:func:`~.generic.merge_through_guard`). The text rows are counted only where the totals
cannot prove them (a transfer). MIMO returns ``loss_mask`` untouched: the training step
applies drops with ``handle.mask_loss(loss_mask, labels)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import GuardConfig
from ..core.grammar import Grammar
from ..core.guard import MediaGuard
from ..core.host import to_host
from ..core.outcome import MergeResult
from ..core.runs import parse_runs
from ..errors import MediaInputError
from .generic import merge_through_guard
from .hooks import GuardHandle, ItemsProvider, StepProvider

METHOD = "align_embeddings_by_token_positions"


def mimo_grammar(model: Any) -> Grammar:
    """The plain expanded grammar of ``model.special_token_ids`` (one run per item)."""
    return Grammar(dict(getattr(model, "special_token_ids", None) or {}), name="mimo")


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
    """Guard ``model.align_embeddings_by_token_positions`` on this instance. guard: built
    from ``config`` and ``model.special_token_ids`` when None, else with the same
    placeholders."""
    special = getattr(model, "special_token_ids", None)
    if guard is None:
        if not special:
            raise MediaInputError(
                "install_mimo needs model.special_token_ids or a guard with a grammar"
            )
        guard = MediaGuard(config, mimo_grammar(model))
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

    def align_embeddings_by_token_positions(original, args: tuple, kwargs: dict) -> torch.Tensor:
        try:
            a = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # megatron-core reports its own signature error

        def body(step: int | None, mb: int | None) -> MergeResult:
            res = _merge(handle.guard, a, handle.take_items(), step, mb)
            handle.record(res, a["input_ids"])
            return res

        return handle.call("MIMO media guard", body).embeddings

    handle.install(align_embeddings_by_token_positions)
    sig = inspect.signature(handle.original)  # read by the hook (installed: the method exists)
    return handle


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
    media = {m: t for m, t in embs.items() if m != "text"}
    parsed = None
    checks: Callable[[], list[str]] | None = None
    text = embs.get("text")
    if text is None:
        ref = next(iter(media.values()))
        base = ref.new_zeros((*ids.shape, ref.size(-1)))
    else:
        mask = torch.ones_like(ids, dtype=torch.bool)
        for tok in special.values():
            mask &= ids != tok
        rows = int(text.size(0))
        if items is None:  # the runs are parsed anyway to infer the items: count from them
            parsed = parse_runs(ids, guard.grammar)
            _check_text(ids.numel() - sum(r.length for r in parsed.runs), rows)
        elif rows + sum(int(t.size(0)) for t in media.values()) != ids.numel():
            _check_text(_count(mask, "MIMO text token count (totals disagree)"), rows)
        else:
            # text tokens = b*s - placeholders, and an aligned verdict means placeholders ==
            # media rows: the count holds whenever the verdict is aligned, so only the fault
            # path (which syncs anyway) counts them, before the stage agrees on the plan

            def text_fits() -> list[str]:
                n_text = _count(mask, "MIMO text token count (slow path)")
                if n_text == rows:
                    return []
                return [f"text: {n_text} text tokens in input_ids, {rows} text embeddings"]

            checks = text_fits

        base = _place_text(mask, text)
    return merge_through_guard(
        guard,
        base.transpose(0, 1),
        ids,
        media,
        items,
        seq_first=True,
        step=step,
        microbatch=mb,
        parsed=parsed,
        fault_checks=checks,
    )


def _count(mask: torch.Tensor, why: str) -> int:
    return int(to_host(mask.sum(), why=why).item())


def _check_text(n_text: int, rows: int) -> None:
    if n_text != rows:
        raise MediaInputError(
            f"{n_text} text tokens in input_ids, {rows} text embeddings",
            context={"text_tokens": n_text, "text_embeddings": rows},
        )


def _place_text(mask: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """``[b, s, h]``: the text rows at the text positions in token order, zeros elsewhere:
    the original's ``zeros.masked_scatter_(mask, text)`` bits with no host sync (rows past the
    end, where the counts disagree, read zeros instead of failing on the device)."""
    b, s = mask.shape
    flat = mask.reshape(-1).to(text.device)
    n = text.size(0)
    pos = torch.cumsum(flat, 0) - 1
    idx = torch.where(flat & (pos < n), pos, n)
    src = torch.cat([text, text.new_zeros(1, text.size(-1))])
    return src.index_select(0, idx).view(b, s, text.size(-1))
