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

from ..core.apply import token_keep
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
    ids = inputs["input_ids"]
    lay = TokenLayout(ids, guard.grammar)
    keep = torch.ones(lay.num_samples, dtype=torch.bool)
    keep[sorted(dropped)] = False
    out = {**inputs, **placeholders_as_text(spec, inputs, lay, keep.to(ids.device), text)}
    kept = {m.name: [k for k in range(n_items(m, inputs)) if (m.name, k) not in gone] for m in mods}
    return {**out, **take_items(inputs, mods, kept)}


def generated_as_text(
    report: GuardReport, ids: torch.Tensor, text: int, generated: str
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``ids`` with the placeholders the policy generated in kept samples as ``text``
    (``GuardConfig.generated="text"``: the model's merge must not count them), and their
    ``(rows, cols)`` (None when there are none)."""
    gen = [(s, p) for s, p in report.generated if report.actions[s] != "drop"]
    if not gen or generated != "text":
        return ids, None
    rows = torch.tensor([s for s, pos in gen for _ in pos], device=ids.device)
    cols = torch.tensor([c for _, pos in gen for c in pos], device=ids.device)
    return ids.index_put((rows, cols), torch.tensor(text, device=ids.device)), (rows, cols)


def placeholders_as_text(
    spec: FamilySpec, inputs: Mapping[str, Any], lay: TokenLayout, keep: torch.Tensor, text: int
) -> dict[str, Any]:
    """``input_ids`` with the placeholders of every sample ``keep`` (``[num_samples]`` bool on
    the device) does not keep as ``text`` (and those in a packed row's padding, which no item
    feeds), and the spec's ``follow_ids`` 0 there."""
    hit = lay.ph & ~token_keep(lay, keep)
    out = {"input_ids": inputs["input_ids"].masked_fill(hit, text)}
    for name in spec.follow_ids:
        if isinstance(inputs.get(name), torch.Tensor):
            out[name] = inputs[name].masked_fill(hit, 0)
    return out


def n_items(m: ModalitySpec, inputs: Mapping[str, Any]) -> int:
    """The model-level items of ``m`` in ``inputs``: the rows of its first row input given."""
    for name in (*m.rows, *m.patches.values()):
        t = inputs.get(name)
        if isinstance(t, (torch.Tensor, list, tuple)):
            return len(t)
    return 0


def take_items(
    inputs: Mapping[str, Any],
    mods: Sequence[ModalitySpec],
    keep: Mapping[str, Sequence[int]],
    *,
    sizes: Mapping[str, Sequence[int]] | None = None,
    repaired: Mapping[tuple[str, int], tuple[Sequence[int], torch.Tensor | None]] | None = None,
) -> dict[str, Any]:
    """The modalities' ``rows`` and ``patches`` inputs holding the items ``keep`` names (per
    modality, its model-level items in the order the model is to take them), a repaired item
    ``(modality, k)`` with its new grid row ``(t, h, w)`` and patch rows; an input left with
    no item is None, one left as it was is not returned. sizes: per modality, the patch rows
    of each item where the caller has them (else read from the grid: one transfer)."""
    out: dict[str, Any] = {}
    fixed = repaired or {}
    for m in mods:
        ks = list(keep.get(m.name, ()))
        mine = {k: v for (name, k), v in fixed.items() if name == m.name}
        for name, grid in m.patches.items():
            x, g = inputs.get(name), inputs.get(grid)
            if not isinstance(x, torch.Tensor) or not isinstance(g, torch.Tensor):
                continue
            if ks == list(range(g.shape[0])) and not mine:
                continue  # every item kept, in order: the input as it was
            if sizes is not None and m.name in sizes:
                n = list(sizes[m.name])
            else:  # patch rows per item: prod of its grid row (a small transfer, drops only)
                n = to_host(g.prod(-1), why="patch rows per item to drop").tolist()
            pieces, parts = x.split(n), []
            for k in ks:
                new = mine[k][1] if k in mine else None
                parts.append(pieces[k] if new is None else new)
            out[name] = torch.cat(parts).to(x.dtype) if parts else None
        grids = set(m.patches.values())
        for name in m.rows:
            t = inputs.get(name)
            if not isinstance(t, (torch.Tensor, list, tuple)):
                continue
            fix = [(j, mine[k][0]) for j, k in enumerate(ks) if k in mine] if name in grids else []
            if ks == list(range(len(t))) and not fix:
                continue
            if not ks:
                out[name] = None
            elif isinstance(t, torch.Tensor):
                idx = torch.tensor(ks, dtype=torch.long).to(t.device, non_blocking=True)
                new = t.index_select(0, idx)
                for j, thw in fix:
                    new[j] = torch.tensor(list(thw), dtype=t.dtype).to(t.device, non_blocking=True)
                out[name] = new
            else:
                out[name] = type(t)(t[k] for k in ks)
    return out


__all__ = [
    "counted",
    "drop_inputs",
    "generated_as_text",
    "gone_items",
    "n_items",
    "placeholders_as_text",
    "plan_items",
    "take_items",
]
