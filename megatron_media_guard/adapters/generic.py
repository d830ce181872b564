"""Guard any model's own merge function (docs/MEGATRON.md, Custom models): :func:`guard_merge_fn`
returns a function with its parameters (:class:`ArgMap`) that merges through
:meth:`MediaGuard.merge` instead; :func:`install_generic` puts it on one instance. Without item
metadata a packed tensor gets one item per placeholder run when the totals agree
(:func:`infer_items`): structure and NaN/Inf are still checked, errors that cancel between
samples are not.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.apply import zero_anchor
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import MergeResult
from ..core.runs import ParsedRuns, parse_runs
from ..diagnostics import GuardRecord
from ..errors import MediaGuardError, MediaInputError
from .hooks import GuardHandle, ItemsProvider, StepProvider

OutputFn = Callable[[MergeResult], Any]


@dataclass(frozen=True)
class ArgMap:
    """Parameter names of the wrapped merge function (None: not passed to it). embeddings:
    ``[b, s, h]`` (``[s, b, h]`` with ``seq_first``); input_ids ``[b, s]``; features
    ``[sum n, h]`` or a list of ``[n_i, h]``."""

    embeddings: str = "inputs_embeds"
    input_ids: str = "input_ids"
    features: str = "image_features"
    items: str | None = None
    loss_mask: str | None = None
    labels: str | None = None
    cu_seqlens: str | None = None
    seq_first: bool = False


def infer_items(
    parsed: ParsedRuns, totals: Mapping[str, int] | int
) -> tuple[tuple[MediaItem, ...], tuple[str, ...]]:
    """One item per placeholder run, for each modality whose feature total (``totals``: per
    modality, or one int for all in token order) equals its placeholder total. Returns
    ``(items in token order, modalities whose totals differ)``."""
    runs = [r for r in parsed.runs if r.modality != "break"]
    have = _placeholders(parsed)
    if isinstance(totals, int):
        ok = sum(have.values()) == totals
        bad: tuple[str, ...] = () if ok else ("*",)
        use = {r.modality for r in runs} if ok else set()
    else:
        bad = tuple(
            m for m in sorted(set(have) | set(totals)) if have.get(m, 0) != totals.get(m, 0)
        )
        use = {m for m in have if m not in bad}
    items = tuple(
        MediaItem(r.length, sample=r.sample, modality=r.modality) for r in runs if r.modality in use
    )
    return items, bad


def _features_for(items: Sequence[MediaItem], by_modality: Mapping[str, torch.Tensor]) -> list:
    """Per-item feature slices: each modality's rows consumed in the items' order."""
    cursor = dict.fromkeys(by_modality, 0)
    out = []
    for i, it in enumerate(items):
        if it.modality not in by_modality:
            raise MediaInputError(
                f"item {i} has modality {it.modality!r}; features were given for "
                f"{sorted(by_modality)}"
            )
        c = cursor[it.modality]
        out.append(by_modality[it.modality][c : c + it.num_features])
        cursor[it.modality] = c + it.num_features
    for m, t in by_modality.items():
        if cursor[m] != t.shape[0]:
            raise MediaInputError(
                f"items of modality {m!r} declare {cursor[m]} feature rows, its embeddings "
                f"have {t.shape[0]}",
                context={"modality": m, "declared": cursor[m], "rows": int(t.shape[0])},
            )
    return out


def guard_merge_fn(
    merge_fn: Callable[..., Any],
    guard: MediaGuard,
    *,
    arg_map: ArgMap | None = None,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    output: OutputFn | None = None,
    handle: GuardHandle | None = None,
) -> Callable[..., Any]:
    """A function with ``merge_fn``'s parameters that merges through ``guard`` (the original
    is not called) and returns the merged embeddings in the input layout, or
    ``output(result)``; it has ``.handle`` and ``__wrapped__`` (``merge_fn``)."""
    amap = arg_map or ArgMap()
    sig = inspect.signature(merge_fn)
    for name in (amap.embeddings, amap.input_ids, amap.features):
        if name not in sig.parameters:
            raise MediaInputError(
                f"{getattr(merge_fn, '__qualname__', merge_fn)!r} has no parameter {name!r} "
                f"(parameters: {list(sig.parameters)}); pass an ArgMap"
            )
    if handle is None:
        handle = GuardHandle(
            merge_fn,
            getattr(merge_fn, "__name__", "merge"),
            guard,
            "generic",
            items_provider=items_provider,
            step_provider=step_provider,
        )
        handle.original = merge_fn

    def guarded(*args: Any, **kwargs: Any) -> Any:
        a = sig.bind(*args, **kwargs).arguments

        def opt(name: str | None) -> Any:  # an optional parameter's argument
            return a.get(name) if name else None

        def body(step: int | None, mb: int | None) -> MergeResult:
            items = opt(amap.items)
            res = merge_through_guard(
                guard,
                a[amap.embeddings],
                a[amap.input_ids],
                a[amap.features],
                handle.take_items() if items is None else items,
                loss_mask=opt(amap.loss_mask),
                labels=opt(amap.labels),
                seq_first=amap.seq_first,
                step=step,
                microbatch=mb,
                cu_seqlens=opt(amap.cu_seqlens),
            )
            handle.record(res, a[amap.input_ids], opt(amap.cu_seqlens))
            return res

        res = handle.call("media guard", body)
        return output(res) if output is not None else res.embeddings

    guarded.__wrapped__ = merge_fn  # type: ignore[attr-defined]
    guarded.handle = handle  # type: ignore[attr-defined]
    return guarded


def merge_through_guard(
    guard: MediaGuard,
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    items: Sequence[MediaItem] | None,
    *,
    parsed: ParsedRuns | None = None,
    **merge_kw: Any,
) -> MergeResult:
    """``guard.merge`` with item metadata completed where it is missing.

    features: one tensor (items in token order), a list per item, or a mapping modality ->
    ``[n_m, h]``. Without items, a modality whose feature total differs from its placeholder
    total is not merged (kept in the graph by a -0.0 term) and every sample holding its
    placeholders goes to the policy. parsed: the caller's ``parse_runs`` of these ids, if any.
    merge_kw: :meth:`MediaGuard.merge`'s keywords. Call it inside :meth:`GuardHandle.call`: an
    error before ``guard.merge`` must still join the stage's collective."""
    unused: list[torch.Tensor] = []
    note = None
    cu_seqlens = merge_kw.get("cu_seqlens")
    # items inferred from the runs: a mapping's, or one tensor's in token order
    if items is None and parsed is None and isinstance(features, (Mapping, torch.Tensor)):
        parsed = parse_runs(input_ids, guard.grammar, cu_seqlens)
    if isinstance(features, Mapping):
        by_mod = dict(features)
        if items is None:
            totals = {m: int(t.shape[0]) for m, t in by_mod.items()}
            items, bad = infer_items(parsed, totals)
            if bad:
                note = _totals_note(bad, totals, parsed)
                unused = [by_mod.pop(m) for m in bad if m in by_mod]
        feats: Any = _features_for(items, by_mod)
        if len({m.modality for m in items}) <= 1 and len(by_mod) == 1 and items:
            feats = next(iter(by_mod.values()))  # one modality in order: no copy
        elif not feats:
            ref = next(iter(features.values()), None)
            feats = ref[:0] if ref is not None else embeddings.new_zeros((0, embeddings.shape[-1]))
            items = ()
    else:
        feats = features
        if items is None and isinstance(features, torch.Tensor):
            n = int(features.shape[0])
            items, bad = infer_items(parsed, n)
            if bad:
                note = _totals_note(("*",), {"*": n}, parsed)
                unused, feats, items = [features], features[:0], ()
    if note is not None:
        guard.log.emit(
            GuardRecord(
                event="check",
                step=merge_kw.get("step"),
                microbatch=merge_kw.get("microbatch"),
                action="unattributed",
                reason=note,
            ),
            caller="megatron_media_guard.adapters.generic",
        )
    try:
        res = guard.merge(embeddings, input_ids, feats, items, **merge_kw)
    except MediaGuardError as err:
        if note is None:
            raise
        raise err.with_context(f"{note}\n") from None
    if unused:
        anchor = zero_anchor(*unused).to(res.embeddings.dtype)
        res = replace(res, embeddings=res.embeddings + anchor)
    return res


def _placeholders(parsed: ParsedRuns) -> Counter[str]:
    """Placeholders per modality."""
    have: Counter[str] = Counter()
    for r in parsed.runs:
        if r.modality != "break":
            have[r.modality] += r.length
    return have


def _totals_note(bad: Sequence[str], totals: Mapping[str, int], parsed: ParsedRuns) -> str:
    per = _placeholders(parsed)
    parts = []
    for m in bad:
        have = sum(per.values()) if m == "*" else per.get(m, 0)
        name = "all modalities" if m == "*" else f"modality {m!r}"
        parts.append(f"{name}: {totals.get(m, 0)} feature rows for {have} placeholders")
    return (
        "no item metadata and the totals disagree (" + "; ".join(parts) + "): the features "
        "cannot be assigned to samples, so every sample holding those placeholders is "
        "handled by the policy (pass items, or handle.set_items(...) before the call)"
    )


def install_generic(
    model: Any,
    method_name: str,
    guard: MediaGuard,
    arg_map: ArgMap | None = None,
    *,
    items_provider: ItemsProvider | None = None,
    step_provider: StepProvider | None = None,
    output: OutputFn | None = None,
    auto_step_end: bool | None = None,
) -> GuardHandle:
    """Replace ``model.<method_name>`` (on this instance only) by its guarded version."""
    handle = GuardHandle(
        model,
        method_name,
        guard,
        "generic",
        items_provider=items_provider,
        step_provider=step_provider,
        auto_step_end=auto_step_end,
    )

    handle.install(lambda original, args, kwargs: guarded(*args, **kwargs))  # in its place
    try:
        guarded = guard_merge_fn(
            handle.original, guard, arg_map=arg_map, output=output, handle=handle
        )
    except MediaInputError:  # the method lacks a parameter the ArgMap names
        handle.remove()
        raise
    return handle
