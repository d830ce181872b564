"""Bounded counters and labels behind ``media-guard report``: heavy hitters for sample ids,
binned (rank, step) grids for the page's heatmap and its events-over-steps charts, and the
bounded one-line labels fields are counted under. Never imports torch; every structure holds
at most a fixed number of entries whatever the input.
"""

from __future__ import annotations

import json

from .records import cut_words

NONE_LABEL = "(none)"
OTHER_LABEL = "(other)"
_LABEL_LEN = 120
_LABEL_SCAN = 1024  # a short label depends only on this much of a string (memo keys stay small)


class _HeavyHitters:
    """Counts of hashable keys in at most ``2 * capacity`` entries (batched Misra-Gries).

    While fewer than ``2 * capacity`` distinct keys arrive the counts are exact. On
    overflow the (capacity+1)-th largest count c is subtracted from every entry and
    the non-positive ones dropped: each estimate then undercounts by at most the
    sum of those c (``error``), and any key seen more than n/(capacity+1) times stays.

    ``examples`` holds, per key kept, where it was first seen: a tuple whose first two
    items are (file index, line number), so the earliest one wins a merge.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counts: dict[object, int] = {}
        self.examples: dict[object, tuple] = {}
        self.error = 0

    def add(self, key: object, example: tuple | None = None) -> None:
        counts = self.counts
        n = counts.get(key)
        if n is None:
            n = 0
            if example is not None:
                self.examples[key] = example
        counts[key] = n + 1
        if len(counts) >= 2 * self.capacity:
            self._prune()

    def merge(self, other: _HeavyHitters) -> None:
        """Fold in another summary (Misra-Gries summaries are mergeable: errors add)."""
        counts, examples = self.counts, self.examples
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0) + v
            ex = other.examples.get(k)
            if ex is not None and (k not in examples or ex[:2] < examples[k][:2]):
                examples[k] = ex
        self.error += other.error
        if len(counts) >= 2 * self.capacity:
            self._prune()

    def _prune(self) -> None:
        cut = sorted(self.counts.values(), reverse=True)[self.capacity]
        self.error += cut
        self.counts = {k: v - cut for k, v in self.counts.items() if v > cut}
        self.examples = {k: v for k, v in self.examples.items() if k in self.counts}

    def top(self, n: int) -> list[tuple[object, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], str(kv[0])))[:n]


class _Grid:
    """Exact counts of (rank, step, label) in bins: key ``(rank >> rank_shift or None,
    step >> step_shift or None, label)``; at most ``cap`` keys (plus those that cannot fold:
    records without a rank or step, and the bins -1 and 0 a negative rank or step ends in) and
    ``max_labels`` labels.

    When a new key would pass ``cap``, the dimension with more distinct bins (steps on a tie)
    doubles its bin size and the keys fold together: the counts stay exact per (coarser) bin.
    A label beyond ``max_labels`` counts as ``(other)``. Bins are aligned at multiples of the
    bin size (``start = index << shift``)."""

    def __init__(self, cap: int, max_labels: int = 64) -> None:
        self.cap = cap
        self.max_labels = max_labels
        self.labels: set[str] = set()
        self.counts: dict[tuple[int | None, int | None, str], int] = {}
        self.rank_shift = self.step_shift = 0

    def add(self, rank: int | None, step: int | None, label: str, n: int = 1) -> None:
        rs, ss = self.rank_shift, self.step_shift
        key = (None if rank is None else rank >> rs, None if step is None else step >> ss, label)
        counts = self.counts
        have = counts.get(key)
        if have is None:
            key, have = self.room(rank, step, label)
            counts = self.counts
        counts[key] = have + n

    def room(self, rank: int | None, step: int | None, label: str) -> tuple[tuple, int]:
        """The key for a (rank, step, label) not yet counted, after making room for it; and
        its current count (0 unless the label or a coarsening folded it into a known key)."""
        if label not in self.labels:
            if len(self.labels) >= self.max_labels:
                label = OTHER_LABEL
            self.labels.add(label)
        while True:
            rs, ss = self.rank_shift, self.step_shift
            key = (
                None if rank is None else rank >> rs,
                None if step is None else step >> ss,
                label,
            )
            have = self.counts.get(key)
            if have is not None or len(self.counts) < self.cap or not self._coarsen():
                return key, have or 0

    def _coarsen(self) -> bool:
        """Double the bin size of the busier dimension that can still fold; False when none
        can. A dimension folds while some bin index is neither 0 nor -1: shifting takes every
        index toward those two, so each doubling makes progress and the loop in :meth:`room`
        ends (negative ranks or steps never reach 0)."""
        ranks = {k[0] for k in self.counts if k[0] is not None}  # None bins never fold
        steps = {k[1] for k in self.counts if k[1] is not None}
        fold_r = len(ranks) > 1 and any(r not in (0, -1) for r in ranks)
        fold_s = len(steps) > 1 and any(s not in (0, -1) for s in steps)
        if not (fold_r or fold_s):
            return False
        if fold_s and (len(steps) >= len(ranks) or not fold_r):
            self._rekey(self.rank_shift, self.step_shift + 1)
        else:
            self._rekey(self.rank_shift + 1, self.step_shift)
        return True

    def _rekey(self, rank_shift: int, step_shift: int) -> None:
        dr, ds = rank_shift - self.rank_shift, step_shift - self.step_shift
        out: dict[tuple[int | None, int | None, str], int] = {}
        for (r, s, label), n in self.counts.items():
            key = (None if r is None else r >> dr, None if s is None else s >> ds, label)
            out[key] = out.get(key, 0) + n
        self.counts, self.rank_shift, self.step_shift = out, rank_shift, step_shift

    def merge(self, other: _Grid) -> None:
        """Fold in another grid (bins coarsened to the larger of the two bin sizes)."""
        rs = max(self.rank_shift, other.rank_shift)
        ss = max(self.step_shift, other.step_shift)
        if (rs, ss) != (self.rank_shift, self.step_shift):
            self._rekey(rs, ss)
        dr, ds = rs - other.rank_shift, ss - other.step_shift
        for (r, s, label), n in other.counts.items():
            rank = None if r is None else (r >> dr) << rs
            step = None if s is None else (s >> ds) << ss
            self.add(rank, step, label, n)

    def cells(self) -> dict[tuple[int | None, int | None, str], int]:
        """``(first rank of the bin, first step of the bin, label) -> count``."""
        rs, ss = self.rank_shift, self.step_shift
        return {
            (None if r is None else r << rs, None if s is None else s << ss, label): n
            for (r, s, label), n in self.counts.items()
        }


class _Steps:
    """Exact record counts per step bin (``step >> shift``), at most ``cap`` bins: when full,
    the bin size doubles and the bins fold together."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.counts: dict[int, int] = {}
        self.shift = 0

    def coarsen(self, to: int | None = None) -> None:
        shift = self.shift + 1 if to is None else to
        out: dict[int, int] = {}
        d = shift - self.shift
        for b, n in self.counts.items():
            out[b >> d] = out.get(b >> d, 0) + n
        self.counts, self.shift = out, shift

    def merge(self, other: _Steps) -> None:
        if other.shift > self.shift:
            self.coarsen(other.shift)
        d = self.shift - other.shift
        counts = self.counts
        for b, n in other.counts.items():
            counts[b >> d] = counts.get(b >> d, 0) + n
        while len(self.counts) > self.cap:
            self.coarsen()


def _label(value: object, limit: int = _LABEL_LEN) -> str:
    """A one-line string key for a field (None, numbers, garbage, long text): whitespace
    runs as one space, cut at a word boundary to at most ``limit`` characters."""
    if value is None:
        return NONE_LABEL
    scan = max(_LABEL_SCAN, 2 * limit + 16)
    if isinstance(value, str):
        text = value[:scan]
    else:
        try:
            text = json.dumps(value, default=str)[:scan]
        except (ValueError, TypeError, RecursionError):  # huge ints, deep nesting
            text = f"<{type(value).__name__}>"
    return cut_words(" ".join(text.split()), limit) or NONE_LABEL


def _family(rec: dict) -> object:
    """The model family a record names: ``family``, else ``extra.family`` / ``extra.adapter``."""
    if rec.get("family") is not None:
        return rec.get("family")
    extra = rec.get("extra")
    if isinstance(extra, dict):
        return extra.get("family", extra.get("adapter"))
    return None


def _small(value: object) -> object:
    """An int as is, anything else (None aside) as a short label: an item description."""
    return value if value is None or type(value) is int else _label(value, 40)


def _size(value: object) -> str | None:
    """``[h, w]`` as ``"HxW"``, anything else a short label (None stays None)."""
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return f"{value[0]}x{value[1]}"
    return _label(value, 40)
