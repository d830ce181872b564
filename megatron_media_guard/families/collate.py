"""The family check before the trainer: in a collate function or a rollout worker, on the
processor's outputs and the rollout's token ids, with no model and no tower (CPU, free).

::

    from megatron_media_guard.families.collate import check_batch

    checked = check_batch("nemotron_omni", batch, config=model_config, tokenizer=tokenizer)
    batch = checked.batch            # every kept sample consistent; dropped ones text-only
    checked.report.actions           # per sample: keep / drop

Each item's feature count comes from the spec's ``counts`` (the processor's own arithmetic on
the inputs: grids, stacked tubelets, audio masks). A sample whose runs disagree is dropped
(``GuardConfig(policy="drop")``, the default here) or raises: its media leave the inputs (the
spec's ``rows`` / ``patches`` say where they sit), its placeholders become the family's text
token, its labels are ignored. The batch keeps its shape. A planned repair falls back
(``GuardConfig.fallback``): nothing here re-encodes. The steps are :mod:`.inputs`'s, shared
with the ``apply="inputs"`` pre-hook. Records go to the guard's log as in
training (``GuardConfig(log_dir=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..config import GuardConfig
from ..core.guard import MediaGuard
from ..core.items import MediaItem
from ..core.outcome import GuardReport
from ..errors import MediaInputError
from . import FAMILIES
from .inputs import counted, drop_inputs, gone_items, plan_items
from .reprocess import Reprocessed, Reprocessor, replace_rows
from .spec import FamilySpec, present


@dataclass(frozen=True)
class BatchCheck:
    """``batch``: the inputs with every dropped sample's media out and its placeholders text
    (the same dict when nothing was dropped); ``report``: per sample what was found and done."""

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
    media: Any = None,
    processor: Any = None,
) -> BatchCheck:
    """Checks one collated batch of ``family`` (a name from the registry or a spec) against its
    token ids. config: the model's config (``AutoConfig``: token ids and sizes; no weights).
    guard: a guard to use, or the config of one (default: drop, no consensus). media: one
    original per item (``policy="repair"``: mismatched items re-processed from them with
    ``processor``, :mod:`.reprocess`; ``BatchCheck.reprocessed`` / ``matched`` name them)."""
    spec = _spec(family)
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise MediaInputError("check_batch needs the batch's input_ids tensor")
    holder = SimpleNamespace(config=config)
    geo = spec.geometry(holder) if media is not None and spec.geometry else None
    if not isinstance(guard, MediaGuard):
        cfg = guard if guard is not None else GuardConfig(policy="drop")
        guard = MediaGuard(cfg, spec.grammar(holder, tokenizer), consensus=False, geometry=geo)
    text = spec.text.resolve(holder, tokenizer)
    mods = present(spec, batch)
    encoded = counted(spec, mods, config, batch)
    items = [MediaItem(f.shape[0], modality=m.name) for m in mods for f in encoded[m.name].features]
    parent = [k for m in mods for k in encoded[m.name].parent]
    rep = None if media is None else Reprocessor(spec, geo, items, parent, media, processor)
    kw = dict(labels=batch.get("labels"), step=step, encoder=rep)
    res, owner = plan_items(guard, ids, items, parent, **kw)
    report = res.report
    done = () if rep is None else rep.kept(report)
    batch = replace_rows(spec, batch, mods, done) if done else batch
    dropped = set(report.dropped)
    if not dropped:
        return BatchCheck(dict(batch), report, done)
    out = drop_inputs(spec, batch, mods, guard, dropped, gone_items(report, owner), text)
    if res.labels is not None:
        out["labels"] = res.labels
    return BatchCheck({k: v for k, v in out.items() if v is not None}, report, done)


def _spec(family: str | FamilySpec) -> FamilySpec:
    if isinstance(family, FamilySpec):
        return family
    for s in FAMILIES:
        if s.name == family:
            return s
    raise MediaInputError(f"no family {family!r}; known: {[s.name for s in FAMILIES]}")


__all__ = ["BatchCheck", "check_batch"]
