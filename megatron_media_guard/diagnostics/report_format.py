"""Text rendering of a :class:`~.report.ReportSummary` (``media-guard report`` without ``--json``;
its sections: docs/DIAGNOSTICS.md). Long tables are cut with a pointer to ``--json``; files are
named relative to the directory they share; every control character is shown escaped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .records import cut_words, summary_line
from .report import ReportSummary, _event_order
from .report_lines import OFFENDING_EVENTS

_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def neutralise(text: str) -> str:
    """``text`` with every control character but newline shown as an escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def _namer(files: Sequence[str]) -> Callable[[str], str]:
    """A function naming a file relative to the directory all ``files`` share (its base name
    when there is one file, or no shared directory)."""
    try:
        dirs = [os.path.dirname(f) or "." for f in files]
        root = os.path.commonpath(dirs) if len(files) > 1 else ""
    except ValueError:  # absolute and relative paths mixed
        root = ""
    return lambda f: os.path.relpath(f, root) if root else Path(f).name


def fatal_text(ff: Mapping[str, object], name) -> tuple[str, str]:
    """The first fatal record's line (no ``[media-guard]`` head) and its ``file:line``."""
    where = f"{name(str(ff.get('_file')))}:{ff.get('_line')}"
    return summary_line(ff).removeprefix("[media-guard] "), where


def _table(
    title: str, counts: Mapping[str, int], limit: int = 20, cut: int | None = 100
) -> list[str]:
    """Rows ``key  count``; keys cut at ``cut`` characters (None: never, count first)."""
    if not counts:
        return []
    out = [f"{title}:"]
    if cut is None:  # full text (reasons): counts first, so rows line up however long
        out += [f"  {n:>10,}  {k}" for k, n in list(counts.items())[:limit]]
    else:
        rows = [(cut_words(k, cut), n) for k, n in list(counts.items())[:limit]]
        width = max(len(k) for k, _ in rows)
        out += [f"  {k:<{width}}  {n:>10,}" for k, n in rows]
    if len(counts) > limit:
        out.append(f"  ... {len(counts) - limit} more (see --json)")
    return out


def _rank_table(by_rank: Mapping[int | None, Mapping[str, int]], limit: int = 32) -> list[str]:
    if not by_rank:
        return []
    events = _event_order({e: 1 for per in by_rank.values() for e in per})
    ranks = list(by_rank)
    if len(ranks) > limit:  # show the ranks with most offending records
        ranks = sorted(ranks, key=lambda r: -sum(by_rank[r].get(e, 0) for e in OFFENDING_EVENTS))[
            :limit
        ]
        ranks.sort(key=lambda r: (r is None, r or 0))
    cols = ["total", *events]
    widths = [max(10, len(c)) for c in cols]
    out = ["by rank:", "  " + f"{'rank':>6}" + "".join(f"  {c:>{w}}" for c, w in zip(cols, widths))]
    for r in ranks:
        per = by_rank[r]
        vals = [sum(per.values()), *(per.get(e, 0) for e in events)]
        row = "".join(f"  {v:>{w},}" for v, w in zip(vals, widths))
        out.append(f"  {'?' if r is None else r:>6}{row}")
    if len(by_rank) > limit:
        out.append(f"  ... {len(by_rank) - limit} more ranks (see --json)")
    return out


def format_summary(summary: ReportSummary) -> str:
    """A human report: totals, skipped lines, first fatal, tables by rank/event/action/reason."""
    s = summary
    lines = [
        f"media-guard report: {len(s.files)} file(s), {s.records:,} records"
        + (f", {s.matched:,} after filters" if s.matched != s.records else "")
        + (f", steps {s.first_step}..{s.last_step}" if s.first_step is not None else "")
    ]
    if s.ranks_filter is not None or s.steps_filter is not None:
        lines.append(f"filters: ranks={s.ranks_filter} steps={s.steps_filter}")
    if not s.files:
        lines.append("no media_guard.rank*.jsonl files found")
    name = _namer(s.files)
    for f, why in s.skipped_files.items():
        lines.append(f"skipped file {name(f)}: {why}")
    if s.malformed:
        per = ", ".join(f"{name(f)}: {n}" for f, n in list(s.malformed_by_file.items())[:20])
        lines.append(f"skipped {s.malformed:,} malformed line(s) ({per})")
    for f in s.torn_files:
        lines.append(f"skipped a torn last line in {name(f)}")
    if s.other_schema:
        lines.append(f"note: {s.other_schema:,} record(s) with a schema other than 1")
    if s.first_fatal is not None:
        ff = s.first_fatal
        text, where = fatal_text(ff, name)
        at = "" if ff.get("time") is None else f" at {cut_words(str(ff.get('time')), 40)}"
        lines += [f"first fatal: {text}", f"  [{where}]{at}"]
    else:
        lines.append("first fatal: none (no 'raise' record)")
    lines += _rank_table(s.by_rank)
    lines += _table("by event", s.by_event)
    lines += _table("by action", s.by_action)
    if any(k.endswith("(consensus)") for k in s.by_action):
        lines.append(
            "  (consensus: every rank's record of a stage-wide round; the stage's action, not its own)"
        )
    lines += _table("by reason (digits shown as #, full text)", s.by_reason, cut=None)
    note = "" if s.sample_ids_exact else " (estimated: counts are lower bounds)"
    ids = {repr(k): n for k, n in s.top_sample_ids}  # a str and an int never share a repr
    lines += _table(f"top offending sample ids (repair/drop/raise){note}", ids, len(ids), 80)
    return neutralise("\n".join(lines))
