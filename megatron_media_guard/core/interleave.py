"""Items in token order when a call holds several modalities, given in the model's
consumption order. On the aligned path no run is read: each modality's items are checked
against its runs on the device (:func:`verify_in_token_order`); only a token two modalities
share with no per-token type to tell them apart (Nemotron Omni's ``<image>``) has its first
runs read with the verdict, the lengths deciding which stream feeds each run. The fault path
reads every run (:func:`token_order`, one transfer)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..errors import MediaInputError
from .alignment import by_key
from .grammar import Grammar
from .host import to_host
from .items import Batch, MediaItem, normalize
from .parsed import Run
from .runs import TokenLayout, run_table, runs_of
from .verify import Expected, Verdict, verify


@dataclass(frozen=True)
class RunOrder:
    """Items given to :meth:`MediaGuard.merge` in the model's consumption order.

    order: ``(runs in token order, items)`` -> the items' permutation into token order (items
        beyond the runs last).
    keys: ``[b, s]`` per-token values read at each run's first token (``Run.key``), e.g. the
        family's ``mm_token_type_ids``; types: per modality sharing a token, its value there.
    counts: ``[n_items]`` int64 on the device, each item's feature count (the items'
        ``num_features`` are placeholders); runs: ``[n_items]`` the runs each item owns (an
        equal share each), or ``[n_items, w]`` each run's length, zero past the item's runs
        (Qwen3-Omni's audio in video), or None (one each); samples: ``[n_items]`` each item's
        sample (-1: none) or None; all read with the verdict. resize: those host values ->
        ``(items, features)`` cut accordingly (views). probe: what the NaN/Inf check reads of
        the items not yet cut.
    checks: the caller's refusals, read with the verdict: a 0-d device int and what raises
        when it is nonzero."""

    order: Callable[[Sequence[Run], Sequence[MediaItem]], list[int]]
    keys: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    runs: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    resize: (
        Callable[[list[int], list[int] | None], tuple[Sequence[MediaItem], Sequence[torch.Tensor]]]
        | None
    ) = None
    probe: torch.Tensor | None = None
    checks: tuple[tuple[torch.Tensor, Callable[[], None]], ...] = ()
    types: Mapping[str, int] = field(default_factory=dict)


def _table(lay: TokenLayout, keys, size: int | None) -> torch.Tensor:
    """``[runs, 7]`` int64 on the device: :func:`~.runs.run_table` and the key of each run."""
    t = run_table(lay, *lay.run_bounds(), size)
    key = t.new_full((t.shape[0],), -1)
    if isinstance(keys, torch.Tensor):
        key = keys.to(t.device)[t[:, 0], t[:, 1]].long()
    return torch.cat([t, key[:, None]], 1)


def read_runs(lay: TokenLayout, keys=None) -> list[Run]:
    """Each run in token order, in one transfer sized by the runs (no structure check)."""
    rows = to_host(_table(lay, keys, None), why="run order of a call mixing modalities")
    return runs_of(rows.tolist(), lay.grammar)


def verify_in_token_order(
    lay: TokenLayout,
    batch: Batch,
    codes: Sequence[int],
    late: RunOrder,
    features: torch.Tensor | None,
) -> tuple[Verdict, tuple[int, ...], Batch, list[tuple[torch.Tensor | None, list[int]]]]:
    """The verdict of items in consumption order, their token order, the batch (cut by
    ``late.counts`` / ``late.runs``) and the scatter's ``(mask, items)`` groups (mask None:
    every placeholder). Not aligned: the order comes from every run (the fault path)."""
    items = batch.items
    sized = late.counts is not None
    groups = _groups(items, codes, late)
    shared = {
        c for c, t in groups if t is None and len({items[i].modality for i in groups[c, t]}) > 1
    }
    extra, tables, size = [], [], 0
    if shared:  # the lengths decide: the first runs come with the verdict
        size = len(items) if sized else sum(1 for it in items if it.num_features)
        extra.append(_table(lay, late.keys, size).reshape(-1))
    else:
        tables = [
            _expected(lay, items, mine, c, t, late, batch.explicit)
            for (c, t), mine in groups.items()
        ]
    n = len(items)
    if sized:
        extra.append(late.counts.to(torch.int64))
        extra += [t.to(torch.int64).reshape(-1) for t in (late.runs, late.samples) if t is not None]
    if late.checks:
        extra.append(torch.stack([t.reshape(()).to(torch.int64) for t, _ in late.checks]))
    if features is not None and late.probe is not None:  # (no copy beside no features)
        probe = late.probe.reshape(-1).to(features.dtype)
        features = torch.cat([features.reshape(-1), probe]) if features.numel() else probe
    verdict, vals = verify(lay, tables, features, extra)
    for (_, refuse), flag in zip(late.checks, vals[len(vals) - len(late.checks) :]):
        if flag:
            refuse()
    if sized:  # the items and their features cut by the counts (and runs) now on the host
        got = [int(v) for v in vals[7 * size : len(vals) - len(late.checks)]]
        got, feats = late.resize(got[:n], got[n:] or None)
        batch = normalize(feats, got, lay.num_samples)
        items = batch.items
        codes = [lay.grammar.modality_code(it.modality) for it in items]
        groups = _groups(items, codes, late)
    owning = [i for i in range(len(items)) if items[i].num_features]
    if not shared and verdict.aligned(len(owning)):  # consumption order, per modality
        scatter = [(_mask(lay, c, t, late), mine) for (c, t), mine in groups.items()]
        return verdict, tuple(range(len(items))), batch, scatter
    if not shared or verdict.runs > size or verdict.findings:  # not every run in the table
        runs = read_runs(lay, late.keys)
    else:
        runs = runs_of([vals[k : k + 7] for k in range(0, 7 * verdict.runs, 7)], lay.grammar)
    order = tuple(late.order(runs, items))
    owning = [i for i in order if items[i].num_features]
    if shared:
        verdict = replace(
            verdict, bad_runs=misplaced(runs, items, order, lay.grammar, batch.explicit)
        )
    return verdict, order, batch, [(None, owning)]


def misplaced(
    runs: Sequence[Run],
    items: Sequence[MediaItem],
    order: Sequence[int],
    grammar: Grammar,
    explicit: bool = False,
) -> int:
    """The runs (token order) that disagree with the item ``order`` gives each (its length,
    its placeholder token and, ``explicit``, its sample), and the runs or items left over."""
    owning = [i for i in order if items[i].num_features]
    bad = abs(len(runs) - len(owning))
    for r, i in zip(runs, owning):
        it = items[i]
        ok = r.length == it.num_features and r.modality == grammar.token_modality(it.modality)
        bad += not (ok and (not explicit or r.sample == it.sample))
    return bad


def _groups(items, codes, late: RunOrder) -> dict[tuple[int, int | None], list[int]]:
    """``(code, type) -> items`` in consumption order."""
    return queued([(c, late.types.get(it.modality)) for c, it in zip(codes, items)])


def _expected(lay, items, mine: list[int], code: int, typ, late: RunOrder, explicit: bool):
    """One modality's items as its table (counts from ``late`` where it has them)."""
    dev = lay.device
    at = torch.tensor(mine, dtype=torch.int64).to(dev, non_blocking=True)
    counts = (
        late.counts if late.counts is not None else torch.tensor([it.num_features for it in items])
    )
    counts = counts.to(dev, torch.int64).index_select(0, at)
    runs = torch.ones_like(counts) if late.runs is None else late.runs.to(dev).index_select(0, at)
    smp = None
    if explicit:
        smp = torch.tensor([items[i].sample for i in mine]).to(dev, non_blocking=True)
    where = None if typ is None else late.keys.to(dev) == typ
    if runs.dim() == 2:  # each run's length: one row per run (none past the item's runs)
        smp = None if smp is None else smp.repeat_interleave(runs.shape[1])
        return Expected(code, torch.ones_like(runs).reshape(-1), runs.reshape(-1), smp, where=where)
    # an equal share of the item's features per run: runs x share must make its count
    return Expected(code, runs, counts // runs.clamp(min=1), smp, counts, where=where)


def _mask(lay: TokenLayout, code: int, typ, late: RunOrder) -> torch.Tensor:
    """The placeholders of one modality: its code's, of its type where the code is shared."""
    mask = lay.code == code
    return mask if typ is None else mask & (late.keys.to(mask.device) == typ)


def in_token_order(batch: Batch, order: Sequence[int], num_samples: int) -> Batch:
    """``batch`` with its items (and their feature rows) in ``order`` (the fault path)."""
    f = batch.features
    parts = [f[slice(*batch.rows(i))] for i in order]
    return normalize(parts, [batch.items[i] for i in order], num_samples)


def interleave(
    runs: Sequence[int],
    first: Sequence[int],
    second: Sequence[int],
    *,
    groups: Sequence[int] | None = None,
    run_samples: Sequence[int] | None = None,
):
    """``(streams, unique)``: the stream (0: ``first``, 1: ``second``) of each run, each
    stream's order kept, every run as long as its item (None: no interleaving fits); ``unique``
    False when several fit (the same one is returned every time). groups: per item of
    ``second`` its model-level item (a video's tubelets take consecutive runs of one sample,
    ``run_samples``). O(runs x min(len)) states."""
    n, p, q = len(runs), len(first), len(second)
    if n != p + q:
        return None, False

    def may_take_second(j: int, r: int, last: int) -> bool:
        if groups is None or j == 0 or groups[j] != groups[j - 1]:
            return True  # a new group may start anywhere
        same = run_samples is None or run_samples[r] == run_samples[r - 1]
        return last == 1 and same  # its group's previous item took the run just before

    # state (i, last): i items of ``first`` used, the previous run took stream ``last``;
    # value: number of interleavings reaching it, capped at 2
    ways: dict[tuple[int, int], int] = {(0, -1): 1}
    back: list[dict[tuple[int, int], tuple[int, int]]] = []
    for r, length in enumerate(runs):
        nxt: dict[tuple[int, int], int] = {}
        came: dict[tuple[int, int], tuple[int, int]] = {}
        for (i, last), w in sorted(ways.items()):
            j = r - i
            if i < p and first[i] == length:
                key = (i + 1, 0)
                nxt[key] = min(2, nxt.get(key, 0) + w)
                came.setdefault(key, (i, last))
            if j < q and second[j] == length and may_take_second(j, r, last):
                key = (i, 1)
                nxt[key] = min(2, nxt.get(key, 0) + w)
                came.setdefault(key, (i, last))
        if not nxt:
            return None, False
        ways = nxt
        back.append(came)
    ends = [(k, w) for k, w in sorted(ways.items()) if k[0] == p]
    if not ends:
        return None, False
    total = min(2, sum(w for _, w in ends))
    out = [0] * n
    state = ends[0][0]
    for r in range(n - 1, -1, -1):
        out[r] = state[1]
        state = back[r][state]
    return out, total == 1


def token_order(ids, grammar: Grammar, items: list[MediaItem], parent: list[int]) -> list[int]:
    """The items' permutation into token order (several modalities: from the runs read)."""
    if len({it.modality for it in items}) <= 1:
        return list(range(len(items)))
    return order_runs(read_runs(TokenLayout(ids, grammar)), grammar, items, parent)


def take_per_run(queues: Mapping[object, list[int]], run_keys: Sequence[object]):
    """Each run takes the next index queued under its key: ``(taken, rest)``, ``taken`` one
    index per run in run order (-1 where its key has none left), ``rest`` the indices no run
    took. ``queues`` are copied, never emptied."""
    left = {k: list(v) for k, v in queues.items()}
    taken = [left[k].pop(0) if left.get(k) else -1 for k in run_keys]
    return taken, [i for q in left.values() for i in q]


def queued(keys: Sequence[object]) -> dict[object, list[int]]:
    """Indices ``0..len(keys)-1`` grouped by their key, each group in order."""
    return by_key((k, i) for i, k in enumerate(keys))


def order_runs(
    runs: Sequence[Run], grammar: Grammar, items: list[MediaItem], parent: list[int]
) -> list[int]:
    """The items' permutation into token order given the runs: a run of a shared token takes
    the item the unique length interleaving gives it (several: :class:`MediaInputError`);
    items that all carry their sample (no shared token) are taken per sample."""
    if len({it.modality for it in items}) <= 1:
        return list(range(len(items)))
    g = grammar
    streams: dict[str, dict[str, list[int]]] = {}  # token modality -> modality -> item indices
    for i, it in enumerate(items):
        tok = g.token_modality(it.modality)
        streams.setdefault(tok, {}).setdefault(it.modality, []).append(i)
    queue: dict[object, list[int]] = {}  # a run's key -> the items its runs take, in order
    tied = all(it.sample is not None for it in items)
    tied = tied and all(len(v) == 1 for v in streams.values())
    if tied:
        # items tied to their samples: a run takes the next item of its modality in its sample,
        # so that one sample's surplus or shortfall never shifts another's items
        queue = queued([(it.sample, g.token_modality(it.modality)) for it in items])
    for tok, by_mod in () if tied else streams.items():
        seqs = list(by_mod.values())
        if len(seqs) == 1:
            queue[tok] = seqs[0]
            continue
        if len(seqs) > 2:
            raise MediaInputError(f"more than two modalities share the {tok!r} token")
        a, b = seqs
        tok_runs = [r for r in runs if r.modality == tok]
        pick, unique = interleave(
            [r.length for r in tok_runs],
            [items[i].num_features for i in a],
            [items[i].num_features for i in b],
            groups=[parent[i] for i in b],
            run_samples=[r.sample for r in tok_runs],
        )
        if pick is None:  # no interleaving fits: consumption order, the guard reports it
            queue[tok] = a + b
            continue
        if not unique:  # equal lengths at a choice: the ids cannot tell, and a guess is silent
            raise MediaInputError(
                f"{' and '.join(by_mod)} runs share the {tok!r} token and have equal lengths "
                "where their order is open: the ids cannot tell which is which. Give "
                "handle.set_items(...) with one MediaItem per item in token order"
            )
        ia, ib = iter(a), iter(b)
        queue[tok] = [next(ia) if s == 0 else next(ib) for s in pick]
    taken, rest = take_per_run(
        queue, [(r.sample, r.modality) if tied else r.modality for r in runs]
    )
    return [i for i in taken if i >= 0] + rest  # beyond the runs: the guard reports them
