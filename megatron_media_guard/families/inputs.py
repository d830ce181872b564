"""A family's check on its inputs alone, with no tower: the items sized by the spec's
``counts`` (the processor's own arithmetic on grids, masks, lengths), planned through the
guard's one fault path, and the plan applied by rewriting the inputs. Shared by the collate
check (:func:`~.collate.check_batch`) and the ``apply="inputs"`` pre-hook
(``adapters/vlm_inputs.py``), whose model encodes and merges its media itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.guard import MediaGuard
from ..core.host import to_host
from ..core.interleave import token_order
from ..core.items import MediaItem
from ..core.outcome import GuardReport, MergeResult
from ..core.runs import TokenLayout
from ..errors import MediaInputError
from .spec import Encoded, FamilySpec, ModalitySpec


def counted(spec: FamilySpec, mods: Sequence[ModalitySpec], config: Any, inputs) -> dict:
    """Per modality, what its tower would produce, sized from ``inputs`` alone: an
    :class:`Encoded` of zero-width ``[n, 0]`` features, one per run, ``parent`` the
    model-level item (a video of several runs shares one)."""
    out: dict[str, Encoded] = {}
    for m in mods:
        if m.counts is None:
            raise MediaInputError(f"{spec.name}: {m.name} has no counts: check it in the model")
        sizes, parent = [], []
        for k, runs in enumerate(m.counts(config, inputs)):
            sizes += [int(n) for n in runs]
            parent += [k] * len(runs)
        feats = tuple(torch.empty(n, 0) for n in sizes)
        out[m.name] = Encoded(feats, parent=tuple(parent))
    return out


def plan_items(
    guard: MediaGuard,
    ids: torch.Tensor,
    items: Sequence[MediaItem],
    parent: Sequence[int],
    order: Sequence[int] | None = None,
    **kw: Any,
) -> tuple[MergeResult, list[tuple[str, int]]]:
    """The guard's plan for ``items`` (consumption order; ``order``: their token order, else
    :func:`token_order`) on ``ids``: :meth:`MediaGuard.last_stage` with every planned repair
    attempted (nothing else merges). ``kw``: ``labels``, ``loss_mask``, ``step``,
    ``microbatch``. Returns the result and, per item in token order, ``(modality, parent)``."""
    if order is None:
        order = token_order(ids, guard.grammar, items, parent)
    items = [items[i] for i in order]
    owner = [(items[k].modality, parent[i]) for k, i in enumerate(order)]
    return guard.last_stage(ids, items, repairs="attempt", **kw), owner


def gone_items(report: GuardReport, owner: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
    """The model-level items ``(modality, index)`` of the samples ``report`` dropped."""
    dropped, rep = set(report.dropped), report.alignment
    if not dropped or rep is None:
        return set()
    return {owner[i] for r in rep.samples if r.sample in dropped for i in r.items}


def drop_inputs(
    spec: FamilySpec,
    inputs: Mapping[str, Any],
    mods: Sequence[ModalitySpec],
    guard: MediaGuard,
    dropped: set[int],
    gone: set[tuple[str, int]],
    text: int,
) -> dict[str, Any]:
    """``inputs`` with the dropped samples' placeholders as ``text`` (and 0 in the spec's
    ``follow_ids``), their items' rows out of the modalities' ``rows`` and ``patches``
    inputs (an input left with no row becomes None). Labels are the caller's to mask."""
    out = dict(inputs)
    ids = inputs["input_ids"]
    lay = TokenLayout(ids, guard.grammar)
    sel = torch.zeros(lay.num_samples, dtype=torch.bool)
    sel[sorted(dropped)] = True
    hit = lay.ph & sel.to(ids.device)[:, None]
    out["input_ids"] = ids.masked_fill(hit, text)
    for name in spec.follow_ids:
        if isinstance(inputs.get(name), torch.Tensor):
            out[name] = inputs[name].masked_fill(hit, 0)
    for m in mods:
        for name, grid in m.patches.items():
            g = inputs.get(grid)
            if isinstance(inputs.get(name), torch.Tensor) and isinstance(g, torch.Tensor):
                # patch rows per item: prod of its grid row (a small transfer, drops only)
                sizes = to_host(g.prod(-1), why="patch rows per item to drop").tolist()
                keep = [k for k in range(len(sizes)) if (m.name, k) not in gone]
                pieces = inputs[name].split(sizes)
                out[name] = torch.cat([pieces[k] for k in keep]) if keep else None
        for name in m.rows:
            t = inputs.get(name)
            if isinstance(t, torch.Tensor):
                keep = [k for k in range(t.shape[0]) if (m.name, k) not in gone]
                out[name] = t[keep] if keep else None
    return out


__all__ = ["counted", "drop_inputs", "gone_items", "plan_items"]
