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
from .spec import COUNT_COLUMNS, Encoded, FamilySpec, ModalitySpec


def counted(
    spec: FamilySpec,
    mods: Sequence[ModalitySpec],
    config: Any,
    inputs,
    items: Sequence[MediaItem] | None = None,
    caller: str = "counts",
) -> dict[str, Encoded]:
    """Per modality, what its tower would produce, sized from ``inputs`` alone: an
    :class:`Encoded` of zero-width ``[n, 0]`` features, one per run, ``parent`` the
    model-level item (a video of several runs shares one), with its frames, frame size and
    grid where the inputs say them. Every modality's :func:`~.spec.count_table` comes to the
    host in one transfer. ``items``: one per model-level item, per modality in the model's
    order; a ``split="items"`` modality's items are cut by their ``num_features`` (``caller``
    names the function that was called, in the errors)."""
    tables = []
    for m in mods:
        if m.counts is None:
            raise MediaInputError(
                f"{caller}: {spec.name}'s {m.name} inputs do not give its feature counts: "
                "check it in the model (install_vlm)"
            )
        try:
            got = m.counts(config, inputs)
        except KeyError as err:  # an input the counts read is not in the batch
            raise MediaInputError(
                f"{caller}: {spec.name}'s {m.name} inputs lack {err.args[0]!r} (the family's "
                f"processor returns it beside {m.inputs[0]!r}: pass it in the batch)"
            ) from None
        tables.append(_table(got, spec, m, caller))
    if not tables:
        return {}
    # the call's one transfer for its counts: every modality's table at once
    host = to_host(torch.cat(tables), why="per-item counts from the inputs").tolist()
    out: dict[str, Encoded] = {}
    for m, t in zip(mods, tables):
        rows, host = host[: t.shape[0]], host[t.shape[0] :]
        if m.split == "items":
            rows = _cut(spec, m, rows, [it for it in items or () if it.modality == m.name], caller)
        out[m.name] = _encoded(rows)
    return out


def _table(t: Any, spec: FamilySpec, m: ModalitySpec, caller: str) -> torch.Tensor:
    """``t`` as a full-width count table. Counts written as host lists of run lengths per
    item (an older spec's, already read) are taken as their table."""
    if not isinstance(t, torch.Tensor):
        if any(len(set(r)) > 1 for r in t):
            raise MediaInputError(f"{spec.name}: {m.name} counts give runs of unequal lengths")
        t = torch.tensor([[len(r), r[0] if r else 0] for r in t], dtype=torch.long)
    if t.dim() != 2 or not 2 <= t.shape[1] <= len(COUNT_COLUMNS):
        raise MediaInputError(f"{caller}: {spec.name}'s {m.name} counts gave {tuple(t.shape)}")
    pad = len(COUNT_COLUMNS) - t.shape[1]
    return torch.nn.functional.pad(t.long(), (0, pad)) if pad else t.long()


def _cut(spec, m: ModalitySpec, rows: list, given: Sequence[MediaItem], caller: str) -> list:
    """A split modality's one block ``(units, tokens per unit)`` as the given items' rows
    (one run each, ``spans`` its units)."""
    units, per, _, h, w = rows[0][:5] if rows else (0, 0, 0, 0, 0)
    total = units * per
    what = f"{units} rows of {m.rows[0] if m.rows else m.inputs[0]!r}"
    if not given:
        raise MediaInputError(
            f"{caller}: {spec.name}: the inputs hold {what} ({per} features each, {total} in "
            f"all) but not which {m.name} each row belongs to (the processor drops that): pass "
            f"items= (one MediaItem per {m.name} in the model's order, num_features = {per} x "
            "its rows)"
        )
    sizes = [it.num_features for it in given]
    if sum(sizes) != total or any(n % per for n in sizes):
        raise MediaInputError(
            f"{caller}: items= declares {m.name} features {sizes} ({sum(sizes)} in all); the "
            f"inputs hold {what} of {per} features ({total}): each item is whole rows"
        )
    return [[1, n, 0, h, w, 0, 0, 0, n // per] for n in sizes]  # each unit at h x w


def _encoded(rows: list) -> Encoded:
    feats, parent, frames, hw, grid, spans = [], [], [], [], [], []
    for k, (runs, n, f, h, w, gt, gh, gw, *span) in enumerate(rows):
        for _ in range(runs):
            feats.append(torch.empty(n, 0))
            parent.append(k)
            frames.append(f or None)
            hw.append((h, w) if h and w else None)
            grid.append((gt, gh, gw) if gt and gh and gw else None)
        spans.append(span[0] if span else 1)
    return Encoded(
        tuple(feats),
        num_frames=tuple(frames),
        frame_hw=tuple(hw),
        parent=tuple(parent),
        grid=tuple(grid),
        spans=tuple(spans),
    )


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
    spans: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """``inputs`` with the dropped samples' placeholders as ``text`` (and 0 in the spec's
    ``follow_ids``), their items' rows out of the modalities' ``rows`` and ``patches``
    inputs (an input left with no row becomes None). ``spans``: per modality, the rows of
    its ``rows`` inputs each model-level item holds (default one; :attr:`Encoded.spans`).
    Labels are the caller's to mask."""
    out = dict(inputs)
    ids = inputs["input_ids"]
    lay = TokenLayout(ids, guard.grammar)
    sel = torch.zeros(lay.num_samples, dtype=torch.bool)
    sel[sorted(dropped)] = True
    of_dropped = sel.to(ids.device)[:, None]
    hit = lay.ph & of_dropped
    marks = (*guard.grammar.start_ids, *guard.grammar.end_ids)
    if spec.drop_markers and marks:  # the dropped samples' region markers become text too
        hit = hit | torch.isin(ids, torch.tensor(marks, device=ids.device)) & of_dropped
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
        for name in m.groups:
            t = inputs.get(name)
            if isinstance(t, torch.Tensor):
                # items per sample (a small transfer, drops only): an entry whose items all
                # left goes with them
                per = to_host(t, why="items per sample to drop a sample's entry").tolist()
                first = [sum(per[:e]) for e in range(len(per))]
                keep = [e for e, n in enumerate(per) if not n or (m.name, first[e]) not in gone]
                out[name] = t[keep] if keep else None
        span = (spans or {}).get(m.name)
        for name in m.rows:
            t = inputs.get(name)
            if isinstance(t, torch.Tensor) and span:  # several rows per item (InternVL's tiles)
                pieces = t.split(list(span))
                keep = [k for k in range(len(span)) if (m.name, k) not in gone]
                out[name] = torch.cat([pieces[k] for k in keep]) if keep else None
            elif isinstance(t, torch.Tensor):
                keep = [k for k in range(t.shape[0]) if (m.name, k) not in gone]
                out[name] = t[keep] if keep else None
    return out


__all__ = ["counted", "drop_inputs", "gone_items", "plan_items"]
