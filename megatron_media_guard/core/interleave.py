"""Items in token order when a call holds several modalities: each placeholder token's runs
take its modality's items in the order the model consumes them, and where two modalities
share one token (Nemotron Omni's images and video tubelets both use ``<image>``) the lengths
decide which stream feeds each run. Host-side, off the single-modality aligned path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..errors import MediaInputError
from .grammar import Grammar
from .host import to_host
from .items import MediaItem
from .run_table import run_table
from .runs import TokenLayout


class _Run(NamedTuple):
    sample: int
    modality: str
    length: int


def _runs(ids, grammar: Grammar) -> list[_Run]:
    """Each run's sample, modality and length in token order, in one transfer sized by the
    runs (no structure check: the merge that follows checks the runs, this only orders)."""
    lay = TokenLayout(ids, grammar)
    t = run_table(lay, *lay.run_bounds())[:, [5, 4, 3]]
    rows = to_host(t, why="run order of a call mixing modalities").tolist()
    names = grammar.modalities
    return [_Run(s, names[c] if c >= 0 else "break", n) for s, c, n in rows]


def interleave(
    runs: Sequence[int],
    first: Sequence[int],
    second: Sequence[int],
    *,
    groups: Sequence[int] | None = None,
    run_samples: Sequence[int] | None = None,
):
    """Stream (0: ``first``, 1: ``second``) of each run, keeping each stream's order, so that
    every run's length equals its item's.

    groups: per item of ``second``, the model-level item it belongs to (a video's tubelets):
        one group's items take consecutive runs of one sample (``run_samples``).
    Returns ``(streams, unique)``: ``streams`` None when no interleaving fits (the guard then
    reports the mismatch); ``unique`` False when several fit (equal lengths at an open choice;
    the same one is returned every time). O(runs x min(len)) states.
    """
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
    """The items' permutation into token order. One modality: as consumed. Several: the runs'
    order read from the ids (a transfer sized by the runs; mixed batches only); a run whose
    token several modalities share takes the item the length interleaving gives it (when
    only one interleaving fits; else :class:`MediaInputError` asks for ``set_items``). Items
    that all carry their sample (no shared token) are taken per sample."""
    if len({it.modality for it in items}) <= 1:
        return list(range(len(items)))
    g = grammar
    runs = _runs(ids, g)
    streams: dict[str, dict[str, list[int]]] = {}  # token modality -> modality -> item indices
    for i, it in enumerate(items):
        tok = g.token_modality(it.modality)
        streams.setdefault(tok, {}).setdefault(it.modality, []).append(i)
    if all(it.sample is not None for it in items) and all(len(v) == 1 for v in streams.values()):
        # items tied to their samples: a run takes the next item of its modality in its sample,
        # so that one sample's surplus or shortfall never shifts another's items
        mine: dict[tuple[int, str], list[int]] = {}
        for i, it in enumerate(items):
            mine.setdefault((it.sample, g.token_modality(it.modality)), []).append(i)
        order = [mine[k].pop(0) for r in runs if mine.get(k := (r.sample, r.modality))]
        return order + [i for q in mine.values() for i in q]  # beyond the runs: reported
    runs_of: dict[str, list[int]] = {}
    samples_of: dict[str, list[int]] = {}
    for r in runs:
        runs_of.setdefault(r.modality, []).append(r.length)
        samples_of.setdefault(r.modality, []).append(r.sample)
    queue: dict[str, list[int]] = {}
    for tok, by_mod in streams.items():
        seqs = list(by_mod.values())
        if len(seqs) == 1:
            queue[tok] = seqs[0]
            continue
        if len(seqs) > 2:
            raise MediaInputError(f"more than two modalities share the {tok!r} token")
        a, b = seqs
        la = [items[i].num_features for i in a]
        lb = [items[i].num_features for i in b]
        pick, unique = interleave(
            runs_of.get(tok, []),
            la,
            lb,
            groups=[parent[i] for i in b],
            run_samples=samples_of.get(tok, []),
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
    order: list[int] = []
    for r in runs:
        q = queue.get(r.modality)
        if q:
            order.append(q.pop(0))
    order += [i for q in queue.values() for i in q]  # items beyond the runs: the guard reports
    return order
