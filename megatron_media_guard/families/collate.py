"""The family check before the trainer: in a collate function or a rollout worker, on the
processor's outputs and the rollout's token ids, with no model and no tower (CPU, free;
docs/DATA_SIDE.md, docs/FAMILIES.md). Each item's count comes from the spec's ``counts``,
checked against the runs on the device (an aligned batch: one transfer). A mismatched sample
is dropped (the default here), raises naming it, or is repaired from its original media
(``media=``, :mod:`.reprocess`). The steps are :mod:`.inputs`'s, shared with the
``apply="inputs"`` pre-hook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..config import GuardConfig
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import GuardReport
from ..core.runs import TokenLayout
from ..core.validate import check_labels_dtype, check_masks
from ..errors import MediaInputError
from . import FAMILIES, no_family
from .inputs import (
    count_tables,
    counted,
    device_tables,
    drop_inputs,
    plan_items,
    token_types,
    verified,
)
from .inputs_items import token_items
from .reprocess import Reprocessed, Reprocessor, originals
from .spec import FamilySpec, check_tokenizer, present

CALLER = "check_batch"


@dataclass(frozen=True)
class BatchCheck:
    """``batch``: the inputs with every dropped sample's media out and its placeholders text;
    ``report``: per sample what was found and done."""

    batch: dict[str, Any]
    report: GuardReport
    reprocessed: tuple[Reprocessed, ...] = ()  # items re-processed from their originals

    @property
    def dropped(self) -> tuple[int, ...]:
        return self.report.dropped

    @property
    def matched(self) -> frozenset[tuple[str, int]]:
        """``(modality, index)`` of the items re-processed at the rollout's runs: a later step
        that re-attaches media from a static source must leave them alone (docs/DATA_SIDE.md)."""
        return frozenset((d.modality, d.index) for d in self.reprocessed)


def check_batch(
    family: str | FamilySpec,
    batch: Mapping[str, Any],
    *,
    config: Any,
    tokenizer: Any = None,
    guard: MediaGuard | GuardConfig | None = None,
    step: int | None = None,
    sample_ids: Sequence[str | int | None] | None = None,
    items: Sequence[MediaItem] | None = None,
    media: Any = None,
    processor: Any = None,
) -> BatchCheck:
    """Checks one collated batch of ``family`` (a registry name or a spec) against its token
    ids. config: the model's config (token ids and sizes; no weights). tokenizer: for markers
    the config lacks. guard: a guard, or its config (default: drop, no consensus).
    sample_ids: per sample the pipeline's id, in the records and messages. items: one
    :class:`MediaItem` per model-level item, per modality in the model's order: its
    ``sample_id``, ``source_hw`` and, where the inputs do not size it (InternVL), its
    ``num_features``. media: one original per item, re-processed with ``processor`` where
    mismatched (``policy="repair"``, :mod:`.reprocess`)."""
    spec = _spec(family)
    ids = _ids(batch)
    if config is None:
        raise MediaInputError(
            f"{CALLER}({spec.name!r}, ...) needs config= (the model's config, e.g. "
            "AutoConfig.from_pretrained(path): its token ids and sizes; no weights)"
        )
    check_tokenizer(tokenizer, CALLER)
    sids = _sample_ids(sample_ids, ids.shape[0])
    holder = SimpleNamespace(config=config)
    geo = spec.geometry(holder) if media is not None and spec.geometry else None
    if not isinstance(guard, MediaGuard):
        cfg = guard if guard is not None else GuardConfig(policy="drop")
        grammar = spec.grammar(holder, tokenizer, CALLER)
        guard = MediaGuard(cfg, grammar, consensus=False, geometry=geo)
    text = spec.text.resolve(holder, tokenizer)
    mods = present(spec, batch)
    tables = count_tables(spec, mods, config, batch, CALLER)
    rows = _given(mods, tables, items)
    if media is not None:  # one original per model-level item, refused before any check
        originals(media, [(mod, k) for mod, n in rows.items() for k in range(n)])
    types = token_types(spec, batch)
    device = device_tables(spec, mods, tables, items)
    if device is not None:  # the runs against the tables: one transfer
        _check_labels(guard, ids, batch.get("labels"), step)
        lay, (tabs, extra) = TokenLayout(ids, guard.grammar), device
        kw = dict(labels=batch.get("labels"), step=step, types=types)
        res, _ = verified(guard, lay, mods, tabs, None, None, extra, gate=len(extra), **kw)
        if res is not None:
            return BatchCheck(dict(batch), res.report)
    encoded = counted(spec, mods, tables, items, CALLER)
    # items= is per modality in the model's order, not the token order
    listed, parent = token_items(ids, guard.grammar, mods, encoded, items, types, listed=False)
    rep = None if media is None else Reprocessor(spec, geo, listed, parent, media, processor)
    kw = dict(labels=batch.get("labels"), step=step, sample_ids=sids, caller=CALLER, encoder=rep)
    res, gone = plan_items(guard, ids, listed, parent, **kw)
    report = res.report
    done = () if rep is None else tuple(rep.kept(report).values())
    dropped = set(report.dropped)
    if not (dropped or gone or done):
        return BatchCheck(dict(batch), report)
    # the dropped samples out, the re-processed items' rows and grid rows in place
    fixed = {(d.modality, d.index): (d.grid, d.rows) for d in done}
    spans = {k: e.spans for k, e in encoded.items() if any(n != 1 for n in e.spans)}
    out = drop_inputs(spec, batch, mods, guard, dropped, gone, text, spans, repaired=fixed)
    if res.labels is not None:
        out["labels"] = res.labels
    return BatchCheck({k: v for k, v in out.items() if v is not None}, report, done)


def _check_labels(guard: MediaGuard, ids: torch.Tensor, labels: Any, step: int | None) -> None:
    """The labels as :meth:`MediaGuard.last_stage` refuses them, before the device check."""
    try:
        check_masks(None, labels, *ids.shape, None)
        check_labels_dtype(labels, guard.config.ignore_index)
    except MediaInputError as err:
        where = guard.where(step, None)
        raise err.with_context(f"{CALLER} ({where}): ", where=where) from None


def _spec(family: str | FamilySpec) -> FamilySpec:
    if isinstance(family, FamilySpec):
        return family
    spec = next((s for s in FAMILIES if s.name == family), None)
    if spec is None:
        raise no_family(CALLER, f"the name {family!r}")
    return spec


def _ids(batch: Mapping[str, Any]) -> torch.Tensor:
    if not isinstance(batch, Mapping):
        raise MediaInputError(
            f"{CALLER} takes the processor's batch as a mapping of its keyword arguments, got "
            f"{type(batch).__name__}"
        )
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise MediaInputError(f"{CALLER} needs the batch's input_ids tensor [b, s]")
    if ids.dim() != 2 or ids.numel() == 0:
        raise MediaInputError(f"{CALLER}: input_ids must be [b, s], got {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise MediaInputError(
            f"{CALLER}: input_ids must hold integer token ids, got {ids.dtype} (pass the "
            "tokenizer's ids, e.g. ids.long())"
        )
    return ids


def _sample_ids(sample_ids, rows: int) -> tuple | None:
    if sample_ids is None:
        return None
    if isinstance(sample_ids, (str, bytes)) or not isinstance(sample_ids, Sequence):
        raise MediaInputError(
            f"{CALLER}: sample_ids= takes one id per sample (row of input_ids), got "
            f"{type(sample_ids).__name__}"
        )
    if len(sample_ids) != rows:
        raise MediaInputError(
            f"{CALLER}: {len(sample_ids)} sample_ids for {rows} samples (rows of input_ids)"
        )
    return tuple(sample_ids)


def _given(mods, tables, items: Sequence[MediaItem] | None) -> dict[str, int]:
    """Per modality its model-level items: its count table's rows (a ``split`` block: the
    caller's ``items``'), checked against ``items`` (their ``sample_id`` and ``source_hw``
    laid on the items: :func:`~.inputs_items.call_items`)."""
    per_mod: dict[str, list[MediaItem]] = {}
    for g, it in enumerate(items or ()):
        if not isinstance(it, MediaItem):
            raise MediaInputError(
                f"{CALLER}: items[{g}] is a {type(it).__name__}; pass MediaItem objects"
            )
        per_mod.setdefault(it.modality, []).append(it)
    got = {mod: len(its) for mod, its in per_mod.items()}
    want = {m.name: got.get(m.name, 0) if m.split else t.shape[0] for m, t in zip(mods, tables)}
    if items is None:
        return want
    if got != {k: v for k, v in want.items() if v}:
        raise MediaInputError(
            f"{CALLER}: items= gives {got} for this batch's {want} model-level items (one per "
            "image, video and audio clip, per modality in the model's order)"
        )
    if any(it.sample is not None for it in items):
        # the model places its items in order: an item tied elsewhere is put there by no one
        raise MediaInputError(
            f"{CALLER}: items= set MediaItem.sample, but the plain model places each item on "
            "the next run in token order, not by sample: leave sample unset (the check ties "
            "each item to the run the model gives it)"
        )
    return want


__all__ = ["BatchCheck", "check_batch"]
