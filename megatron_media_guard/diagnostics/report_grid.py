"""The data of ``media-guard report``: bounded counters (heavy hitters for sample ids, binned
(rank, step) grids for the page's heatmap and its records-over-steps charts, the one-line labels
fields are counted under), each holding at most a fixed number of entries whatever the input,
and :class:`ReportSummary`, the frozen result they fold into (its JSON form:
:meth:`ReportSummary.to_dict`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from .records import one_line

NONE_LABEL = "(none)"
OTHER_LABEL = "(other)"
_LABEL_LEN = 120


def _shift(value: int | None, bits: int) -> int | None:
    """``value >> bits``; None (no rank or step) stays None."""
    return None if value is None else value >> bits


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
        rs, ss = self.rank_shift, self.step_shift  # inline: the reader's hot path
        key = (None if rank is None else rank >> rs, None if step is None else step >> ss, label)
        have = self.counts.get(key)
        if have is None:
            key, have = self.room(rank, step, label)
        self.counts[key] = have + n

    def room(self, rank: int | None, step: int | None, label: str) -> tuple[tuple, int]:
        """The key for a (rank, step, label) not yet counted, after making room for it; and
        its current count (0 unless the label or a coarsening folded it into a known key)."""
        if label not in self.labels:
            if len(self.labels) >= self.max_labels:
                label = OTHER_LABEL
            self.labels.add(label)
        while True:
            key = (_shift(rank, self.rank_shift), _shift(step, self.step_shift), label)
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
            key = (_shift(r, dr), _shift(s, ds), label)
            out[key] = out.get(key, 0) + n
        self.counts, self.rank_shift, self.step_shift = out, rank_shift, step_shift

    def merge(self, other: _Grid) -> None:
        """Fold in another grid (bins coarsened to the larger of the two bin sizes)."""
        rs = max(self.rank_shift, other.rank_shift)
        ss = max(self.step_shift, other.step_shift)
        if (rs, ss) != (self.rank_shift, self.step_shift):
            self._rekey(rs, ss)
        for (r, s, label), n in other.cells().items():
            self.add(r, s, label, n)

    def cells(self) -> dict[tuple[int | None, int | None, str], int]:
        """``(first rank of the bin, first step of the bin, label) -> count``."""
        rs, ss = self.rank_shift, self.step_shift
        return {
            (None if r is None else r << rs, None if s is None else s << ss, label): n
            for (r, s, label), n in self.counts.items()
        }


def _label(value: object, limit: int = _LABEL_LEN) -> str:
    """A one-line string key for a field (None, numbers, garbage, long text): a non-string as
    its JSON, then :func:`.records.one_line`."""
    if value is None:
        return NONE_LABEL
    if not isinstance(value, str):
        try:
            value = json.dumps(value, default=str)
        except (ValueError, TypeError, RecursionError):  # huge ints, deep nesting
            value = f"<{type(value).__name__}>"
    return one_line(value, limit) or NONE_LABEL


def _empty() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class GridCounts:
    """Exact counts in (rank, step) bins: ``cells[(first rank, first step, label)] = n``; a bin
    holds ranks ``r .. r + rank_bin - 1`` and steps ``s .. s + step_bin - 1`` (aligned at
    multiples of its size); None: records with no rank / step. ``label``: the event (heatmap)
    or ``"records"`` (records over steps)."""

    rank_bin: int = 1
    step_bin: int = 1
    cells: Mapping[tuple[int | None, int | None, str], int] = field(default_factory=_empty)


@dataclass(frozen=True)
class ReportSummary:
    """What ``media-guard report`` found across the files (after the rank/step filters).

    by_rank: rank -> event -> count; rank None: unknown (no rank in the record or the file name).
    top_sample_ids: (sample_id, count) for events repair/drop/raise, most frequent first.
    first_fatal: the first ``raise`` record as read (strings, lists and nesting bounded), plus
        ``_file`` and ``_line``; None if none.
    skipped_files: file -> why it was not read (not a regular file, unreadable, read error).
    by_action: consensus records' actions are labelled ``"<action> (consensus)"``: each rank
        of a stage writes one when any rank raises, so they do not count as raises.
    """

    files: tuple[str, ...]
    lines: int
    records: int
    matched: int
    malformed: int
    malformed_by_file: Mapping[str, int]
    torn_files: tuple[str, ...]
    other_schema: int
    skipped_files: Mapping[str, str]
    by_rank: Mapping[int | None, Mapping[str, int]]
    by_event: Mapping[str, int]
    by_reason: Mapping[str, int]
    by_action: Mapping[str, int]
    top_sample_ids: tuple[tuple[str | int, int], ...]
    sample_ids_exact: bool
    first_step: int | None
    last_step: int | None
    first_fatal: Mapping[str, object] | None
    ranks_filter: tuple[int, ...] | None = None
    steps_filter: tuple[int, ...] | None = None
    heat: GridCounts = field(default_factory=GridCounts)
    series: GridCounts = field(default_factory=GridCounts)
    by_kind: Mapping[tuple[str, str, str], int] = field(default_factory=_empty)
    reason_examples: Mapping[str, Mapping[str, object]] = field(default_factory=_empty)
    sample_examples: Mapping[object, Mapping[str, object]] = field(default_factory=_empty)

    def by(self, which: str) -> dict[str, dict[str, int]]:
        """``"modality"`` or ``"family"`` -> event -> count, from ``by_kind``."""
        pos = {"modality": 0, "family": 1}[which]
        out: dict[str, dict[str, int]] = {}
        for key, n in self.by_kind.items():
            per = out.setdefault(key[pos], {})
            per[key[2]] = per.get(key[2], 0) + n
        return out

    def count(self, event: str) -> int:
        """Records of ``event`` that passed the filters."""
        return self.by_event.get(event, 0)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready data (rank keys as strings, ``"null"`` for unknown); without the
        grids (``heat``, ``series``: the page draws them)."""
        d: dict[str, object] = {}
        for f in fields(self):
            if f.name in ("heat", "series", "by_kind", "sample_examples"):
                continue
            v = getattr(self, f.name)
            d[f.name] = (
                dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v
            )
        d["by_rank"] = {
            ("null" if r is None else str(r)): dict(ev) for r, ev in self.by_rank.items()
        }
        d["top_sample_ids"] = [
            {"sample_id": s, "count": n, "example": dict(self.sample_examples.get(s) or {})}
            for s, n in self.top_sample_ids
        ]
        d["reason_examples"] = {k: dict(v) for k, v in self.reason_examples.items()}
        d["by_modality"] = self.by("modality")
        d["by_family"] = self.by("family")
        return d
