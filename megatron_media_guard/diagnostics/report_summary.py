"""The result of ``media-guard report``: :class:`ReportSummary` (its JSON form is
:meth:`ReportSummary.to_dict`). Never imports torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType


def _empty() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class GridCounts:
    """Exact counts in (rank, step) bins: ``cells[(first rank, first step, label)] = n``.

    A bin holds ranks ``r .. r + rank_bin - 1`` and steps ``s .. s + step_bin - 1`` (bins are
    aligned at multiples of their size); rank None: records with no rank, step None: records
    with no step. ``label`` is the event (heatmap) or the action (events over steps)."""

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
        """Plain JSON-ready data (rank keys as strings, ``"null"`` for unknown). The grids
        (``heat``, ``series``) are left out: the page draws them (``--html``)."""
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
