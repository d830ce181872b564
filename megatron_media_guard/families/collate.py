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
token, its labels are ignored. The batch keeps its shape. Records go to the guard's log as in
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
from ..core.host import to_host
from ..core.interleave import token_order
from ..core.items import MediaItem
from ..core.outcome import GuardReport
from ..core.runs import TokenLayout
from ..errors import MediaInputError
from . import FAMILIES
from .spec import FamilySpec, present


@dataclass(frozen=True)
class BatchCheck:
    """``batch``: the inputs with every dropped sample's media out and its placeholders text
    (the same dict when nothing was dropped); ``report``: per sample what was found and done."""

    batch: dict[str, Any]
    report: GuardReport

    @property
    def dropped(self) -> tuple[int, ...]:
        return self.report.dropped


def check_batch(
    family: str | FamilySpec,
    batch: Mapping[str, Any],
    *,
    config: Any,
    tokenizer: Any = None,
    guard: MediaGuard | GuardConfig | None = None,
    step: int | None = None,
) -> BatchCheck:
    """Checks one collated batch of ``family`` (a name from the registry or a spec) against its
    token ids. config: the model's config (``AutoConfig``: token ids and sizes; no weights).
    guard: a guard to use, or the config of one (default: drop, no consensus)."""
    spec = _spec(family)
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise MediaInputError("check_batch needs the batch's input_ids tensor")
    holder = SimpleNamespace(config=config)
    if not isinstance(guard, MediaGuard):
        cfg = guard if guard is not None else GuardConfig(policy="drop")
        guard = MediaGuard(cfg, spec.grammar(holder, tokenizer), consensus=False)
    text = spec.text.resolve(holder, tokenizer)
    mods = present(spec, batch)
    items: list[MediaItem] = []
    owner: list[tuple[str, int]] = []  # per item: its modality and model-level index
    for m in mods:
        if m.counts is None:
            raise MediaInputError(f"{spec.name}: {m.name} has no counts: check it in the model")
        for k, runs in enumerate(m.counts(config, batch)):
            for n in runs:
                items.append(MediaItem(int(n), modality=m.name))
                owner.append((m.name, k))
    order = token_order(ids, guard.grammar, items, [k for _, k in owner])
    items = [items[i] for i in order]
    owner = [owner[i] for i in order]
    res = guard.last_stage(ids, items, labels=batch.get("labels"), step=step)
    report = res.report
    dropped = set(report.dropped)
    if not dropped:
        return BatchCheck(dict(batch), report)
    gone = set()
    if report.alignment is not None:
        gone = {owner[i] for r in report.alignment.samples if r.sample in dropped for i in r.items}
    return BatchCheck(_drop(spec, batch, mods, guard, dropped, gone, text, res.labels), report)


def _spec(family: str | FamilySpec) -> FamilySpec:
    if isinstance(family, FamilySpec):
        return family
    for s in FAMILIES:
        if s.name == family:
            return s
    raise MediaInputError(f"no family {family!r}; known: {[s.name for s in FAMILIES]}")


def _drop(spec, batch, mods, guard, dropped, gone, text, labels) -> dict[str, Any]:
    out = dict(batch)
    ids = batch["input_ids"]
    lay = TokenLayout(ids, guard.grammar)
    sel = torch.zeros(lay.num_samples, dtype=torch.bool)
    sel[sorted(dropped)] = True
    hit = lay.ph & sel.to(ids.device)[:, None]
    out["input_ids"] = ids.masked_fill(hit, text)
    for name in spec.follow_ids:
        if isinstance(batch.get(name), torch.Tensor):
            out[name] = batch[name].masked_fill(hit, 0)
    if labels is not None:
        out["labels"] = labels
    for m in mods:
        for name, grid in m.patches.items():
            g = batch.get(grid)
            if isinstance(batch.get(name), torch.Tensor) and isinstance(g, torch.Tensor):
                # patch rows per item: prod of its grid row (a small transfer, drops only)
                sizes = to_host(g.prod(-1), why="patch rows per item to drop").tolist()
                keep = [k for k in range(len(sizes)) if (m.name, k) not in gone]
                pieces = batch[name].split(sizes)
                out[name] = torch.cat([pieces[k] for k in keep]) if keep else None
        for name in m.rows:
            t = batch.get(name)
            if isinstance(t, torch.Tensor):
                keep = [k for k in range(t.shape[0]) if (m.name, k) not in gone]
                out[name] = t[keep] if keep else None
    return {k: v for k, v in out.items() if v is not None}


__all__ = ["BatchCheck", "check_batch"]
