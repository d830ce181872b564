"""A family's check on its inputs alone, with no tower: items sized by the spec's ``counts``,
planned through the guard's fault path, the plan applied by rewriting the inputs. Shared by
:func:`~.collate.check_batch` and the ``apply="inputs"`` pre-hook (``adapters/vlm_inputs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..core.apply import token_keep
from ..core.guard import MediaGuard
from ..core.host import to_host
from ..core.interleave import misplaced, order_runs
from ..core.items import MediaItem
from ..core.outcome import GuardReport, MergeResult
from ..core.runs import TokenLayout, run_table, runs_of
from ..core.verify import Expected, verify
from ..errors import MediaInputError
from .inputs_items import call_items, orphans
from .spec import COUNT_COLUMNS, Encoded, FamilySpec, ModalitySpec


def count_tables(
    spec: FamilySpec, mods: Sequence[ModalitySpec], config: Any, inputs, caller: str = "counts"
) -> list[torch.Tensor]:
    """Per modality of ``mods``, its full-width :func:`~.spec.count_table` from ``inputs``, on
    their device (no host read)."""
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
        if got.dim() != 2 or not 2 <= got.shape[1] <= len(COUNT_COLUMNS):
            shape = tuple(got.shape)
            raise MediaInputError(f"{caller}: {spec.name}'s {m.name} counts gave {shape}")
        tables.append(F.pad(got.long(), (0, len(COUNT_COLUMNS) - got.shape[1])))
    return tables


def counted(
    spec: FamilySpec,
    mods: Sequence[ModalitySpec],
    tables: Sequence[torch.Tensor],
    items: Sequence[MediaItem] | None = None,
    caller: str = "counts",
) -> dict[str, Encoded]:
    """Per modality, what its tower would produce, sized from its count ``tables`` (to the
    host in one transfer): an :class:`Encoded` of zero-width ``[n, 0]`` features, one per run,
    with ``parent``, frames, frame size and grid where the inputs say them. ``items``: one per
    model-level item (a ``split`` modality's are cut by their ``num_features``)."""
    if not tables:
        return {}
    # the fault path's (or an unverifiable spec's) read of every modality's counts at once
    host = to_host(torch.cat(list(tables)), why="per-item counts from the inputs").tolist()
    out: dict[str, Encoded] = {}
    for m, t in zip(mods, tables):
        rows, host = host[: t.shape[0]], host[t.shape[0] :]
        if m.split == "items":
            rows = _cut(spec, m, rows, [it for it in items or () if it.modality == m.name], caller)
        out[m.name] = _encoded(rows)
    return out


def token_types(spec: FamilySpec, inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """The spec's per-token types (:attr:`FamilySpec.token_types`) where ``inputs`` hold them."""
    types = inputs.get(spec.token_types) if spec.token_types else None
    return types if isinstance(types, torch.Tensor) else None


def on_device(
    spec: FamilySpec,
    mods: Sequence[ModalitySpec] | None = None,
    device: torch.device | None = None,
) -> bool:
    """Whether a call holding ``mods`` (default: every modality of ``spec``) on ``device`` is
    verified against its count tables in one transfer (:func:`verify_tables`): none ``split``
    and, off CPU, each modality's runs told apart by its own placeholder, the spec's per-token
    types, or being the only one present on a shared placeholder (:func:`_by_lengths` reads
    every run at a size only the device knows)."""
    mods = spec.modalities if mods is None else mods
    if device is not None and device.type != "cpu":
        typed = bool(spec.token_types) and all(m.type_id is not None for m in spec.modalities)
        tokens = [m.shares or m.name for m in mods]
        if not typed and len(set(tokens)) < len(tokens):
            return False
    return all(m.split is None and m.counts is not None for m in mods)


def device_tables(
    spec: FamilySpec,
    mods: Sequence[ModalitySpec],
    tables: Sequence[torch.Tensor],
    items: Sequence[MediaItem] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """``(tables, extra)`` for :func:`verify_tables`: the ``tables`` where :func:`on_device`;
    where a ``split`` block (InternVL's tiles) is the only host step, each block as the given
    items' rows and a flag, nonzero where they do not cut it into whole units. Else None."""
    if on_device(spec, mods, tables[0].device if tables else None):
        return list(tables), []
    if any(m.shares is not None or m.counts is None for m in spec.modalities):
        return None
    out, bad = [], []
    for m, t in zip(mods, tables):
        if m.split is None:
            out.append(t)
            continue
        sizes = [it.num_features for it in items or () if getattr(it, "modality", 0) == m.name]
        if not sizes or t.shape[0] != 1:
            return None
        n = torch.tensor(sizes, dtype=torch.int64).to(t.device, non_blocking=True)
        units, per = t[0, 0], t[0, 1]
        bad += [units * per != n.sum(), torch.any(n % per.clamp(min=1) != 0)]
        out.append(F.pad(torch.stack([torch.ones_like(n), n], 1), (0, t.shape[1] - 2)))
    return out, [torch.stack(bad).any().to(torch.int64)]  # (a split block: ``bad`` is set)


def verify_tables(
    lay: TokenLayout,
    mods: Sequence[ModalitySpec],
    tables: Sequence[torch.Tensor],
    samples: Mapping[str, torch.Tensor] | None = None,
    declared: Mapping[str, torch.Tensor] | None = None,
    extra: Sequence[torch.Tensor] = (),
    types: torch.Tensor | None = None,
):
    """The call's runs against the count ``tables`` on the device: ``(verdict, extra values)``
    in one transfer. samples / declared: per modality, per model-level item its sample and
    the features its caller declares. types: the spec's per-token types (``type_id``); two
    modalities on one placeholder with none to tell their runs apart are checked by their
    lengths (:func:`_by_lengths`)."""
    g = lay.grammar
    shared = {g.modality_code(m.name) for m in mods if m.shares is not None}
    on_shared = [m for m in mods if g.modality_code(m.name) in shared]
    untyped = types is None or any(m.type_id is None for m in on_shared)
    if len(on_shared) > 1 and untyped and samples is None and declared is None:
        return _by_lengths(lay, mods, tables, extra)
    expected = []
    for m, t in zip(mods, tables):
        code = g.modality_code(m.name)
        typed = code in shared and types is not None and m.type_id is not None
        # a shared placeholder's runs told apart by their type, where the types are given
        where = types.to(torch.int64) == m.type_id if typed else None
        smp, given = (samples or {}).get(m.name), (declared or {}).get(m.name)
        expected.append(Expected(code, t[:, 0], t[:, 1], smp, given, where=where))
    return verify(lay, expected, extra=extra)


def _by_lengths(lay: TokenLayout, mods, tables, extra):
    """:func:`verify_tables` where two modalities share a placeholder with no per-token type
    (Nemotron Omni's images beside its video): the tables and every run come with the verdict,
    each run checked on the host against the item the length interleaving gives it
    (:func:`~..core.interleave.order_runs`, as the embed path does). Off CPU (where
    :func:`on_device` sends no such call here) the read is sized at one run per model-level
    item: a video of several runs leaves runs unchecked, bad, and takes the fault path."""
    size = None if lay.device.type == "cpu" else sum(t.shape[0] for t in tables)
    found = run_table(lay, *lay.run_bounds(), size)  # [runs, 6]
    counts = torch.cat(list(tables))
    verdict, got = verify(lay, [], extra=[found.reshape(-1), counts.reshape(-1), *extra])
    cut, width = found.numel() + counts.numel(), counts.shape[1]
    host, tail = got[found.numel() : cut], got[cut:]
    rows = [host[k : k + width] for k in range(0, len(host), width)]
    encoded = {}
    for m, t in zip(mods, tables):
        encoded[m.name], rows = _encoded(rows[: t.shape[0]]), rows[t.shape[0] :]
    if verdict.runs > found.shape[0]:
        return replace(verdict, bad_runs=verdict.runs - found.shape[0]), tail
    runs = runs_of([got[k : k + 6] for k in range(0, 6 * verdict.runs, 6)], lay.grammar)
    items, _, _, parent = call_items(mods, encoded, None)
    order = order_runs(runs, lay.grammar, items, parent)
    bad = misplaced(runs, items, order, lay.grammar)
    # the tables join the fingerprint (Verdict) here, on the host where they were read
    return replace(verdict, bad_runs=bad, fingerprint=verdict.fingerprint ^ hash(tuple(host))), tail


def verified(guard: MediaGuard, lay: TokenLayout, *args, gate: int = 0, types=None, **kw):
    """The aligned call's check: :func:`verify_tables` on ``lay`` and ``args`` (its one
    transfer) and, where the runs agree with the tables and none of the first ``gate`` extra
    values is set, every sample kept (:meth:`MediaGuard.keep_all`, ``kw`` its arguments).
    Returns ``(the result, None on the fault path; the extra values)``."""
    verdict, got = verify_tables(lay, *args, types=types)
    if verdict.bad_runs or verdict.findings or any(got[:gate]):
        return None, got
    return guard.keep_all(lay, verdict, **kw), got


def _cut(spec, m: ModalitySpec, rows: list, given: Sequence[MediaItem], caller: str) -> list:
    """A split modality's block ``(units, tokens per unit)`` as the given items' rows."""
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
    guard: MediaGuard, ids: torch.Tensor, items: Sequence[MediaItem], parent: Sequence[int], **kw
) -> tuple[MergeResult, set[tuple[str, int]]]:
    """The guard's plan for ``items`` in token order (:meth:`MediaGuard.last_stage`, every
    planned repair attempted, ``kw`` its arguments), and the model-level items ``(modality,
    index)`` that leave the inputs: those of the samples it dropped and those no run took."""
    res = guard.last_stage(ids, items, repairs="attempt", **kw)
    owner = [(it.modality, p) for it, p in zip(items, parent)]
    return res, gone_items(res.report, owner) | orphans(res.report, owner)


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
    cu: torch.Tensor | None = None,
    repaired: Mapping[tuple[str, int], tuple[Sequence[int], torch.Tensor | None]] | None = None,
    order: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The one application of a plan to a call's inputs (``check_batch`` and both modes of
    the family engine): ``inputs`` with the dropped samples' placeholders (and, with
    ``drop_markers``, their markers) as ``text`` and the ``gone`` items' rows out
    (:func:`take_items`). cu: the packed row's sample offsets. Labels are the caller's."""
    ids = inputs["input_ids"]
    lay = TokenLayout(ids, guard.grammar, cu)
    keep = torch.ones(lay.num_samples, dtype=torch.bool)
    keep[sorted(dropped)] = False
    marks = (*guard.grammar.start_ids, *guard.grammar.end_ids) if spec.drop_markers else ()
    out = {**inputs, **placeholders_as_text(spec, inputs, lay, keep.to(ids.device), text, marks)}
    out.update(take_items(inputs, mods, gone, order=order, spans=spans, repaired=repaired))
    for m in mods:
        for name in m.groups:
            t = inputs.get(name)
            if isinstance(t, torch.Tensor):
                # items per sample (a small transfer, drops only): an entry whose items all
                # left goes with them
                per = to_host(t, why="items per sample to drop a sample's entry").tolist()
                first = [sum(per[:e]) for e in range(len(per))]
                left = [e for e, c in enumerate(per) if not c or (m.name, first[e]) not in gone]
                out[name] = t[left] if left else None
    return out


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
    spec: FamilySpec,
    inputs: Mapping[str, Any],
    lay: TokenLayout,
    keep: torch.Tensor,
    text: int,
    markers: Sequence[int] = (),
) -> dict[str, Any]:
    """``input_ids`` with the placeholders of every sample ``keep`` (``[num_samples]`` bool)
    does not keep, and of a packed row's padding, as ``text``, the spec's ``follow_ids`` 0
    there. ``markers``: region markers that leave with such a sample too."""
    ids = inputs["input_ids"]
    gone = ~token_keep(lay, keep)
    hit = lay.ph & gone
    if markers:
        hit = hit | torch.isin(ids, torch.tensor(list(markers), device=ids.device)) & gone
    out = {"input_ids": ids.masked_fill(hit, text)}
    for name in spec.follow_ids:
        if isinstance(inputs.get(name), torch.Tensor):
            out[name] = inputs[name].masked_fill(hit, 0)
    return out


def _kept(mod: str, n: int, name: str, gone, order: Sequence[int] | None) -> list[int]:
    """The items of ``mod`` among ``n`` that are not ``gone``, in ``order``'s samples (stable)
    where given: then ``name`` must hold one row per item."""
    ks = [k for k in range(n) if (mod, k) not in gone]
    if order is not None:
        if n != len(order):
            raise MediaInputError(
                f"{name} holds {n} rows for {len(order)} {mod} items: its rows cannot be fed in "
                "the sample order set_items gives (one row per item)"
            )
        ks.sort(key=lambda k: order[k])
    return ks


def take_items(
    inputs: Mapping[str, Any],
    mods: Sequence[ModalitySpec],
    gone: set[tuple[str, int]] = frozenset(),
    *,
    order: Mapping[str, Sequence[int]] | None = None,
    repaired: Mapping[tuple[str, int], tuple[Sequence[int], torch.Tensor | None]] | None = None,
    spans: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The modalities' ``rows`` and ``patches`` inputs without the ``gone`` items
    ``(modality, k)`` (a ``rows`` input by its own length: a derived spec's need not be one per
    item), ``order``: per modality each item's sample, the kept ones fed in sample order; a
    ``repaired`` item with its new grid row and patch rows. An input left with no item is
    None, one unchanged is not returned. spans: per modality, the rows of its ``rows`` inputs
    each item holds (InternVL's tiles)."""
    out: dict[str, Any] = {}
    fixed = repaired or {}
    for m in mods:
        smp = (order or {}).get(m.name)
        mine = {k: v for (name, k), v in fixed.items() if name == m.name}
        for name, grid in m.patches.items():
            x, g = inputs.get(name), inputs.get(grid)
            if not isinstance(x, torch.Tensor) or not isinstance(g, torch.Tensor):
                continue
            ks = _kept(m.name, g.shape[0], name, gone, smp)
            if ks == list(range(g.shape[0])) and not mine:
                continue  # every item kept, in order: the input as it was
            # patch rows per item: prod of its grid row (a small transfer, drops only)
            n = to_host(g.prod(-1), why="patch rows per item to drop").tolist()
            pieces = x.split(n)
            new = {k: rows for k, (_, rows) in mine.items() if rows is not None}
            parts = [new[k].to(x.device) if k in new else pieces[k] for k in ks]
            out[name] = torch.cat(parts).to(x.dtype) if parts else None
        grids = set(m.patches.values())
        span = (spans or {}).get(m.name)
        for name in m.rows:
            t = inputs.get(name)
            if not isinstance(t, (torch.Tensor, list, tuple)):
                continue
            ks = _kept(m.name, len(span) if span else len(t), name, gone, smp)
            if span and isinstance(t, torch.Tensor):  # several rows per item: cut by item
                if ks != list(range(len(span))):
                    pieces = t.split(list(span))
                    out[name] = torch.cat([pieces[k] for k in ks]) if ks else None
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
